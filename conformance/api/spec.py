"""The registry of spec properties: the single source of IDs, levels and capabilities.

Tests cite a property with ``@pytest.mark.fp8_property("PROV-003")``; the plugin skips it as
``not_supported`` when the backend does not claim its capability, and the project's own tests
check that every cited ID exists here and every MUST property has a test.
"""

from __future__ import annotations

import dataclasses

__all__ = ["SPEC_VERSION", "Property", "PROPERTIES", "get_property", "relied_on"]

#: 1.1: PROV-002 checks the recipe only where the backend records one; BND-001 also runs a
#: backend's own split runner; FPR-004 moves to capability ``artifacts``; FPR-006 is new.
SPEC_VERSION = "1.1"


@dataclasses.dataclass(frozen=True)
class Property:
    id: str
    level: str  # "MUST" or "SHOULD"
    capability: str
    since: str
    title: str
    #: Properties this one cannot hold without: their checks read what those guarantee (a
    #: validator counts FP8 compute by its provenance). When one of them fails too, this
    #: property's failure is reported as its consequence, not as a defect of its own.
    relies_on: tuple[str, ...] = ()


# Everything that attributes nodes to modules reads provenance; PROV-003's message names the
# backward pass, where a provenance defect shows first, so PROV-001/-006 defer to it.
_PROVENANCE = ("PROV-001", "PROV-002", "PROV-003", "PROV-004", "PROV-006")
_RELIES_ON = {
    "PROV-001": ("PROV-003",),
    "PROV-006": ("PROV-003",),
    **{
        f"{area}-{number:03d}": _PROVENANCE
        for area, count in (("VAL", 7), ("EMU", 3), ("REG", 7), ("BND", 6))
        for number in range(1, count + 1)
    },
}


def _p(id: str, level: str, capability: str, title: str, since: str = "1.0") -> Property:
    return Property(id, level, capability, since, title, _RELIES_ON.get(id, ()))


_ALL = [
    _p("PROV-001", "MUST", "provenance", "every FP8 compute node, forward and backward, carries provenance naming the quantized module that issued it"),
    _p("PROV-002", "MUST", "provenance", "provenance kind/recipe/emulate equal that module's config (the recipe where the backend records one)"),
    _p("PROV-003", "MUST", "provenance", "backward nodes carry the provenance of the forward op they differentiate; cross-module gradient accumulation carries none"),
    _p("PROV-004", "MUST", "provenance", "no node carries provenance of a module that did not issue it; unquantized modules' nodes carry none"),
    _p("PROV-005", "SHOULD", "provenance", "provenance survives the backend's own rewrites (DCE, CSE, partition, split) unchanged"),
    _p("PROV-006", "MUST", "provenance", "a module called twice attributes both calls to its FQN; nested quantized modules attribute to the innermost"),
    _p("VAL-001", "MUST", "validation", "strict validation accepts every graph the backend makes from a supported model"),
    _p("VAL-002", "MUST", "validation", "a non-emulated module lacking FP8 compute in a pass fails strict validation, naming its FQN and the pass"),
    _p("VAL-003", "MUST", "validation", "FP8 compute without provenance fails strict validation; never a silent fallback"),
    _p("VAL-004", "MUST", "validation", "a scaled op whose matrix operands are not both FP8 is not counted as FP8 compute"),
    _p("VAL-005", "MUST", "validation", "validation does not change the graph (code and node meta identical)"),
    _p("VAL-006", "SHOULD", "validation", "non-strict mode reports the same findings as warnings plus a summary"),
    _p("VAL-007", "MUST", "validation", "compute counts per call match the recipe"),
    _p("EMU-001", "MUST", "emulation", "emulated modules pass strict validation without FP8 compute"),
    _p("EMU-002", "MUST", "emulation", "exemption is per module: an emulated module never excuses a non-emulated one"),
    _p("EMU-003", "SHOULD", "emulation", "emulated and real versions of a model agree within the recipe's tolerance, outputs and gradients"),
    _p("REG-001", "MUST", "regions", "every FP8 compute node of a non-emulated module lies in exactly one region"),
    _p("REG-002", "MUST", "regions", "a region never mixes modules or passes"),
    _p("REG-003", "MUST", "regions", "a region is convex: no path between two of its nodes leaves it"),
    _p("REG-004", "MUST", "regions", "only complete regions are tagged; incomplete ones are reported, not compiled"),
    _p("REG-005", "MUST", "regions", "after a rewrite removes part of a region, the partial region is not tagged"),
    _p("REG-006", "MUST", "regions", "identification is deterministic and independent of node names"),
    _p("REG-007", "MUST", "regions", "tagging keeps other compile annotations on the graph intact"),
    _p("NUM-001", "MUST", "compile.full", "full Inductor compile of the joint graph matches eager"),
    _p("NUM-002", "MUST", "compile.regional", "regional compile matches eager"),
    _p("NUM-003", "MUST", "compile.regional", "every tagged region is compiled and nothing untagged is"),
    _p("NUM-004", "MUST", "cudagraph", "CUDA-graph replays of the compiled FP8 graph with fresh inputs match eager"),
    _p("BND-001", "MUST", "graphpp", "forward then (dI, dW), wired by the suite or run once each, in order, by the backend's runner, reproduces the joint graph's outputs and gradients bitwise"),
    _p("BND-002", "MUST", "graphpp", "every FP8 compute node lands in exactly one callable"),
    _p("BND-003", "MUST", "graphpp", "an FP8 tensor made in dI and used in dW crosses as an FP8 placeholder; no tensor is quantized twice"),
    _p("BND-004", "MUST", "graphpp", "regions re-identified in each callable are complete; a region that starts at an FP8 placeholder is tagged"),
    _p("BND-005", "MUST", "graphpp", "provenance survives the split"),
    _p("BND-006", "SHOULD", "graphpp", "strict validation runs on the whole stage graph before the split; callables are not re-failed for compute in a sibling"),
    _p("FPR-001", "MUST", "fingerprint", "changing any quantization input changes the fingerprint"),
    _p("FPR-002", "MUST", "fingerprint", "equal configs give equal fingerprints across processes, PYTHONHASHSEED, registration and dict order"),
    _p("FPR-003", "MUST", "fingerprint", "the quantization signature ignores settings unrelated to quantization"),
    _p("FPR-004", "MUST", "artifacts", "loading an artifact with another fingerprint fails naming the differing fields; it is never used"),
    _p("FPR-005", "SHOULD", "fingerprint", "the signature is canonical readable JSON; two signatures diff field by field"),
    _p("FPR-006", "MUST", "fingerprint", "a change of the backend's own job configuration changes the signature when it changes quantized numerics, and only then", since="1.1"),
    _p("E8M0-001", "MUST", "e8m0", "the op equals blockwise dequantize-then-matmul within output rounding"),
    _p("E8M0-002", "MUST", "e8m0", "byte 255 gives NaN where it applies; byte 0 means 2^-127, never flushed"),
    _p("E8M0-003", "MUST", "e8m0", "torch.library.opcheck passes"),
    _p("E8M0-004", "MUST", "e8m0", "under torch.compile(fullgraph=True) the op stays one opaque node, no e8m0 reaches generated code, result equals eager"),
    _p("E8M0-005", "MUST", "e8m0", "bad input raises a clear error naming the argument"),
]

PROPERTIES: dict[str, Property] = {p.id: p for p in _ALL}


def relied_on(property_id: str) -> tuple[str, ...]:
    """Every property ``property_id`` relies on, directly or through others, nearest first."""
    found: list[str] = []
    pending = list(get_property(property_id).relies_on)
    while pending:
        other = pending.pop(0)
        if other not in found:
            found.append(other)
            pending.extend(PROPERTIES[other].relies_on)
    return tuple(found)


def get_property(property_id: str) -> Property:
    try:
        return PROPERTIES[property_id]
    except KeyError:
        raise KeyError(f"unknown spec property {property_id!r}; known: {', '.join(PROPERTIES)}") from None
