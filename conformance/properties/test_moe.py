"""MOE: FP8 grouped experts (mixture-of-experts layers) keep their FP8 through provenance,
validation, regions, the GraphPP split and compilation (capability ``moe``, since spec 1.1).

Models are drawn MoE stacks (:class:`conformance.draw.moe.MoESpec`: a high-precision top-k router,
experts converted by the backend's ``convert_grouped_experts``, uneven token groups, empty ones
among them; for a backend that claims ``scaled_grouped_mm_v2``, MOE-001 to MOE-005 also draw
experts on ``F.scaled_grouped_mm``, converted by its ``convert_scaled_grouped_experts``) and single experts modules on drawn token groups (:class:`conformance.draw.moe.ExpertsSpec`).
The structural properties trace with fake tensors, which works on CPU builds without an FP8
grouped-GEMM kernel (for experts on ``F.scaled_grouped_mm``, under the suite's structure-only
Meta kernel, ``conformance.draw.moe.v2_grouped_structure``, around every backend call on such a model); the properties that execute graphs run real FP8 experts where the device
runs FP8 grouped GEMMs and emulated ones elsewhere; MOE-008 needs an sm90 GPU. Each property
also needs the capability of its area (``provenance``, ``validation``, ...): without it, it is
``not_supported``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools

import pytest
from hypothesis import example, given, settings

from conformance.observe import evidence
from conformance.judge import rewrites
from conformance.api.types import Compiled, Region, StageSplit
from conformance.judge.dead_compute import needed_fp8_compute
from conformance.observe.graphs import (
    fp8_compute_nodes, grouped_offsets, incompleteness, is_fp8_cast, is_fp8_dtype, tagged_groups, trace_with_oracle,
)
from conformance.run.harness import (
    built_with, call_backend, check, device, fail, fp8_compute_truth, fp8_ops, fresh_copy, moe_settings, names_module, names_pass, strict_error,
)
from conformance.draw.moe import (
    GROUPED_KIND, ExpertsSpec, build_experts_model, build_moe_model, experts_family, experts_inputs, has_v2_grouped_meta_kernel,
    v2_grouped_structure,
)
from conformance.run.gating import NOT_SUPPORTED
from conformance.report.notes import note
from conformance.draw.strategies import experts_specs, grouped_fp8_runs, grouped_v2_runs, moe_specs

# Tracing an MoE stack takes about a second on CPU: a few models per property, shared by all of
# them under a derandomized profile (traces are cached per model), and every model of that corpus.
_budget = moe_settings()
_TOLERANCE = 1e-2


def _needs(backend, *capabilities) -> None:
    missing = [c for c in capabilities if c not in backend.capabilities]
    if missing:
        pytest.skip(f"{NOT_SUPPORTED} backend {backend.name!r} does not claim {', '.join(missing)}")


@dataclasses.dataclass
class _Case:
    spec: object
    model: object
    args: tuple
    gm: object
    oracle: object


def _structure(spec):
    """Where ``spec``'s experts are on ``F.scaled_grouped_mm``: the suite's structure-only Meta
    kernel of ``aten._scaled_grouped_mm_v2`` (torch ships none), so that fake tensors trace and
    propagate through it; nothing otherwise."""
    if not spec.v2:
        return contextlib.nullcontext()
    if has_v2_grouped_meta_kernel(torchs_own=True):
        note("models with experts on F.scaled_grouped_mm drawn")
    else:
        note("models with experts on F.scaled_grouped_mm drawn, traced under the suite's structure-only Meta kernel "
             "of aten._scaled_grouped_mm_v2 (this torch has none)")
    return v2_grouped_structure()


@functools.lru_cache(maxsize=64)
def _trace(backend, spec, where: str) -> _Case:
    convert = backend.convert_scaled_grouped_experts if spec.v2 else backend.convert_grouped_experts
    build = build_moe_model if hasattr(spec, "layers") else build_experts_model
    model, args = build(spec, where, convert=convert)
    with _structure(spec):
        gm, oracle = trace_with_oracle(backend, model, args, list(spec.quantized_modules()), backend.is_backward)
    return _Case(spec, model, args, gm, oracle)


def _traced(property_id, backend, spec, where: str | None = None) -> _Case:
    """The backend's joint graph of ``spec``'s model, on a copy of its own (as ``harness.traced``)."""
    try:
        cached = _trace(backend, spec, where or device())
    except Exception as exc:
        fail(property_id, f"backend {backend.name!r}: converting or tracing the MoE model raised {type(exc).__name__}: {exc}", spec)
    evidence.built((experts_family(spec), *entry[1:]) for entry in built_with(backend, spec, cached.model))
    gm, oracle = fresh_copy(cached)
    return dataclasses.replace(cached, gm=gm, oracle=oracle)


def _pass_of(backend, node) -> str:
    return "backward" if backend.is_backward(node) else "forward"


@pytest.mark.fp8_property("MOE-001")
@_budget
@given(spec=moe_specs(emulate=None, v2=True))
def test_MOE_001_grouped_compute_carries_its_experts_provenance(fp8_backend, spec):
    """Cheapest defect: a backend that knows only linears and labels the experts' grouped GEMMs
    ``float8_linear`` (or loses them in the backward, where the routing's index ops sit between
    the experts). Every FP8 compute node must name the experts module the suite saw issue it,
    with kind ``float8_grouped_experts``, and the router's and routing's nodes must carry none."""
    _needs(fp8_backend, "provenance")
    with _structure(spec):
        case = _traced("MOE-001", fp8_backend, spec)
        ops = fp8_ops("MOE-001", fp8_backend)
        computes = fp8_compute_nodes(case.gm, ops)
        check(bool(computes) or spec.emulate, "MOE-001", "a model with non-emulated experts has no FP8 compute node", spec)
        for node in case.gm.graph.nodes:
            if node.op != "call_function":
                continue
            issued, found = case.oracle.issued_by.get(node), fp8_backend.provenance(node)
            where = f"{_pass_of(fp8_backend, node)} node '{node.name}' ({node.target})"
            if issued is None:
                check(found is None, "MOE-001", f"{where} belongs to no experts module (router, routing) but carries {found}", spec)
                continue
            if node in computes or found is not None:
                check(found is not None and found.module_fqn == issued, "MOE-001", f"{where} was issued by '{issued}', provenance says {found}", spec)
                check(found.kind == GROUPED_KIND and found.emulate == spec.emulate, "MOE-001",
                      f"{where}: provenance kind {found.kind!r}, emulate {found.emulate}; expected {GROUPED_KIND!r}, {spec.emulate}", spec)
                if fp8_backend.provenance_has_recipe or found.recipe is not None:  # a recipe given is checked
                    check(found.recipe == "rowwise", "MOE-001", f"{where}: provenance recipe {found.recipe!r}, expected 'rowwise'", spec)


@pytest.mark.fp8_property("MOE-002")
@_budget
@given(spec=moe_specs(emulate=None, v2=True))
def test_MOE_002_validation_accepts_moe_graphs_and_counts_grouped_gemms_per_call(fp8_backend, spec):
    """Cheapest defect: a validator that counts grouped experts like ``rowwise_with_gw_hp``
    linears (no FP8 grad_weight), so it fails every correct MoE graph, or one that counts the
    grad_input GEMM of a call whose input needs no gradient (the first layer's experts when the
    stage input needs none). The report's counts must equal the drawn model's, per module and pass."""
    _needs(fp8_backend, "validation")
    with _structure(spec):
        case = _traced("MOE-002", fp8_backend, spec)
        error = strict_error("MOE-002", fp8_backend, case.gm)
        check(error is None, "MOE-002", f"strict validation rejected a valid MoE graph: {type(error).__name__}: {error}", spec)
        report = call_backend("MOE-002", fp8_backend, "validate", case.gm, strict=False)
        seen = {k: v for k, v in report.compute_counts.items() if v}
        # What counts (SPEC.md, "Counting what the outputs need"): the recipe's count, to which a
        # grad_input GEMM nobody needs that the graph keeps for an in-place op may be added.
        truth = fp8_compute_truth("MOE-002", fp8_backend, spec, case.gm, case.oracle)
        wrong = sorted((k for k in set(seen) | set(truth.needed) if not truth.admits(k, seen.get(k, 0))), key=str)
        check(not wrong, "MOE-002", f"FP8 compute counts per (module, pass): {seen}, expected {truth.admitted_counts()}"
              + (f" (kept for in-place ops: {truth.kept})" if truth.kept else ""), spec)


@pytest.mark.fp8_property("MOE-003")
@_budget
@given(spec=moe_specs(emulate=False, v2=True))
def test_MOE_003_grouped_gemms_lowered_to_high_precision_fail_validation(fp8_backend, spec):
    """Cheapest defect: a validator that exempts grouped experts (it checks linears only), so a
    lowering that swaps ``_scaled_grouped_mm`` for the bf16 ``_grouped_mm`` passes. For each pass,
    the suite lowers every grouped GEMM of the first experts module and expects a strict failure
    naming that module and pass."""
    _needs(fp8_backend, "validation")
    with _structure(spec):
        fqn = spec.calls()[0][0]
        for pass_name in ("forward", "backward"):
            case = _traced("MOE-003", fp8_backend, spec)
            ops = fp8_ops("MOE-003", fp8_backend)
            targets = [n for n in fp8_compute_nodes(case.gm, ops)
                       if case.oracle.issued_by.get(n) == fqn and _pass_of(fp8_backend, n) == pass_name]
            if not targets:
                fail("MOE-003", f"module '{fqn}' has no FP8 grouped GEMM in the {pass_name} pass to lower", spec)
            for node in targets:
                if "grouped" not in str(node.target):
                    fail("MOE-003", f"FP8 compute '{node.name}' of '{fqn}' is {node.target}, not a grouped GEMM", spec)
                rewrites.lower_grouped_to_high_precision(case.gm, node)
            error = strict_error("MOE-003", fp8_backend, case.gm)
            check(error is not None, "MOE-003", f"strict validation accepted '{fqn}' with its {pass_name} grouped GEMMs in bf16", spec)
            check(names_module(error, fqn) and names_pass(error, pass_name), "MOE-003",
                  f"the error does not name module '{fqn}' and the {pass_name} pass: {error}", spec)


def _fp8_producers(node) -> set:
    """The casts to FP8 an FP8 operand comes from, through FP8 views and copies."""
    found, stack, seen = set(), [node], set()
    while stack:
        value = stack.pop()
        if value in seen or value.op != "call_function":
            continue
        seen.add(value)
        if is_fp8_cast(value):
            found.add(value)
        else:
            stack.extend(i for i in value.all_input_nodes if is_fp8_dtype(getattr(i.meta.get("val"), "dtype", None)))
    return found


@pytest.mark.fp8_property("MOE-004")
@_budget
@given(spec=moe_specs(emulate=False, v2=True))
def test_MOE_004_each_grouped_call_is_one_complete_region(fp8_backend, spec):
    """Cheapest defect: the seed's own limitation, a region pass that leaves grouped experts out
    (no region, nothing tagged), or one that tags the grouped GEMM with its token cast but hoists
    the expert weights' cast out of the region. Every grouped GEMM must lie in one reported,
    complete, tagged region that holds both its operands' casts and not the offsets' routing."""
    _needs(fp8_backend, "regions")
    with _structure(spec):
        case = _traced("MOE-004", fp8_backend, spec)
        ops = fp8_ops("MOE-004", fp8_backend)
        regions = call_backend("MOE-004", fp8_backend, "regions", case.gm, expect=list)
        if any(not isinstance(r, Region) for r in regions):
            fail("MOE-004", f"backend {fp8_backend.name!r}: regions() returned something other than conformance.Region", spec)
        membership = collections.Counter(n for r in regions for n in r.nodes)
        for node in fp8_compute_nodes(case.gm, ops):
            owners = [r for r in regions if node in r.nodes]
            check(len(owners) == 1 and owners[0].complete and owners[0].tagged, "MOE-004",
                  f"grouped GEMM '{node.name}' lies in {membership[node]} region(s); it must lie in one, complete and tagged", spec)
        groups = tagged_groups(case.gm)
        check(bool(groups), "MOE-004", "no node is tagged in an MoE graph with FP8 experts", spec)
        for region_id, nodes in groups.items():
            _check_tagged_group(fp8_backend, case, ops, region_id, nodes)


def _check_tagged_group(backend, case, ops, region_id, nodes) -> None:
    spec = case.spec
    reason = incompleteness(nodes, backend.is_backward, ops)
    check(reason is None, "MOE-004", f"tagged region {region_id!r} is incomplete: {reason}", spec)
    calls = {case.oracle.call_of.get(n) for n in nodes if n.op == "call_function"}
    passes = {_pass_of(backend, n) for n in nodes}
    check(len(calls) == 1 and None not in calls and len(passes) == 1, "MOE-004",
          f"tagged region {region_id!r} spans experts calls {sorted(map(str, calls))} and passes {sorted(passes)}", spec)
    for compute in (n for n in nodes if n in set(fp8_compute_nodes(case.gm, ops))):
        offs = grouped_offsets(compute)
        if offs is not None:
            check(offs not in nodes, "MOE-004", f"tagged region {region_id!r} holds the offsets '{offs.name}' of '{compute.name}'", spec)
        if passes != {"forward"}:
            continue
        for operand in compute.args[:2]:
            casts = _fp8_producers(operand)
            check(bool(casts) and casts <= nodes, "MOE-004",
                  f"tagged region {region_id!r}: the cast to FP8 of operand '{operand.name}' of '{compute.name}' lies outside it", spec)


@pytest.mark.fp8_property("MOE-005")
@_budget
@given(spec=moe_specs(emulate=False, v2=True))
def test_MOE_005_the_split_puts_expert_weight_gradients_in_dw(fp8_backend, spec):
    """Cheapest defect: a split that finishes the experts' grad_weight grouped GEMMs in dI and
    hands dW the results (every value right, no weight work left to defer). Per experts module,
    dI must hold exactly the grouped GEMMs the stage's input gradient depends on."""
    _needs(fp8_backend, "graphpp")
    with _structure(spec):
        case = _traced("MOE-005", fp8_backend, spec)
        split = call_backend("MOE-005", fp8_backend, "split_stage", case.gm, strict=True, expect=StageSplit)
        ops = fp8_ops("MOE-005", fp8_backend)
        owner = lambda n: getattr(fp8_backend.provenance(n), "module_fqn", None)  # noqa: E731
        # What each callable's outputs need counts (SPEC.md, "Counting what the outputs need").
        seen = {name: collections.Counter(owner(n) for n in needed_fp8_compute(part, ops)) for name, part in split.parts.items()}
        forward, needed, rest = collections.Counter(), collections.Counter(), collections.Counter()
        for fqn, input_grad in spec.calls():
            forward[fqn] += 1
            if input_grad:
                (needed if spec.input_requires_grad else rest)[fqn] += 1
            rest[fqn] += 1
        expected = {"forward": forward, "backward_input": needed, "backward_weight": rest}
        check(seen == expected, "MOE-005", f"grouped GEMMs per callable and module: {_plain(seen)}, expected {_plain(expected)}", spec)
        if split.param_grads is not None:
            missing = [f"{fqn}.weight" for fqn in spec.quantized_modules() if f"{fqn}.weight" not in split.param_grads]
            check(not missing, "MOE-005", f"expert weight gradients {missing} are not outputs of backward_weight", spec)


def _plain(counters) -> dict:
    return {name: dict(sorted(c.items())) for name, c in counters.items()}


def _run(property_id, backend, case, args, seed: int):
    import torch

    generator = torch.Generator(args[0].device.type).manual_seed(seed)
    grad_out = torch.randn(args[0].shape[0], case.spec.out_features, device=args[0].device, generator=generator)
    return call_backend(property_id, backend, "run_joint", case.gm, case.model, args, (grad_out,))


def _runnable(spec):
    """``spec`` with real FP8 experts where the run's device executes FP8 grouped GEMMs, emulated
    ones elsewhere (decided when the test runs: the device is known only then)."""
    return dataclasses.replace(spec, emulate=not grouped_fp8_runs(device()))


def _apis(backend, spec, where: str) -> list:
    """``spec`` on the first grouped API and, for real experts of a backend that claims
    ``scaled_grouped_mm_v2`` where ``where`` runs ``F.scaled_grouped_mm``, again on the second
    (two models a property leave one API to chance otherwise); the row says which."""
    spec = dataclasses.replace(spec, v2=False)
    if "scaled_grouped_mm_v2" not in backend.capabilities:
        return [spec]
    if spec.emulate:
        note("experts on F.scaled_grouped_mm not run: this device runs no FP8 grouped GEMM, so the experts are emulated")
        return [spec]
    if not grouped_v2_runs(where):
        note(f"experts on F.scaled_grouped_mm not run: this torch has no {where} kernel for aten._scaled_grouped_mm_v2")
        return [spec]
    note("each model run with its experts on torch._scaled_grouped_mm and on F.scaled_grouped_mm")
    return [spec, dataclasses.replace(spec, v2=True)]


#: Token groups made only of padding (padding equal to the group's size) next to empty groups and
#: a group half padding, forced first: an amax floor kept for empty groups alone, or scales that
#: treat a zero group as a missing one, meet them on no drawn model by chance alone.
PADDING_GROUPS = (ExpertsSpec(groups=(16, 0, 32), padding=16), ExpertsSpec(groups=(0, 32, 16, 0), padding=16))


@pytest.mark.fp8_property("MOE-006")
@_budget
@given(spec=experts_specs())
@example(spec=PADDING_GROUPS[0])
def test_MOE_006_per_group_scales_are_never_shared_across_groups(fp8_backend, spec):
    """Cheapest defect: the grad_weight GEMM's operands quantized with one scale per column over
    all tokens (the dense rowwise recipe's choice), not per token group, so one group's outliers
    coarsen every other expert's gradient. Scaling one group's tokens by 2**12 must leave every
    other expert's weight gradient, and the other groups' outputs and input gradients, bitwise."""
    for variant in _apis(fp8_backend, _runnable(spec), device()):
        with _structure(variant):  # tracing propagates fake tensors through the GEMMs
            _check_groups_apart(fp8_backend, variant)


def _check_groups_apart(fp8_backend, spec):
    case = _traced("MOE-006", fp8_backend, spec)
    where = device()
    group = next(g for g, size in enumerate(spec.groups) if size)
    base = _run("MOE-006", fp8_backend, case, experts_inputs(spec, 1, where), seed=2)
    scaled = _run("MOE-006", fp8_backend, case, experts_inputs(spec, 1, where, scale_group=group, factor=2.0**12), seed=2)
    start, end = spec.group_rows()[group]
    for label, index in (("output", None), ("input gradient", "input.0")):
        before, after = (base[0][0], scaled[0][0]) if index is None else (base[1][index], scaled[1][index])
        others = [r for r in range(before.shape[0]) if not start <= r < end]
        check(bool((before[others] == after[others]).all()), "MOE-006",
              f"scaling group {group}'s tokens changed the {label} of other groups' tokens", spec)
    weight_before, weight_after = base[1]["experts.weight"], scaled[1]["experts.weight"]
    for expert in range(spec.experts):
        if expert != group:
            check(bool((weight_before[expert] == weight_after[expert]).all()), "MOE-006",
                  f"scaling group {group}'s tokens changed expert {expert}'s weight gradient: a scale is shared across groups", spec)


@pytest.mark.fp8_property("MOE-007")
@_budget
@given(spec=experts_specs(padding=True))
@example(spec=PADDING_GROUPS[0])
@example(spec=PADDING_GROUPS[1])
def test_MOE_007_empty_groups_and_padding_rows_issue_no_nan(fp8_backend, spec):
    """Cheapest defect: amax without a floor, so an all-zero padding row (or an empty group's
    amax of 0) gives an infinite scale and ``0 * inf = NaN``. With empty groups and zero rows
    ending every group, the output and gradients must be finite and each empty group's expert
    weight gradient exactly zero."""
    for variant in _apis(fp8_backend, _runnable(spec), device()):
        with _structure(variant):  # tracing propagates fake tensors through the GEMMs
            _check_finite(fp8_backend, variant)


def _check_finite(fp8_backend, spec):
    import torch

    case = _traced("MOE-007", fp8_backend, spec)
    outputs, grads = _run("MOE-007", fp8_backend, case, experts_inputs(spec, 3, device()), seed=4)
    for name, value in [("output", outputs[0])] + sorted(grads.items()):
        check(bool(torch.isfinite(value).all()), "MOE-007", f"{name} holds NaN or infinity", spec)
    for expert, size in enumerate(spec.groups):
        if size == 0:
            check(not bool(grads["experts.weight"][expert].any()), "MOE-007",
                  f"expert {expert} received no token, but its weight gradient is not zero", spec)


@pytest.mark.fp8_property("MOE-008")
@pytest.mark.fp8_sm90
@settings(max_examples=max(2, settings.default.max_examples // 12))
@given(spec=moe_specs(emulate=False))
def test_MOE_008_compiled_moe_graphs_match_eager_on_gpu(fp8_backend, spec):
    """Cheapest defect: regional compile that cannot take a grouped region and silently runs
    another (full) graph or drops the regions' per-group scaling. Full and regional compile of
    the real-FP8 MoE graph must match the eager graph on two steps with fresh inputs (experts on
    ``F.scaled_grouped_mm`` too, each model on both APIs, where this torch runs them on CUDA)."""
    _needs(fp8_backend, "compile.full", "compile.regional")
    for variant in _apis(fp8_backend, spec, "cuda"):
        with _structure(variant):  # compiling traces with fake tensors
            _check_compiled_moe(fp8_backend, variant)


def _check_compiled_moe(fp8_backend, spec):
    import torch

    case = _traced("MOE-008", fp8_backend, spec, "cuda")
    for mode in ("full", "regional"):
        compiled = call_backend("MOE-008", fp8_backend, "compile", case.gm, mode=mode, expect=Compiled)
        for step in range(2):
            generator = torch.Generator("cuda").manual_seed(10 + step)
            x = torch.randn(spec.tokens, spec.dim, device="cuda", generator=generator).requires_grad_(spec.input_requires_grad)
            grad_out = (torch.randn(spec.tokens, spec.dim, device="cuda", generator=generator),)
            expected = call_backend("MOE-008", fp8_backend, "run_joint", case.gm, case.model, (x,), grad_out)
            seen = call_backend("MOE-008", fp8_backend, "run_joint", case.gm, case.model, (x,), grad_out, fn=compiled.fn)
            _compare(spec, f"{mode} compile, step {step}", expected, seen)


def _compare(spec, label, expected, seen):
    (out_e, grads_e), (out_s, grads_s) = expected, seen
    check(grads_e.keys() == grads_s.keys(), "MOE-008", f"{label}: gradients of {sorted(grads_s)}, expected {sorted(grads_e)}", spec)
    pairs = [("output", out_e[0], out_s[0])] + [(f"grad of {k}", grads_e[k], grads_s[k]) for k in sorted(grads_e)]
    for name, e, s in pairs:
        error = ((e.float() - s.float()).norm() / e.float().norm().clamp_min(1e-12)).item()
        check(error <= _TOLERANCE, "MOE-008", f"{label}: {name} differs from eager by {error:.3g} in relative norm", spec)
