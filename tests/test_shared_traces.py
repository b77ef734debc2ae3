"""Traced graphs shared between the sessions of one process of fp8conf's tests: only between
backends that trace alike, and never once a session changed the model (tests/shared_traces.py)."""

from __future__ import annotations

import torch

import shared_traces
from conformance.run import harness, watchdog
from conformance.backends.makefx import MakeFxBackend
from conformance.backends.reference import ReferenceBackend
from conformance.draw.models import LayerSpec, ModelSpec

SPEC = ModelSpec(in_features=32, layers=(LayerSpec(width=32, recipe="tensorwise"),))
MX_SPEC = ModelSpec(in_features=32, layers=(LayerSpec(width=32, recipe="mxfp8"),))


class RegionsOnly(ReferenceBackend):
    def regions(self, gm):
        return super().regions(gm)[:1]


class OwnTracer(ReferenceBackend):
    def trace_joint(self, model, args):
        return super().trace_joint(model, args)


class HelperTracer(ReferenceBackend):
    def trace_joint(self, model, args):
        return self._trace(model, args)

    def _trace(self, model, args):
        return super().trace_joint(model, args)


class OtherHelper(HelperTracer):
    def _trace(self, model, args):
        return super()._trace(model, args)


class WithoutMX(ReferenceBackend):
    capabilities = ReferenceBackend.capabilities - {"mx"}


def test_backends_that_trace_alike_share_and_others_do_not():
    identity = shared_traces.tracing_identity
    assert identity(RegionsOnly()) == identity(ReferenceBackend()) == identity(watchdog.track(ReferenceBackend()))
    assert identity(OwnTracer()) != identity(ReferenceBackend())
    assert identity(WithoutMX()) != identity(ReferenceBackend())  # MX layers are built by convert_mx
    # ... but a model without MX layers traces alike whether or not the backend converts them.
    assert identity(WithoutMX(), SPEC) == identity(ReferenceBackend(), SPEC)
    assert identity(WithoutMX(), MX_SPEC) != identity(ReferenceBackend(), MX_SPEC)
    # A helper the tracer calls is part of what tracing is.
    assert identity(HelperTracer()) != identity(OtherHelper())
    assert identity(MakeFxBackend()) != identity(ReferenceBackend())
    stateful = ReferenceBackend()
    stateful.seen = []
    assert identity(stateful) is None


def test_a_trace_is_shared_across_sessions_until_a_session_changes_its_model():
    original = harness._trace
    try:
        cache = shared_traces.install()
        cache.new_session()
        first = harness.traced("PROV-001", ReferenceBackend(), SPEC)
        cache.new_session()
        second = harness.traced("PROV-001", RegionsOnly(), SPEC)
        assert cache.hits == 1 and second.model is first.model and second.gm is not first.gm
        assert harness.traced("PROV-001", OwnTracer(), SPEC).model is not first.model
        assert shared_traces.check_models_kept(cache) == []
        with torch.no_grad():
            next(first.model.parameters()).add_(1.0)
        dropped = shared_traces.check_models_kept(cache)
        assert len(dropped) == 1 and "changed in a session" in dropped[0]
        cache.new_session()
        assert harness.traced("PROV-001", ReferenceBackend(), SPEC).model is not first.model
    finally:
        harness._trace = original


def test_backends_whose_rewrites_differ_share_no_trace():
    import trainer_backend
    from mutants.rewrites import RewriteReordersInputs

    from shared_traces import tracing_identity

    assert tracing_identity(trainer_backend.TrainerBackend()) != tracing_identity(RewriteReordersInputs())


class OwnNVFP4(ReferenceBackend):
    def convert_nvfp4(self, model, *, module_filter_fn, recipe):
        super().convert_nvfp4(model, module_filter_fn=module_filter_fn, recipe=recipe)


class OwnExperts(ReferenceBackend):
    def convert_grouped_experts(self, model, **kwargs):
        return super().convert_grouped_experts(model, **kwargs)


def test_every_converter_is_part_of_what_tracing_is():
    # A mutant whose NVFP4 linears compute wrongly in their own autograd function once borrowed
    # the reference's traced models (and so the reference's modules) and passed EMU-005.
    identity = shared_traces.tracing_identity
    nvfp4 = ModelSpec(in_features=32, layers=(LayerSpec(width=32, recipe="nvfp4"),))
    assert identity(OwnNVFP4(), nvfp4) != identity(ReferenceBackend(), nvfp4)
    assert identity(OwnNVFP4(), SPEC) == identity(ReferenceBackend(), SPEC)  # no NVFP4 layer to build
    # A converter no spec question covers counts for every model.
    assert identity(OwnExperts(), SPEC) != identity(ReferenceBackend(), SPEC)
