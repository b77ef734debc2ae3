"""RWR: a backend's post-trace rewrites keep what the traced step holds (capability ``rewrites``).

A graph trainer runs passes of its own on the traced joint graph (fusions, FP8 op rewrites,
common-subexpression elimination) before it validates, tags, splits and compiles it. With
``rewrites`` claimed, every property of the suite runs on the rewritten graph
(``conformance.run.harness.traced``); these compare it with the graph as traced: each module's FP8
compute and provenance (RWR-001), where a GraphPP split puts that compute (RWR-002), the graph's
inputs, FP8 ones included (RWR-003), and what the step computes (RWR-004).
"""

from __future__ import annotations

import collections

import pytest
from hypothesis import given

from conformance.api.types import StageSplit
from conformance.draw.families import FAMILIES
from conformance.draw.family_examples import family_examples
from conformance.judge.dead_compute import needed_fp8_compute
from conformance.observe.graphs import fp8_compute_nodes, output_dependencies
from conformance.run.harness import (
    call_backend, check, fail, fp8_ops, fresh_args, grad_outputs, traced, traced_before_rewrite,
)
from conformance.run.gating import NOT_SUPPORTED
from conformance.draw.strategies import ALL_KINDS, model_specs, runnable_kinds, runnable_recipes

#: Relative norm of the difference between the rewritten and the traced step that RWR-004 allows
#: per output and gradient: a fusion may round once more or in another order (float32 models),
#: it may not compute something else.
_TOLERANCE = 1e-3


def _compute_per_module(backend, gm, oracle) -> collections.Counter:
    """FP8 compute that reaches the outputs (what counts; a rewrite may drop dead FP8 compute),
    per (issuing module by the suite's oracle, pass)."""
    ops = fp8_ops("RWR-001", backend)
    return collections.Counter(
        (oracle.issued_by.get(n), "backward" if backend.is_backward(n) else "forward") for n in needed_fp8_compute(gm, ops)
    )


@pytest.mark.fp8_property("RWR-001")
@family_examples
@given(spec=model_specs(kinds=ALL_KINDS, families=FAMILIES))
def test_RWR_001_a_rewrite_keeps_every_modules_fp8_compute_and_provenance(fp8_backend, spec):
    """Cheapest defects: a rewrite that rebuilds the FP8 matmuls it fuses without their node
    metadata (provenance gone, and the suite's own record of who issued them with it), and one
    that turns an FP8 matmul into a high-precision one. Per (module, pass) the rewritten graph
    must hold the FP8 compute the traced graph holds, by the suite's count, and each of its FP8
    compute nodes must carry the provenance of the module that issued it."""
    case = traced("RWR-001", fp8_backend, spec)
    before_gm, before_oracle = traced_before_rewrite("RWR-001", fp8_backend, spec)
    before, after = _compute_per_module(fp8_backend, before_gm, before_oracle), _compute_per_module(fp8_backend, case.gm, case.oracle)
    check(
        before == after,
        "RWR-001",
        f"FP8 compute per (module, pass) as traced: {dict(before)}; after the backend's rewrite: {dict(after)} "
        "(a module of None: compute nodes the rewrite made without the traced nodes' metadata)",
        spec,
    )
    for node in fp8_compute_nodes(case.gm, fp8_ops("RWR-001", fp8_backend)):
        provenance = call_backend("RWR-001", fp8_backend, "provenance", node)
        fqn = case.oracle.issued_by.get(node)
        check(
            provenance is not None and provenance.module_fqn == fqn,
            "RWR-001",
            f"after the rewrite, FP8 compute node '{node.name}' ({node.target}) of {fqn!r} carries provenance {provenance!r}",
            spec,
        )


def _split(property_id, backend, spec, gm, label) -> StageSplit:
    split = call_backend(property_id, backend, "split_stage", gm, strict=False)
    if not isinstance(split, StageSplit):
        fail(property_id, f"backend {backend.name!r}: split_stage() of the {label} graph returned {type(split).__qualname__}", spec)
    return split


def _requires_graphpp(property_id, backend) -> None:
    if "graphpp" not in backend.capabilities:
        pytest.skip(f"{NOT_SUPPORTED} backend {backend.name!r} does not claim graphpp: {property_id} compares split stages")


@pytest.mark.fp8_property("RWR-002")
@family_examples
@given(spec=model_specs(kinds=ALL_KINDS, families=FAMILIES))
def test_RWR_002_a_rewrite_keeps_where_a_split_puts_each_modules_fp8_compute(fp8_backend, spec):
    """Cheapest defect: a fusion that feeds a weight-gradient matmul into the input gradient (or
    merges the two), so that no split can leave dW work for later: every count and value stays
    right, only the zero-bubble schedule is lost. split_stage of the rewritten graph must put as
    much FP8 compute of each module in the forward, dI and dW callables as split_stage of the
    traced graph does (modules by the backend's provenance, which each callable keeps), and as
    many high-precision matmuls (a ``rowwise_with_gw_hp`` weight gradient is dW work too)."""
    _requires_graphpp("RWR-002", fp8_backend)
    case = traced("RWR-002", fp8_backend, spec)
    before_gm, _ = traced_before_rewrite("RWR-002", fp8_backend, spec)
    ops = fp8_ops("RWR-002", fp8_backend)

    def placement(split):
        owner = lambda n: getattr(fp8_backend.provenance(n), "module_fqn", None)
        found = {}
        for name, part in (("forward", split.forward), ("backward_input", split.backward_input), ("backward_weight", split.backward_weight)):
            counts = collections.Counter(owner(n) for n in needed_fp8_compute(part, ops))
            # dW work in high precision too (a recipe's high-precision weight gradient): matmuls.
            needed = output_dependencies(part)
            counts["(high-precision matmuls)"] = sum(1 for n in needed if n.op == "call_function" and str(n.target) in _MATMULS)
            found[name] = counts
        return found

    before = placement(_split("RWR-002", fp8_backend, spec, before_gm, "traced"))
    after = placement(_split("RWR-002", fp8_backend, spec, case.gm, "rewritten"))
    check(
        before == after,
        "RWR-002",
        "FP8 compute per module in forward, backward_input and backward_weight: split of the traced graph "
        f"{ {k: dict(v) for k, v in before.items()} }, of the rewritten one { {k: dict(v) for k, v in after.items()} }",
        spec,
    )


def _placeholders(gm) -> list[tuple]:
    found = []
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        found.append((getattr(val, "dtype", None), tuple(getattr(val, "shape", ()))))
    return found


@pytest.mark.fp8_property("RWR-003")
@family_examples
@given(spec=model_specs(kinds=ALL_KINDS, families=FAMILIES))
def test_RWR_003_a_rewrite_keeps_the_graphs_inputs(fp8_backend, spec):
    """Cheapest defect: a pass that rebuilds the graph and with it the order of its inputs (or
    drops one it finds unused, or retypes one, an FP8 input of a pipeline stage among them):
    ``run_joint`` and a stage's caller bind inputs by position, so the step then reads the wrong
    tensors. The rewritten joint graph's placeholders must be the traced graph's: as many, in
    order, each of the same dtype and shape."""
    case = traced("RWR-003", fp8_backend, spec)
    before_gm, _ = traced_before_rewrite("RWR-003", fp8_backend, spec)
    before, after = _placeholders(before_gm), _placeholders(case.gm)
    check(before == after, "RWR-003", f"the joint graph's placeholders (dtype, shape) as traced: {before}; after the rewrite: {after}", spec)


#: High-precision matmuls, as ``str(node.target)``: the dW work of a high-precision weight gradient.
_MATMULS = frozenset({"aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default"})

#: The kinds whose FP8 matmuls this torch runs on CPU: RWR-004 runs both graphs.
_RUNNABLE = tuple(k for k in ALL_KINDS if k in runnable_kinds())


@pytest.mark.fp8_property("RWR-004")
@family_examples
@given(spec=model_specs(kinds=_RUNNABLE, recipes=runnable_recipes(), families=FAMILIES))
def test_RWR_004_a_rewritten_step_computes_what_the_traced_step_did(fp8_backend, spec):
    """Cheapest defect: a fusion that reads the wrong scale or drops a term (a bias, one call's
    share of a reused module's weight gradient): every structure stays, the numbers change. The
    rewritten graph, run by the backend on fresh inputs, must match the traced graph run alike:
    every output and gradient within 1e-3 in relative norm."""
    import torch

    case = traced("RWR-004", fp8_backend, spec)
    before_gm, _ = traced_before_rewrite("RWR-004", fp8_backend, spec)
    args, grads_out = fresh_args(spec, 11), grad_outputs(spec, 12)
    want_out, want_grads = call_backend("RWR-004", fp8_backend, "run_joint", before_gm, case.model, args, grads_out)
    got_out, got_grads = call_backend("RWR-004", fp8_backend, "run_joint", case.gm, case.model, args, grads_out)
    check(sorted(got_grads) == sorted(want_grads), "RWR-004", f"gradients of {sorted(got_grads)} after the rewrite, {sorted(want_grads)} as traced", spec)
    pairs = [(f"output {i}", g, w) for i, (g, w) in enumerate(zip(got_out, want_out))]
    pairs += [(f"gradient of {k}", got_grads[k], want_grads[k]) for k in sorted(want_grads)]
    for label, got, want in pairs:
        error = ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-12)).item()
        check(
            error <= _TOLERANCE,
            "RWR-004",
            f"{label}: the rewritten step differs from the traced step by {error:.3g} in relative norm (at most {_TOLERANCE:g})",
            spec,
        )
