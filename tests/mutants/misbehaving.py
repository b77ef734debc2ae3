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
