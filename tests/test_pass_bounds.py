"""The suite's own ground truth of what a backend describes: which nodes are backward (PROV-003),
which regions are complete (REG-004), and what ran eagerly in a fully compiled step (NUM-001)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conformance.backends.makefx import MakeFxBackend
from conformance.backends.reference import ReferenceBackend
from conformance.observe.dispatch import always_generated, observed
from conformance.observe.graphs import fp8_compute_nodes, incompleteness, surely_backward, tangent_placeholders
from conformance.run.harness import fp8_ops, fresh_args, grad_outputs, traced
from conformance.draw.models import LayerSpec, ModelSpec
from conformance.draw.strategies import runnable_recipes

SPEC = ModelSpec(
    in_features=32,
    layers=(LayerSpec(width=32, recipe="tensorwise", activation="gelu"), LayerSpec(width=32, recipe="rowwise", residual=True)),
)


def _runnable(spec):
    """``spec`` with the recipes this torch cannot run on CPU replaced by tensorwise (torch 2.11's
    CPU ``_scaled_mm`` runs tensorwise scales only)."""
    runs = runnable_recipes()
    return dataclasses.replace(spec, layers=tuple(
        layer if layer.recipe is None or layer.recipe in runs else dataclasses.replace(layer, recipe="tensorwise")
        for layer in spec.layers))


def _runner(backend, case, grads):
    def run(fn):
        backend.run_joint(case.gm, case.model, fresh_args(SPEC, 0), grads, fn=fn)

    return run


@pytest.mark.parametrize("backend", [ReferenceBackend(), MakeFxBackend()], ids=lambda b: b.name)
def test_the_tangents_are_the_placeholders_the_runner_feeds_the_output_gradients(backend):
    case = traced("PROV-003", backend, SPEC)
    grads = grad_outputs(SPEC, 100)
    tangents = tangent_placeholders(_runner(backend, case, grads), case.gm, grads)
    assert len(tangents) == len(grads)
    assert all(t.op == "placeholder" for t in tangents)


@pytest.mark.parametrize("backend", [ReferenceBackend(), MakeFxBackend()], ids=lambda b: b.name)
def test_what_the_tangents_reach_is_backward_and_holds_every_backward_fp8_matmul(backend):
    case = traced("PROV-003", backend, SPEC)
    grads = grad_outputs(SPEC, 100)
    reached = surely_backward(tangent_placeholders(_runner(backend, case, grads), case.gm, grads))
    assert reached and all(backend.is_backward(n) for n in reached)
    computes = fp8_compute_nodes(case.gm, fp8_ops("PROV-003", backend))
    # Every backward matmul reads the gradient of the output, through the layers above it.
    assert {n for n in computes if backend.is_backward(n)} <= reached
    assert not {n for n in computes if not backend.is_backward(n)} & reached


def test_a_runner_that_feeds_other_values_shows_no_tangent():
    backend = ReferenceBackend()
    case = traced("PROV-003", backend, SPEC)
    grads = grad_outputs(SPEC, 100)
    other = tuple(g + 1 for g in grads)

    def run(fn):
        backend.run_joint(case.gm, case.model, fresh_args(SPEC, 0), other, fn=fn)

    assert tangent_placeholders(run, case.gm, grads) == []


def test_the_suite_judges_every_reference_region_as_the_reference_does():
    backend = ReferenceBackend()
    case = traced("REG-004", backend, SPEC)
    regions = backend.regions(case.gm)
    assert regions
    ops = fp8_ops("REG-004", backend)
    assert all(r.complete == (incompleteness(set(r.nodes), backend.is_backward, ops) is None) for r in regions)
    # A region missing its compute's operand casts is incomplete by the suite's check.
    region = regions[0]
    computes = [n for n in region.nodes if n in set(fp8_compute_nodes(case.gm, ops))]
    thinned = set(region.nodes) - {a for c in computes for a in c.args[:2] if isinstance(a, torch.fx.Node)}
    assert incompleteness(thinned, backend.is_backward, ops) is not None


def test_a_fully_compiled_step_dispatches_no_op_inductor_always_generates_and_the_graph_does():
    backend = ReferenceBackend()
    spec = _runnable(SPEC)
    case = traced("NUM-001", backend, spec)
    compiled = backend.compile(case.gm, mode="full")
    for fn, eager in ((case.gm, True), (compiled.fn, False)):
        watched, seen = observed(fn)
        backend.run_joint(case.gm, case.model, fresh_args(spec, 0), grad_outputs(spec, 100), fn=watched)
        assert any(always_generated(op) for op in seen.counts) == eager, sorted(map(str, seen.counts))
        assert (seen.fp8_casts > 0) == eager
