"""Mutant backends whose passes know torch's first scaled-matmul API only (``aten._scaled_mm``,
``aten._scaled_grouped_mm``), not the second (``aten._scaled_mm_v2``, what ``F.scaled_mm`` lowers
to, and ``aten._scaled_grouped_mm_v2``, what ``F.scaled_grouped_mm`` lowers to).

Each is the reference with one such defect. It claims ``scaled_mm_v2`` and
``scaled_grouped_mm_v2``, so the suite draws linears on ``F.scaled_mm`` and experts on
``F.scaled_grouped_mm`` for it and the defect shows: on a linear for the PROV, VAL and REG
mutants, on experts for the MOE ones. :data:`WITHOUT_V2` holds each one again without those
capabilities and ``nvfp4``, and without the swizzled MX recipe (``<Mutant>WithoutV2``), shown no such model, which passes the same property: the
v2 draw is what exposes the defect (``tests/test_mutants.py``).
"""

from __future__ import annotations

import contextlib

import fp8conf
import fp8conf.graph.regions
import fp8conf.graph.validate
from conformance.backends.reference import ReferenceBackend

__all__ = [
    "MUTANTS", "WITHOUT_V2", "V1OnlyValidation", "V1OnlyRegions", "V2ProvenanceDropped", "V1OnlyGroupedValidation",
    "V1OnlyGroupedRegions", "V2GroupedProvenanceDropped",
]
# NVFP4 linears compute on the second API too (F.scaled_mm on packed FP4), and so do swizzled MX
# linears (recipe mxfp8_swizzled, dropped from mx_recipes below).
_V2_CAPABILITIES = frozenset({"scaled_mm_v2", "scaled_grouped_mm_v2", "nvfp4"})


def _is_v2(node) -> bool:
    return node.op == "call_function" and str(node.target).startswith(("aten._scaled_mm_v2.", "aten._scaled_grouped_mm_v2."))


@contextlib.contextmanager
def _v1_compute_only(module):
    """Within: ``module``'s ``is_fp8_compute`` is the one a pass written for ``_scaled_mm``
    has: a v2 matmul of FP8 operands is no FP8 compute."""
    original = module.is_fp8_compute
    module.is_fp8_compute = lambda node: original(node) and not _is_v2(node)
    try:
        yield
    finally:
        module.is_fp8_compute = original


class V1OnlyValidation(ReferenceBackend):
    """Counts ``aten._scaled_mm`` as FP8 compute and nothing else: every linear on ``F.scaled_mm``
    reads as having lost its FP8 compute, and strict validation rejects a valid graph."""

    name = "mutant-v1-only-validation"
    KILLED_BY = "VAL-001"

    def validate(self, gm, *, strict):
        with _v1_compute_only(fp8conf.graph.validate):
            return super().validate(gm, strict=strict)


class V1OnlyRegions(ReferenceBackend):
    """Grows regions from ``aten._scaled_mm`` nodes only: a v2 matmul lies in no region and its
    quantization is never compiled with it."""

    name = "mutant-v1-only-regions"
    KILLED_BY = "REG-001"

    def regions(self, gm):
        with _v1_compute_only(fp8conf.graph.regions):
            return super().regions(gm)


class V2ProvenanceDropped(ReferenceBackend):
    """A provenance pass that puts the module on the ops it knows (the casts, amax and
    ``aten._scaled_mm``) and leaves the ``_scaled_mm_v2`` calls bare."""

    name = "mutant-v2-provenance-dropped"
    KILLED_BY = "PROV-001"

    def trace_joint(self, model, args):
        gm = super().trace_joint(model, args)
        for node in gm.graph.nodes:
            if _is_v2(node):
                node.meta.pop(fp8conf.PROVENANCE_META_KEY, None)
        return gm


# The same defects met on grouped experts: each is caught by the MOE property of its pass.


class V1OnlyGroupedValidation(V1OnlyValidation):
    """Counts ``aten._scaled_grouped_mm`` as grouped FP8 compute and not its v2: every experts
    module on ``F.scaled_grouped_mm`` reads as having lost its FP8 GEMMs."""

    name = "mutant-v1-only-grouped-validation"
    KILLED_BY = "MOE-002"


class V1OnlyGroupedRegions(V1OnlyRegions):
    """Grows regions from first-API grouped GEMMs only: a v2 grouped GEMM lies in no region."""

    name = "mutant-v1-only-grouped-regions"
    KILLED_BY = "MOE-004"


class V2GroupedProvenanceDropped(V2ProvenanceDropped):
    """Leaves the ``_scaled_grouped_mm_v2`` calls of the experts without provenance."""

    name = "mutant-v2-grouped-provenance-dropped"
    KILLED_BY = "MOE-001"


MUTANTS = [
    V1OnlyValidation, V1OnlyRegions, V2ProvenanceDropped, V1OnlyGroupedValidation, V1OnlyGroupedRegions,
    V2GroupedProvenanceDropped,
]


def _without_v2(mutant):
    """``mutant`` claiming neither ``scaled_mm_v2`` nor ``scaled_grouped_mm_v2``: the suite draws
    no linear on ``F.scaled_mm`` (nor NVFP4 or swizzled MX linears) and no experts on
    ``F.scaled_grouped_mm`` for it."""
    return type(
        f"{mutant.__name__}WithoutV2",
        (mutant,),
        {
            "__module__": __name__,
            "__doc__": f"{mutant.__name__} without the v2 capabilities: shown no model on torch's second scaled-matmul API.",
            "name": f"{mutant.name}-without-v2",
            "capabilities": mutant.capabilities - _V2_CAPABILITIES,
            "mx_recipes": mutant.mx_recipes - {"mxfp8_swizzled"},
        },
    )


WITHOUT_V2 = [_without_v2(m) for m in MUTANTS]
globals().update({m.__name__: m for m in WITHOUT_V2})  # importable as mutants.scaled_mm_v2:<Name>
