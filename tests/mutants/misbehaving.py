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


class TraceHangs(ReferenceBackend):
    """Never returns from tracing: what a run's hang guard is for."""

    name = "misbehaving-trace-hangs"

    def trace_joint(self, model, args):
        import time

        while True:
            time.sleep(1)
