"""NUM: compiled FP8 joint graphs compute what the eager graph computes, and regional
compilation compiles exactly the tagged regions."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given

from conformance.observe.dispatch import BlockScaledCalls, always_generated, dispatches_per_node, equal_computations, observed
from conformance.draw.families import LLAMA_ATTENTION
from conformance.draw.family_examples import family_examples
from conformance.observe.graphs import is_fp8_cast, live_nodes, tagged_groups
from conformance.run.harness import fresh_args as _fresh_args, grad_outputs as _grad_outputs, call_backend, check, compile_settings, fresh_copy, note_kinds_left_out, traced
from conformance.run.gating import NOT_SUPPORTED
from conformance.draw.strategies import FLOAT8_KIND, MX_KIND, SCALED_MM_KIND, model_specs, runnable_kinds, runnable_recipes
from conformance.api.types import Compiled

runnable = runnable_recipes()
#: NUM-001 and NUM-002 draw linears on F.scaled_mm too, for a backend that claims
#: ``scaled_mm_v2``, where this torch runs their matmuls on CPU (2.12 and newer; MX layers are
#: NUM-005's).
RUNNABLE_KINDS = tuple(k for k in (FLOAT8_KIND, SCALED_MM_KIND) if k in runnable_kinds())

# A cold Inductor compile takes seconds to tens of seconds on CPU: see harness.compile_budget.
compile_budget = compile_settings()
#: The model families the NUM properties run first (conformance.draw.families): the Llama-shaped one
#: only, without its MLP, whose attention (SDPA and its backward, grouped-query), norms, residual
#: stream, embedding and high-precision head a compiled step must get right. A cold Inductor
#: compile of the whole Llama family costs about twice as much; the other families would cost
#: one each and show Inductor nothing this one does not.
COMPILE_FAMILIES = (LLAMA_ATTENTION,)

# Inductor may fuse and reorder float32 arithmetic around the FP8 casts; one flipped FP8
# rounding moves a gradient by well under this bound, a wrong result by far more.
_TOLERANCE = 1e-2


def _compare(property_id, spec, label, expected, seen):
    (out_e, grads_e), (out_s, grads_s) = expected, seen
    check(grads_e.keys() == grads_s.keys(), property_id, f"{label}: gradients of {sorted(grads_s)}, expected {sorted(grads_e)}", spec)
    pairs = [("output", out_e[0], out_s[0])] + [(f"grad of {k}", grads_e[k], grads_s[k]) for k in sorted(grads_e)]
    for name, e, s in pairs:
        error = ((e.float() - s.float()).norm() / e.float().norm().clamp_min(1e-12)).item()
        check(error <= _TOLERANCE, property_id, f"{label}: {name} differs from eager by {error:.3g} in relative norm (tolerance {_TOLERANCE})", spec)


def _check_matches_eager(property_id, backend, spec, mode):
    note_kinds_left_out(backend)
    case = traced(property_id, backend, spec)
    compiled = call_backend(property_id, backend, "compile", case.gm, mode=mode, expect=Compiled)
    # Only the compiled callable's own calls are counted, not what the runner does around it.
    fn, dispatched = observed(compiled.fn)
    # Two steps with fresh inputs and an optimizer-like update of the parameters in between: a
    # compiled graph must reuse neither the first step's values nor the first step's weights.
    with _parameters_restored(case.model):
        for step in range(2):
            args, grad_out = _fresh_args(spec, step), _grad_outputs(spec, 100 + step)
            expected = call_backend(property_id, backend, "run_joint", case.gm, case.model, args, grad_out)
            seen = _run_compiled(property_id, backend, spec, case.gm, case.model, args, grad_out, fn)
            _compare(property_id, spec, f"{mode} compile, step {step}", expected, seen)
            _descend(case.model, expected[1])
    if mode == "full":
        _check_nothing_ran_eagerly(property_id, spec, dispatched)


def _check_nothing_ran_eagerly(property_id, spec, dispatched) -> None:
    """A fully compiled step runs in Inductor's generated code and its extern kernels: no op
    Inductor always generates code for (:func:`conformance.observe.dispatch.always_generated`), and no
    cast to FP8, reaches the dispatcher while it runs. The graph module itself, or a graph
    compiled only in its FP8 regions, dispatches them."""
    eager = sorted((str(op), n) for op, n in dispatched.counts.items() if always_generated(op))
    check(
        not eager and dispatched.fp8_casts == 0,
        property_id,
        f"while the fully compiled step ran, {dispatched.fp8_casts} cast(s) to FP8 and ops Inductor always turns into "
        "generated code reached torch's dispatcher, so (part of) the step ran eagerly: "
        + (", ".join(f"{op} {n} time(s)" for op, n in eager[:6]) or "no such op"),
        spec,
    )


def _run_compiled(property_id, backend, spec, gm, model, args, grad_out, fn):
    """``run_joint`` with ``fn`` in the graph's place, observed to call ``fn`` exactly once: a
    runner that ran the graph itself would compare eager with eager."""
    calls = []

    def counted(*a, **k):
        calls.append(None)
        return fn(*a, **k)

    result = call_backend(property_id, backend, "run_joint", gm, model, args, grad_out, fn=counted)
    check(
        len(calls) == 1,
        property_id,
        f"run_joint(..., fn=compiled.fn) called the compiled callable {len(calls)} time(s), not once: what ran "
        "was not the compiled graph as given",
        spec,
    )
    return result


def _descend(model, grads) -> None:
    """An SGD step in place, each parameter moved along its gradient by half its own norm: far
    beyond the tolerance, so results computed with the old weights cannot pass for new ones."""
    import torch

    with torch.no_grad():
        for fqn, param in model.named_parameters():
            grad = grads.get(fqn)
            if grad is None or not grad.norm() > 0:
                param.mul_(-0.5)
            else:
                param.sub_(grad * (0.5 * param.norm() / grad.norm()))


class _parameters_restored:
    """The model is shared by every property that draws it: put its parameters back after."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.saved = {fqn: p.detach().clone() for fqn, p in self.model.named_parameters()}

    def __exit__(self, *exc):
        import torch

        with torch.no_grad():
            for fqn, param in self.model.named_parameters():
                param.copy_(self.saved[fqn])


@pytest.mark.fp8_property("NUM-001")
@compile_budget
@family_examples
@given(spec=model_specs(recipes=runnable, kinds=RUNNABLE_KINDS, families=COMPILE_FAMILIES))
def test_NUM_001_full_compile_matches_eager(fp8_backend, warm_inductor, spec):
    """Cheapest defect once let through: a compiled step that folds the parameters in as
    constants at its first call (Inductor freezing), or returns the first step's results; both
    passed two steps with fresh inputs and the same weights. Between the steps the suite now moves
    every parameter in place along its gradient by half its norm, as an optimizer step does, so
    stale weights or results are off by far more than the tolerance. A "full" compile that
    returns the graph module itself, or compiles the FP8 regions only, matches eager too: the
    suite watches the dispatcher while the compiled callable runs, where ops Inductor always
    generates code for, and casts to FP8, show what ran eagerly. The Llama-shaped family runs
    first, without its MLP and with ``wv`` emulated: attention through SDPA, 3-D activations,
    an embedding whose weight gradient takes every projection's grad_input, compiled whole."""
    _check_matches_eager("NUM-001", fp8_backend, spec, "full")


@pytest.mark.fp8_property("NUM-002")
@compile_budget
@family_examples
@given(spec=model_specs(recipes=runnable, kinds=RUNNABLE_KINDS, families=COMPILE_FAMILIES))
def test_NUM_002_regional_compile_matches_eager(fp8_backend, warm_inductor, spec):
    """Cheapest defect once let through: a regionally compiled graph whose regions keep the first
    call's FP8 weights (a weight cast hoisted out and cached). The parameters now change in place
    between the two steps, as in training, so a cached cast gives the old weights' results. The
    Llama-shaped family runs first, as in NUM-001."""
    _check_matches_eager("NUM-002", fp8_backend, spec, "regional")


@pytest.mark.fp8_property("NUM-003")
@compile_budget
@family_examples
@given(spec=model_specs(recipes=runnable, kinds=RUNNABLE_KINDS, emulate=False, families=COMPILE_FAMILIES))
def test_NUM_003_exactly_the_tagged_regions_are_compiled(fp8_backend, warm_inductor, spec):
    """Cheapest defects: a report that echoes the tags while the graph runs otherwise, either
    eagerly (the tagged regions, or the ops of a region other than its casts) or compiled whole
    (the untagged nodes too). Besides the report, the suite watches what reaches the dispatcher
    while the compiled graph runs, against what each node dispatches when the graph runs
    eagerly: every node reported eager must be seen there, and ops Inductor always generates
    code for that only tagged nodes use, and casts to FP8 beyond the untagged ones, must not.
    The Llama-shaped family (without its MLP) runs first, every projection real: regions fed by
    norms and SDPA, untagged attention, embedding and head ops around them. Linears on
    ``F.scaled_mm`` are drawn too where this torch runs them, so that a regional compile that
    quietly leaves their regions eager shows."""
    case = traced("NUM-003", fp8_backend, spec)
    probe, _ = fresh_copy(case)
    call_backend("NUM-003", fp8_backend, "regions", probe)
    groups = tagged_groups(probe)
    tagged = {n.name for nodes in groups.values() for n in nodes}
    check(bool(tagged), "NUM-003", "a model with non-emulated FP8 modules has no tagged region", spec)
    compiled = call_backend("NUM-003", fp8_backend, "compile", case.gm, mode="regional", expect=Compiled)
    names = {n.name for n in case.gm.graph.nodes if n.op == "call_function"}
    check(
        set(compiled.compiled_nodes) | set(compiled.eager_nodes) == names,
        "NUM-003",
        "compiled_nodes and eager_nodes together must name every call_function node of the graph",
        spec,
    )
    missing, extra = tagged - set(compiled.compiled_nodes), set(compiled.compiled_nodes) - tagged
    check(not missing, "NUM-003", f"tagged nodes left eager: {sorted(missing)[:8]}", spec)
    check(not extra, "NUM-003", f"untagged nodes compiled: {sorted(extra)[:8]}", spec)
    # Do not take the report's word for it: what runs eagerly reaches the dispatcher, what
    # Inductor runs in generated code does not.
    args, grad_out = _fresh_args(spec, 0), _grad_outputs(spec, 100)

    def run(fn):
        call_backend("NUM-003", fp8_backend, "run_joint", case.gm, case.model, args, grad_out, fn=fn)

    per_node = dispatches_per_node(run, case.gm)
    fn, seen = observed(compiled.fn)
    run(fn)
    untagged_casts = sum(1 for n in case.gm.graph.nodes if is_fp8_cast(n) and n.name not in tagged)
    check(
        seen.fp8_casts <= untagged_casts,
        "NUM-003",
        f"running the regionally compiled graph dispatched {seen.fp8_casts} eager casts to FP8, but only "
        f"{untagged_casts} lie outside the tagged regions: tagged regions ran eagerly",
        spec,
    )
    _check_eager_nodes_were_dispatched(spec, case.gm, compiled.eager_nodes, per_node, seen.counts)
    _check_tagged_work_was_not_dispatched(spec, tagged, per_node, seen.counts)


def _check_eager_nodes_were_dispatched(spec, gm, eager_names, per_node, seen) -> None:
    """Every node reported eager that runs dispatches, while the compiled graph runs, what it
    dispatches in the eager graph: per op overload, at least once per distinct computation (a
    partitioner may merge equal ones, or recompute some, which only adds dispatches)."""
    classes = equal_computations(gm)
    compiled_classes = {c for n, c in classes.items() if n.name not in eager_names}
    expected, eager_by_op, counted = collections.Counter(), {}, set()
    for node in live_nodes(gm):
        number = classes.get(node)
        if node.name not in eager_names or number is None or number in compiled_classes or number in counted:
            continue
        counted.add(number)
        for op, times in per_node.get(node, {}).items():
            expected[op] += times
            eager_by_op.setdefault(op, []).append(node.name)
    short = sorted((str(op), n, seen[op], sorted(eager_by_op[op])[:4]) for op, n in expected.items() if seen[op] < n)
    check(
        not short,
        "NUM-003",
        "nodes reported eager did not reach the dispatcher while the compiled graph ran, so they ran compiled: "
        + "; ".join(f"{op}: {n} eager computation(s) (nodes {names}), dispatched {k} time(s)" for op, n, k, names in short[:4]),
        spec,
    )


def _check_tagged_work_was_not_dispatched(spec, tagged, per_node, seen) -> None:
    """Ops that Inductor always computes in generated code (pointwise, lowered, never a fallback
    kernel) and that no untagged node dispatches must not reach the dispatcher at all: a tagged
    node running eagerly dispatches them."""
    outside = {op for node, ops in per_node.items() if node.name not in tagged for op in ops}
    inside: dict = {}
    for node, ops in per_node.items():
        if node.name in tagged:
            for op in ops:
                if op not in outside and always_generated(op):
                    inside.setdefault(op, []).append(node.name)
    ran = sorted((str(op), seen[op], sorted(nodes)[:4]) for op, nodes in inside.items() if seen[op])
    check(
        not ran,
        "NUM-003",
        "ops Inductor always turns into generated code, used only by tagged nodes, reached the dispatcher while the "
        "regionally compiled graph ran, so tagged regions ran (in part) eagerly: "
        + "; ".join(f"{op} dispatched {k} time(s) (tagged nodes {nodes})" for op, k, nodes in ran[:4]),
        spec,
    )


@pytest.mark.fp8_property("NUM-005")
@compile_budget
@given(spec=model_specs(kinds=(MX_KIND,), emulate=False, max_layers=2))
def test_NUM_005_compiled_mx_matmuls_get_the_eager_e8m0_scales(fp8_backend, warm_inductor, spec):
    """Cheapest defect: a compiled MX path whose quantization computes the scale exponent another
    way than eager does (another rounding, another e4m3 maximum), with the elements rescaled to
    match. NUM-001/002 draw no MX model, so no property compiled one. The suite records, at
    torch's dispatcher, the scale bytes of every call with FP8 operands and e8m0 scales, eagerly
    and while each compiled callable runs, and compares them before the numerics: a changed
    byte is named even where it moves the result by less than the tolerance (a block of zeros,
    one block among many)."""
    modes = [m for m in ("full", "regional") if f"compile.{m}" in fp8_backend.capabilities]
    if not modes:
        pytest.skip(f"{NOT_SUPPORTED} backend {fp8_backend.name!r} claims neither compile.full nor compile.regional")
    case = traced("NUM-005", fp8_backend, spec)
    args, grad_out = _fresh_args(spec, 0), _grad_outputs(spec, 100)
    eager_calls = BlockScaledCalls()
    with eager_calls:
        expected = call_backend("NUM-005", fp8_backend, "run_joint", case.gm, case.model, args, grad_out)
    eager = _scale_sets(eager_calls)
    check(
        bool(eager),
        "NUM-005",
        "running the joint graph of a model with real MX modules eagerly dispatched no call with FP8 operands and e8m0 "
        "scales (uint8 bytes or float8_e8m0fnu): the MX matmuls ran without their scales",
        spec,
    )
    for mode in modes:
        compiled = call_backend("NUM-005", fp8_backend, "compile", case.gm, mode=mode, expect=Compiled)
        compiled_calls = BlockScaledCalls()

        def fn(*a, _fn=compiled.fn, **k):
            with compiled_calls:
                return _fn(*a, **k)

        seen = _run_compiled("NUM-005", fp8_backend, spec, case.gm, case.model, args, grad_out, fn)
        got = _scale_sets(compiled_calls)
        missing, foreign = eager - got, got - eager
        check(
            not missing and not foreign,
            "NUM-005",
            f"{mode} compile: the e8m0 scales that reached the block-scaled matmuls differ from eager's: "
            f"{len(eager)} distinct scale sets eagerly ({len(eager_calls.calls)} calls), {len(got)} compiled "
            f"({len(compiled_calls.calls)} calls); {len(missing)} eager set(s) never reached a compiled matmul, "
            f"{len(foreign)} compiled set(s) never occur eagerly" + _first_difference(missing, foreign),
            spec,
        )
        _compare("NUM-005", spec, f"{mode} compile", expected, seen)


def _scale_sets(calls: BlockScaledCalls) -> set:
    """The distinct scale arguments of the recorded calls (a partitioner may recompute a matmul,
    which only repeats a set)."""
    return {scales for _op, scales in calls.calls}


def _first_difference(missing: set, foreign: set) -> str:
    """Where a compiled call's scale bytes first differ from the eager call of the same shapes."""
    for got in sorted(foreign, key=repr):
        shapes = [shape for shape, _ in got]
        for want in sorted(missing, key=repr):
            if [shape for shape, _ in want] == shapes:
                for i, ((shape, a), (_, b)) in enumerate(zip(want, got)):
                    if a != b:
                        at = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
                        return (f"; e.g. scale argument {i} of shape {shape}: byte {at} is {b[at]} in a compiled call, "
                                f"{a[at]} in an eager call with scales of the same shapes")
    return ""


@pytest.mark.fp8_property("NUM-004")
@pytest.mark.fp8_sm89
@compile_budget
@given(spec=model_specs(emulate=False, nesting=False))
def test_NUM_004_cuda_graph_replays_match_eager(fp8_backend, spec):
    """Cheapest defect: a CUDA graph replayed without copying fresh inputs into its static
    buffers, so replays repeat the capture's result. The capture and two replays with fresh
    inputs must each match eager."""
    from conformance.observe.graphs import trace_with_oracle
    from conformance.run.harness import float8_converter
    from conformance.draw.models import build_model

    model, args = build_model(spec, device="cuda", float8=float8_converter(fp8_backend))
    gm, _ = trace_with_oracle(fp8_backend, model, args, list(spec.quantized_modules()), fp8_backend.is_backward)
    compiled = call_backend("NUM-004", fp8_backend, "compile", gm, mode="regional", cudagraph=True, expect=Compiled)
    for step in range(3):  # capture, then replays with fresh inputs
        args, grad_out = _fresh_args(spec, step, "cuda"), _grad_outputs(spec, 100 + step, "cuda")
        expected = call_backend("NUM-004", fp8_backend, "run_joint", gm, model, args, grad_out)
        seen = _run_compiled("NUM-004", fp8_backend, spec, gm, model, args, grad_out, compiled.fn)
        _compare("NUM-004", spec, f"CUDA graph replay {step}", expected, seen)
