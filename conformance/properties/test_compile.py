"""NUM: compiled FP8 joint graphs compute what the eager graph computes, and regional
compilation compiles exactly the tagged regions."""

from __future__ import annotations

import pytest
from hypothesis import given

from conformance.graphs import tagged_groups
from conformance.harness import fresh_args as _fresh_args, grad_outputs as _grad_outputs, call_backend, check, compile_settings, fresh_copy, traced
from conformance.strategies import model_specs, runnable_recipes
from conformance.api.types import Compiled

runnable = runnable_recipes()

# A cold Inductor compile takes seconds to tens of seconds on CPU: see harness.compile_budget.
compile_budget = compile_settings()

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
    case = traced(property_id, backend, spec)
    compiled = call_backend(property_id, backend, "compile", case.gm, mode=mode, expect=Compiled)
    # Two steps with fresh inputs and an optimizer-like update of the parameters in between: a
    # compiled graph must reuse neither the first step's values nor the first step's weights.
    with _parameters_restored(case.model):
        for step in range(2):
            args, grad_out = _fresh_args(spec, step), _grad_outputs(spec, 100 + step)
            expected = call_backend(property_id, backend, "run_joint", case.gm, case.model, args, grad_out)
            seen = call_backend(property_id, backend, "run_joint", case.gm, case.model, args, grad_out, fn=compiled.fn)
            _compare(property_id, spec, f"{mode} compile, step {step}", expected, seen)
            _descend(case.model, expected[1])


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
@given(spec=model_specs(recipes=runnable))
def test_NUM_001_full_compile_matches_eager(fp8_backend, warm_inductor, spec):
    """Cheapest defect once let through: a compiled step that folds the parameters in as
    constants at its first call (Inductor freezing), or returns the first step's results; both
    passed two steps with fresh inputs and the same weights. Between the steps the suite now moves
    every parameter in place along its gradient by half its norm, as an optimizer step does, so
    stale weights or results are off by far more than the tolerance."""
    _check_matches_eager("NUM-001", fp8_backend, spec, "full")


@pytest.mark.fp8_property("NUM-002")
@compile_budget
@given(spec=model_specs(recipes=runnable))
def test_NUM_002_regional_compile_matches_eager(fp8_backend, warm_inductor, spec):
    """Cheapest defect once let through: a regionally compiled graph whose regions keep the first
    call's FP8 weights (a weight cast hoisted out and cached). The parameters now change in place
    between the two steps, as in training, so a cached cast gives the old weights' results."""
    _check_matches_eager("NUM-002", fp8_backend, spec, "regional")


@pytest.mark.fp8_property("NUM-003")
@compile_budget
@given(spec=model_specs(recipes=runnable, emulate=False))
def test_NUM_003_exactly_the_tagged_regions_are_compiled(fp8_backend, warm_inductor, spec):
    """Cheapest defect: reporting the tagged nodes as compiled while running the graph eagerly
    (a report that simply echoes the tags). Besides the report, the suite counts casts to FP8
    that reach the dispatcher while the compiled graph runs: tagged casts that still run eagerly
    exceed the untagged ones and fail."""
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
    # Do not take the report's word for it: Inductor turns a tagged cast to FP8 into generated
    # code, so casts that still reach the dispatcher while the compiled graph runs are eager.
    untagged_casts = sum(1 for n in case.gm.graph.nodes if _is_fp8_cast(n) and n.name not in tagged)
    args, grad_out = _fresh_args(spec, 0), _grad_outputs(spec, 100)
    with _FP8CastCounter() as counter:
        call_backend("NUM-003", fp8_backend, "run_joint", case.gm, case.model, args, grad_out, fn=compiled.fn)
    check(
        counter.casts <= untagged_casts,
        "NUM-003",
        f"running the regionally compiled graph dispatched {counter.casts} eager casts to FP8, but only "
        f"{untagged_casts} lie outside the tagged regions: tagged regions ran eagerly",
        spec,
    )


def _is_fp8_cast(node) -> bool:
    def fp8(value):
        return "float8" in str(getattr(getattr(value, "meta", {}).get("val"), "dtype", ""))

    return node.op == "call_function" and fp8(node) and not any(fp8(i) for i in node.all_input_nodes)


class _FP8CastCounter:
    """Counts dtype conversions to FP8 that reach the dispatcher (eager execution)."""

    def __enter__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if func in (torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default):
                    if "float8" in str(getattr(out, "dtype", "")):
                        counter.casts += 1
                return out

        self.casts = 0
        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)


@pytest.mark.fp8_property("NUM-004")
@pytest.mark.fp8_sm89
@compile_budget
@given(spec=model_specs(emulate=False, nesting=False))
def test_NUM_004_cuda_graph_replays_match_eager(fp8_backend, spec):
    """Cheapest defect: a CUDA graph replayed without copying fresh inputs into its static
    buffers, so replays repeat the capture's result. The capture and two replays with fresh
    inputs must each match eager."""
    from conformance.graphs import trace_with_oracle
    from conformance.models import build_model

    model, args = build_model(spec, device="cuda")
    gm, _ = trace_with_oracle(fp8_backend, model, args, list(spec.quantized_modules()), fp8_backend.is_backward)
    compiled = call_backend("NUM-004", fp8_backend, "compile", gm, mode="regional", cudagraph=True, expect=Compiled)
    for step in range(3):  # capture, then replays with fresh inputs
        args, grad_out = _fresh_args(spec, step, "cuda"), _grad_outputs(spec, 100 + step, "cuda")
        expected = call_backend("NUM-004", fp8_backend, "run_joint", gm, model, args, grad_out)
        seen = call_backend("NUM-004", fp8_backend, "run_joint", gm, model, args, grad_out, fn=compiled.fn)
        _compare("NUM-004", spec, f"CUDA graph replay {step}", expected, seen)
