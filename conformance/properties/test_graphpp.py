"""BND: GraphPP cuts a stage's joint graph into forward, dI and dW without cutting FP8 apart.

Every property draws a stage (a model whose input may or may not need a gradient: the first
stage of a pipeline has none) and checks the split of its graph as traced and after torch's
joint-graph CSE.
After CSE, a tensorwise ``Float8Linear`` quantizes the output gradient once for both backward
matmuls: the shared FP8 tensor the split must carry from dI to dW as an FP8 placeholder.
"""

from __future__ import annotations

import collections

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance.judge import rewrites
from conformance.draw.families import FAMILIES
from conformance.draw.family_examples import family_examples
from conformance.judge.dead_compute import dead_fp8_compute, keepable_dead_compute, needed_fp8_compute, unneeded_grad_inputs
from conformance.observe.graphs import fp8_compute_nodes, incompleteness, is_fp8_cast, is_fp8_compute, output_dependencies, tagged_groups
from conformance.api.errors import SplitFailure, ValidationFailure
from conformance.run.harness import (
    call_backend, check, fail, fp8_ops, fresh_args, fresh_copy, grad_outputs, note_kinds_left_out, strict_error, traced, traced_after_cse,
)
from conformance.run.stages import split_step
from conformance.draw.strategies import ALL_KINDS, model_specs, runnable_kinds, runnable_recipes
from conformance.api.types import StageSplit

#: Float8 and, for a backend that claims ``mx``, MX stages (about half the models then hold MX layers).
stages = model_specs(kinds=ALL_KINDS, families=FAMILIES)
# BND-001 runs the stages: linears on F.scaled_mm only where this torch runs them on CPU.
runnable_stages = model_specs(kinds=tuple(k for k in ALL_KINDS if k in runnable_kinds()), recipes=runnable_recipes(), families=FAMILIES)
PASSES = ("forward", "backward")


def _splits(property_id, backend, spec):
    """The drawn stage graph as traced and after torch's joint-graph CSE, each with the backend's
    split of it: ``[(label, stage graph, split)]``."""
    gm = traced(property_id, backend, spec).gm
    found = [("as traced", gm, _checked(property_id, backend, spec, call_backend(property_id, backend, "split_stage", gm, strict=True)))]
    cse = traced_after_cse(property_id, backend, spec)  # a graph of its own; gm stays as traced
    try:
        found.append(("after CSE", cse, _checked(property_id, backend, spec, backend.split_stage(cse, strict=True))))
    except ValidationFailure:
        # CSE may merge the FP8 compute of two modules that multiply the same operands (a layer
        # and its nested adapter); strict validation rightly rejects that graph as a stage.
        pass
    except SplitFailure as exc:
        fail(property_id, f"backend {backend.name!r}: split_stage() could not cut the CSE'd stage: SplitFailure: {exc}", spec)
    except Exception as exc:
        fail(property_id, f"backend {backend.name!r}: split_stage() of the CSE'd stage raised {type(exc).__name__}: {exc}", spec)
    return found


def _each_split(property_id, backend, spec, check_one):
    for label, gm, split in _splits(property_id, backend, spec):
        check_one(backend, spec, label, gm, split)


def _checked(property_id, backend, spec, split):
    import torch

    if not isinstance(split, StageSplit):
        fail(property_id, f"backend {backend.name!r}: split_stage() returned {type(split).__qualname__}, expected conformance.StageSplit", spec)
    for name, part in split.parts.items():
        if not isinstance(part, torch.fx.GraphModule):
            fail(property_id, f"backend {backend.name!r}: split_stage().{name} is a {type(part).__qualname__}, expected torch.fx.GraphModule", spec)
    missing = split.missing_convention()
    if missing:
        fail(property_id, f"backend {backend.name!r}: split_stage() gave neither a runner (run) nor the AOT convention: {', '.join(missing)} unset", spec)
    return split


def _pass_of(backend, node) -> str:
    return "backward" if backend.is_backward(node) else "forward"


def _by_pass(backend, gm, select) -> dict[str, list]:
    """The nodes of the stage graph that ``select`` picks and that some output of it needs
    (what counts: SPEC.md, "Counting what the outputs need"), by pass."""
    needed = output_dependencies(gm)
    found = {p: [] for p in PASSES}
    for node in gm.graph.nodes:
        if node in needed and select(node):
            found[_pass_of(backend, node)].append(node)
    return found


def _per_pass(backend, gm, split, select) -> list[tuple[str, list, list]]:
    """``(pass, picked in the stage graph, picked in its callables)`` for each pass."""
    joint, parts = _by_pass(backend, gm, select), _in_parts(split, select)
    return [(pass_name, joint[pass_name], parts[pass_name]) for pass_name in PASSES]


def _in_parts(split, select) -> dict[str, list]:
    """What ``select`` picks among the nodes each callable's own outputs need (the stage
    graph's definition), the forward callable against the forward pass and dI plus dW against
    the backward pass. A node no output of its callable needs does not count here; BND-002
    holds the callables to running no such FP8 compute."""

    def pick(part):
        needed = output_dependencies(part)
        return [n for n in part.graph.nodes if n in needed and select(n)]

    return {"forward": pick(split.forward), "backward": pick(split.backward_input) + pick(split.backward_weight)}


@pytest.mark.fp8_property("BND-001")
@family_examples
@given(spec=runnable_stages)
def test_BND_001_forward_then_dI_then_dW_reproduce_the_joint_step_bitwise(fp8_backend, spec):
    """Cheapest defect: describing the parameter gradients out of order (two gradients of equal
    shape swapped still "run"). The suite wires the callables itself by the ``StageSplit``
    convention and compares every output and gradient bitwise with the unsplit graph, as
    traced and after CSE."""
    note_kinds_left_out(fp8_backend)
    case = traced("BND-001", fp8_backend, spec)
    args, grads = fresh_args(spec, 0), grad_outputs(spec, 100)
    expected = call_backend("BND-001", fp8_backend, "run_joint", case.gm, case.model, args, grads)
    for label, gm, split in _splits("BND-001", fp8_backend, spec):
        _check_split_step(fp8_backend, spec, case, label, gm, split, args, grads, expected)


def _check_split_step(fp8_backend, spec, case, label, gm, split, args, grads, expected):
    import torch

    expected_out, expected_grads = expected
    step, runner_violation = split_step(split)
    seen_out, seen_grads = call_backend("BND-001", fp8_backend, "run_joint", gm, case.model, args, grads, fn=step)
    violation = runner_violation()
    check(violation is None, "BND-001", f"{label}: {violation}", spec)
    check(
        seen_grads.keys() == expected_grads.keys(),
        "BND-001",
        f"{label}: the split step returns gradients of {sorted(seen_grads)}, the joint graph of {sorted(expected_grads)}",
        spec,
    )
    pairs = [(f"output {i}", e, s) for i, (e, s) in enumerate(zip(expected_out, seen_out))]
    pairs += [(f"gradient of {k}", expected_grads[k], seen_grads[k]) for k in sorted(expected_grads)]
    for name, expected, seen in pairs:
        check(
            expected.shape == seen.shape and torch.equal(expected, seen),
            "BND-001",
            f"{label}, {name}: forward -> backward_input -> backward_weight differs from the unsplit joint graph "
            f"(max abs difference {(expected.float() - seen.float()).abs().max().item() if expected.shape == seen.shape else 'n/a: shapes differ'}); "
            "on CPU the split must compute the same ops on the same values",
            spec,
        )


@pytest.mark.fp8_property("BND-002")
@family_examples
@given(spec=stages)
def test_BND_002_every_fp8_compute_node_lands_in_exactly_one_callable(fp8_backend, spec):
    """Cheapest defects: dW running again the FP8 matmuls of dI whose results it needs (results
    stay bitwise equal, so BND-001 passes), and a split that leaves in dW a copy of each weight
    gradient's FP8 matmul that nothing reads (values and counts of what is needed stay right, and
    the callable's code runs the copies). The FP8 compute per pass that the callables' outputs
    need must equal the stage graph's; and no callable may hold FP8 compute its outputs do not
    need, beyond what the stage graph itself keeps for an in-place op. A defect that drops one
    matmul and duplicates another keeps the count but changes values (BND-001) and provenance
    (BND-005)."""
    _each_split("BND-002", fp8_backend, spec, _check_compute_placed_once)


def _check_compute_placed_once(fp8_backend, spec, label, gm, split):
    ops = fp8_ops("BND-002", fp8_backend)
    for pass_name, joint, parts in _per_pass(fp8_backend, gm, split, lambda n: is_fp8_compute(n, ops)):
        where = "the forward callable" if pass_name == "forward" else "backward_input and backward_weight together"
        check(
            len(parts) == len(joint),
            "BND-002",
            f"{label}: the stage's {pass_name} pass has {len(joint)} FP8 compute node(s) its outputs need, {where} hold "
            f"{len(parts)} that their outputs need: FP8 compute was {'duplicated' if len(parts) > len(joint) else 'dropped'} by the split",
            spec,
        )
    _check_no_dead_compute_runs(fp8_backend, spec, label, gm, split, ops)


def _check_no_dead_compute_runs(fp8_backend, spec, label, gm, split, ops):
    """A callable's code runs every node it holds: FP8 compute none of its outputs need runs for
    nothing. The backward callables may keep, between them, as much of it as the stage graph
    keeps for an in-place op (a grad_input nobody needs, at most one per call whose input needs
    no gradient, never a copy of other FP8 compute); dropping it is always right."""
    keepable = [n for n in keepable_dead_compute(gm, ops) if fp8_backend.is_backward(n)]
    allowance = min(len(keepable), sum(unneeded_grad_inputs(spec).values()))
    running = []
    for name, part in split.parts.items():
        covered = set(keepable_dead_compute(part, ops)) if name != "forward" else set()
        for node in dead_fp8_compute(part, ops):
            if node in covered and allowance > 0:
                allowance -= 1
            else:
                running.append(f"'{node.name}' ({node.target}) in {name}")
    shown = ", ".join(running[:4]) + (f" and {len(running) - 4} more" if len(running) > 4 else "")
    check(
        not running,
        "BND-002",
        f"{label}: the callables run {len(running)} FP8 compute node(s) that none of their outputs need: {shown}. A callable "
        "executes every node of its code; a copy the split left behind runs for nothing (remove it: dead FP8 compute may be dropped)",
        spec,
    )


@pytest.mark.fp8_property("BND-003")
@family_examples
@given(spec=stages)
def test_BND_003_no_tensor_is_quantized_twice_and_fp8_crosses_as_fp8(fp8_backend, spec):
    """Cheapest defect: dW casting again, from high precision or from the crossed scale, a tensor
    dI already quantized (bitwise equal on CPU). Casts per pass in the callables must equal the
    stage graph's, after CSE too (where one cast of the output gradient feeds both matmuls),
    and a value carried from dI to dW must keep its dtype."""
    _each_split("BND-003", fp8_backend, spec, _check_quantized_once)


def _check_quantized_once(fp8_backend, spec, label, gm, split):
    for pass_name, joint, parts in _per_pass(fp8_backend, gm, split, is_fp8_cast):
        extra = collections.Counter(str(n.target) for n in parts) - collections.Counter(str(n.target) for n in joint)
        check(
            len(parts) == len(joint),
            "BND-003",
            f"{label}: the stage's {pass_name} pass quantizes {len(joint)} time(s), its callables "
            f"{len(parts)} time(s) (extra casts: {dict(extra) or 'none'}): a value made in dI "
            "must reach dW as the FP8 tensor itself, not be quantized again from high precision",
            spec,
        )
    # What dW receives from dI keeps its dtype: an FP8 value crosses as an FP8 placeholder.
    # By the AOT convention the carried values follow the saved ones; a runner's are found by name.
    carried = list(split.backward_weight.graph.find_nodes(op="placeholder"))[len(split.saved_for_weight or ()) :]
    made_in_input = {n.name: n for n in split.backward_input.graph.nodes}
    for placeholder in carried:
        source = made_in_input.get(placeholder.name)
        if source is None or "val" not in source.meta or "val" not in placeholder.meta:
            continue
        source_dtype, placeholder_dtype = getattr(source.meta["val"], "dtype", None), getattr(placeholder.meta["val"], "dtype", None)
        check(
            source_dtype == placeholder_dtype,
            "BND-003",
            f"{label}: '{placeholder.name}' is {source_dtype} in backward_input but crosses into backward_weight as {placeholder_dtype}",
            spec,
        )


@pytest.mark.fp8_property("BND-004")
@family_examples
@given(spec=model_specs(kinds=ALL_KINDS, emulate=False, families=FAMILIES))
def test_BND_004_regions_re_identified_in_each_callable_are_complete(fp8_backend, spec):
    """Cheapest defect: treating an FP8 placeholder as a broken chain, so dW's regions (which start
    at the carried FP8 gradient) are never tagged; "every tagged group is complete" alone passes
    it. Per pass, the callables must tag at least as many FP8 compute nodes as the stage graph."""
    _each_split("BND-004", fp8_backend, spec, _check_regions_after_split)


def _check_regions_after_split(fp8_backend, spec, label, gm, split):
    ops = fp8_ops("BND-004", fp8_backend)
    call_backend("BND-004", fp8_backend, "regions", gm, expect=list)
    joint_tagged = _by_pass(fp8_backend, gm, lambda n, tagged=_tagged_nodes(gm): n in tagged and is_fp8_compute(n, ops))
    part_tagged = {p: [] for p in PASSES}
    for name, part in split.parts.items():
        call_backend("BND-004", fp8_backend, "regions", part, expect=list)
        groups = tagged_groups(part)
        for region_id, nodes in groups.items():
            reason = incompleteness(nodes, fp8_backend.is_backward, ops)
            check(reason is None, "BND-004", f"{label}, in {name}: tagged region {region_id!r} is incomplete: {reason}", spec)
        tagged = _tagged_nodes(part)
        computes = needed_fp8_compute(part, ops)
        part_tagged["forward" if name == "forward" else "backward"] += [n for n in computes if n in tagged]
    for pass_name in PASSES:
        check(
            len(part_tagged[pass_name]) >= len(joint_tagged[pass_name]),
            "BND-004",
            f"{label}: {len(joint_tagged[pass_name])} FP8 compute node(s) of the {pass_name} pass are tagged in the stage graph, "
            f"only {len(part_tagged[pass_name])} in its callables: the split left complete regions untagged (a region "
            "that starts at an FP8 placeholder, a value carried across the cut, is complete and must be tagged)",
            spec,
        )


def _tagged_nodes(gm) -> set:
    groups = tagged_groups(gm)
    return set().union(*groups.values()) if groups else set()


@pytest.mark.fp8_property("BND-005")
@family_examples
@given(spec=stages)
def test_BND_005_provenance_survives_the_split(fp8_backend, spec):
    """Cheapest defect: provenance handed round among dW's matmuls, so counts per module stay equal
    but nodes name the wrong module. Provenance is compared as a multiset per pass and, for
    every node kept under its name, node by node with the stage graph."""
    _each_split("BND-005", fp8_backend, spec, _check_provenance_kept)


def _check_provenance_kept(fp8_backend, spec, label, gm, split):
    ops = fp8_ops("BND-005", fp8_backend)
    fp8_node = lambda n: is_fp8_cast(n) or is_fp8_compute(n, ops)
    for pass_name, joint, parts in _per_pass(fp8_backend, gm, split, fp8_node):
        expected = collections.Counter(fp8_backend.provenance(n) for n in joint)
        seen = collections.Counter(fp8_backend.provenance(n) for n in parts)
        check(
            expected == seen,
            "BND-005",
            f"{label}: provenance of the FP8 casts and compute of the {pass_name} pass before the split: "
            f"{_show(expected)}; in the callables: {_show(seen)}",
            spec,
        )
    joint_by_name = {n.name: n for n in gm.graph.nodes if n.op == "call_function"}
    for name, part in split.parts.items():
        for node in part.graph.nodes:
            origin = joint_by_name.get(node.name)
            if node.op != "call_function" or origin is None or origin.target != node.target:
                continue
            check(
                fp8_backend.provenance(node) == fp8_backend.provenance(origin),
                "BND-005",
                f"{label}, in {name}: node '{node.name}' has provenance {fp8_backend.provenance(node)}, "
                f"in the stage graph {fp8_backend.provenance(origin)}",
                spec,
            )


def _show(counter) -> str:
    return "; ".join(f"{n}x {'none' if p is None else p.module_fqn}" for p, n in sorted(counter.items(), key=lambda kv: str(kv[0]))) or "nothing"


@pytest.mark.fp8_property("BND-006")
@family_examples
@given(spec=model_specs(kinds=ALL_KINDS, emulate=False, families=FAMILIES), data=st.data())
def test_BND_006_strict_validation_runs_before_the_split_and_not_falsely_after(fp8_backend, spec, data):
    for label, _, split in _splits("BND-006", fp8_backend, spec):
        for name, part in split.parts.items():
            error = strict_error("BND-006", fp8_backend, part)
            check(
                error is None,
                "BND-006",
                f"{label}: strict validation of the {name} callable of a valid stage raised {type(error).__name__}: {error}. "
                "A callable must not be failed for FP8 compute that lives in a sibling callable",
                spec,
            )
    # A drawn compute node of each pass in turn loses its provenance: the passes are a finite
    # space, enumerated rather than drawn.
    case = traced("BND-006", fp8_backend, spec)
    positions = {node: i for i, node in enumerate(case.gm.graph.nodes)}
    by_pass: dict[str, list] = {}
    for node in fp8_compute_nodes(case.gm, fp8_ops("BND-006", fp8_backend)):
        by_pass.setdefault("backward" if fp8_backend.is_backward(node) else "forward", []).append(node)
    for pass_name, nodes in sorted(by_pass.items()):
        compute = data.draw(st.sampled_from(nodes), label=f"{pass_name} FP8 compute node losing its provenance")
        broken, _ = fresh_copy(case)
        compute = list(broken.graph.nodes)[positions[compute]]
        rewrites.rebuild_without_meta(broken, compute)
        _check_rejected_before_the_cut(fp8_backend, spec, broken, f"{pass_name} FP8 compute '{compute.name}'")


def _check_rejected_before_the_cut(fp8_backend, spec, broken, what: str) -> None:
    """BND-006: ``split_stage(strict=True)`` of ``broken``, whose ``what`` lost its provenance,
    raises a ValidationFailure."""
    try:
        fp8_backend.split_stage(broken, strict=True)
    except ValidationFailure:
        return
    except SplitFailure as exc:
        fail("BND-006", f"split_stage(strict=True) of a stage whose {what} lost its provenance raised "
             f"SplitFailure, not a conformance.api.ValidationFailure: strict validation must reject the stage before "
             f"any cut is attempted: {exc}", spec)
    except Exception as exc:
        fail("BND-006", f"split_stage(strict=True) of a stage whose {what} lost its provenance raised "
             f"{type(exc).__name__}, not a conformance.api.ValidationFailure: {exc}", spec)
    fail(
        "BND-006",
        f"split_stage(strict=True) cut a stage graph whose {what} lost its provenance: "
        "strict validation must run on the whole stage before the cut",
        spec,
    )


@pytest.mark.fp8_property("BND-007")
@family_examples
@given(spec=stages)
def test_BND_007_backward_weight_holds_the_fp8_compute_no_input_gradient_needs(fp8_backend, spec):
    """The cheapest defect BND-001..006 let through: dI does all backward work and dW returns the
    finished gradients it was handed; every value and count stays right, only the schedule is
    lost. Here the suite counts, from the drawn model itself (whatever the backend's calling
    convention), which backward FP8 matmuls the stage's input gradient depends on, and holds dI
    to exactly those, per module: that split puts the grad_weight matmuls in dI and fails."""
    _each_split("BND-007", fp8_backend, spec, _check_weight_compute_in_dw)


def _check_weight_compute_in_dw(fp8_backend, spec, label, gm, split):
    ops = fp8_ops("BND-007", fp8_backend)
    expected_i, expected_w = _backward_compute_by_need(spec)
    owner = lambda n: getattr(fp8_backend.provenance(n), "module_fqn", None)
    # What each callable's outputs need counts; FP8 compute they do not need is BND-002's business.
    seen_i = collections.Counter(owner(n) for n in needed_fp8_compute(split.backward_input, ops))
    seen_w = collections.Counter(owner(n) for n in needed_fp8_compute(split.backward_weight, ops))
    check(
        seen_i == expected_i and seen_w == expected_w,
        "BND-007",
        f"{label}: per module, backward FP8 compute some input gradient depends on: {dict(expected_i)}, the rest: "
        f"{dict(expected_w)}; backward_input holds {dict(seen_i)}, backward_weight {dict(seen_w)} that their outputs need. "
        "dW's matmuls belong in backward_weight, which a zero-bubble schedule runs later; dI must not finish them",
        spec,
    )


def _backward_compute_by_need(spec) -> tuple[collections.Counter, collections.Counter]:
    """Per module, the backward FP8 matmuls the stage's input gradient depends on and the rest,
    from the drawn model alone (no calling convention of the backend's): each call's grad_input
    matmul feeds the chain down to the stage input when that input needs a gradient (a stack of
    layers: every grad_input flows through the ones below it); with no input gradient (a first
    stage) it serves only the weight gradients below it. grad_weight matmuls never feed it."""
    modules = spec.quantized_modules()
    needed, rest = collections.Counter(), collections.Counter()
    for fqn, input_grad in spec.calls():
        _kind, recipe, emulate = modules[fqn]
        if emulate:
            continue
        if input_grad:
            (needed if spec.input_requires_grad else rest)[fqn] += 1
        if recipe != "rowwise_with_gw_hp":
            rest[fqn] += 1
    return needed, rest
