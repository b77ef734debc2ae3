"""Backends that misbehave rather than err subtly: the suite must report, name and move on."""

from __future__ import annotations

from conformance.backends.reference import ReferenceBackend


class ProvenanceRaises(ReferenceBackend):
    name = "misbehaving-provenance-raises"

    def provenance(self, node):
        raise KeyError("fp8_meta")


class ValidateReturnsDict(ReferenceBackend):
    name = "misbehaving-validate-returns-dict"

    def validate(self, gm, *, strict):
        super().validate(gm, strict=strict)
        return {"ok": True}


class TraceKeepsNoValues(ReferenceBackend):
    """Traces with a tracer that keeps no ``node.meta["val"]``: the suite cannot tell FP8 compute
    from none on its graphs, and must say that, not that the model holds no FP8 compute."""

    name = "misbehaving-trace-keeps-no-values"

    def trace_joint(self, model, args):
        gm = super().trace_joint(model, args)
        for node in gm.graph.nodes:
            if node.op != "placeholder":
                node.meta.pop("val", None)
        return gm


class TraceHangs(ReferenceBackend):
    """Never returns from tracing: what a run's hang guard is for."""

    name = "misbehaving-trace-hangs"

    def trace_joint(self, model, args):
        import time

        while True:
            time.sleep(1)
