"""The coverage matrix: which module families each area of the suite draws.

A family of quantized modules that reaches only some areas is judged only there: a backend whose
fingerprint leaves out linears on ``F.scaled_mm`` passes every property that never builds one.
:data:`EXPECTED` says, for every family (a row) and area (a column), that the area draws the
family for a backend that claims it, or why it does not (``N/A: reason``); SPEC.md shows the same
table (*Coverage*). A run's report holds the matrix as observed (:func:`observed`): the areas whose
properties built each family's modules, from what every property noted it built
(``conformance.observe.evidence.built``), and the state of every cell for the backend under test
(:func:`cells`): drawn, not supported (the capability it does not claim), structure only (the
family drawn, its numerics there not run on this torch and device) or N/A. fp8conf's own tests
hold the reference's run to :data:`EXPECTED` and every family the suite can draw to a row of it.
Plain Python: the plugin reads it without importing torch.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

__all__ = [
    "AREAS", "DRAWN", "EXPECTED", "FAMILY_CAPABILITIES", "NOT_APPLICABLE", "NOT_DRAWN", "NOT_SUPPORTED", "KIND_ROWS", "ROWS", "ROW_RECIPES",
    "STRUCTURE_ONLY", "area_of", "cells", "left_out", "observed", "row_of", "spec_table",
]

#: The areas of the spec, in SPEC's order.
AREAS = ("PROV", "VAL", "EMU", "REG", "NUM", "BND", "FPR", "RWR", "MOE", "DP", "E8M0", "NVF", "MXS")

#: A cell whose area draws the family for a backend that claims it.
DRAWN = "drawn"
#: The other states of a cell in a run (:func:`cells`), each followed by ``: why``. N/A: the
#: area never draws the family (:data:`EXPECTED` says why). Structure only: an N/A cell whose
#: reason starts so, shown as such in a run that drew the family elsewhere: its graphs were
#: checked, its numerics in this area were not run. Not supported: the backend does not claim
#: the capability the family or the area needs. Not drawn: none of the above, and no property
#: of the area built the family in this run (not selected, or the run ended first).
NOT_APPLICABLE, STRUCTURE_ONLY, NOT_SUPPORTED, NOT_DRAWN = "N/A", "structure only", "not supported", "not drawn"

def _row(drawn: Iterable[str], reasons: dict[str, str]) -> dict[str, str]:
    """A row: the ``drawn`` areas, every other one ``N/A`` with its reason in ``reasons``."""
    drawn = set(drawn)
    return {area: DRAWN if area in drawn else f"N/A: {reasons[area]}" for area in AREAS}


#: The areas that draw every kind of quantized linear the backend claims.
_LINEAR_AREAS = ("PROV", "VAL", "EMU", "REG", "NUM", "BND", "FPR", "RWR")
_ELSEWHERE = {
    "MOE": "MOE draws grouped experts only",
    "DP": "DP shards TorchAO's or the backend's own float8 linears only",
    "E8M0": "E8M0 checks MX scale bytes on tensors of its own",
    "NVF": "NVF holds NVFP4 linears only",
    "MXS": "MXS holds swizzled MX linears only",
}


def _linear(*also: str, **not_drawn: str) -> dict[str, str]:
    """A row of linears: drawn by the linear areas and ``also``, except ``not_drawn`` (area=reason)."""
    drawn = [a for a in _LINEAR_AREAS + also if a not in not_drawn]
    return _row(drawn, {**_ELSEWHERE, **not_drawn})


_GROUPED = {area: "grouped experts are drawn by MOE, FPR and EMU-006" for area in AREAS}
_TENSORWISE_GATHER = ("TorchAO's float8 all-gather takes tensorwise scales, so DP shards TorchAO's linears tensorwise; a "
                      "backend's own float8 linears are sharded in their own recipes")

#: Family -> area -> ``drawn`` or ``N/A: reason``.
EXPECTED: dict[str, dict[str, str]] = {
    "float8 tensorwise": _linear("DP"),
    "float8 rowwise": _linear(DP=_TENSORWISE_GATHER),
    "float8 rowwise_with_gw_hp": _linear(DP=_TENSORWISE_GATHER),
    "float8 on F.scaled_mm": _linear(),
    "MX": _linear(),
    "MX swizzled on F.scaled_mm": _linear("MXS", NUM="structure only: Inductor in this torch refuses swizzled scales (MXS-001 "
                                                     "notes the refusal); numerics by MXS-002's reading and EMU-005's definition"),
    "NVFP4": _linear("NVF", NUM="structure only: no CPU kernel and no Inductor lowering in this torch; numerics by NVF-002's "
                                "reading and EMU-005's definition"),
    "grouped experts": _row(["EMU", "FPR", "MOE"], _GROUPED),
    "grouped experts on F.scaled_grouped_mm": _row(["EMU", "FPR", "MOE"], _GROUPED),
}
ROWS = tuple(EXPECTED)

#: The capability a backend claims for the suite to draw a family at all (TorchAO's float8
#: linears need none; swizzled MX also needs ``mxfp8_swizzled`` in ``Backend.mx_recipes``).
FAMILY_CAPABILITIES = {
    "float8 on F.scaled_mm": "scaled_mm_v2",
    "MX": "mx",
    "MX swizzled on F.scaled_mm": "mx",
    "NVFP4": "nvfp4",
    "grouped experts": "moe",
    "grouped experts on F.scaled_grouped_mm": "scaled_grouped_mm_v2",
}


def row_of(family: str, kind: str, recipe: str) -> str | None:
    """The matrix row of a quantized module noted as built (``conformance.observe.evidence.built``'s
    family, kind and recipe), None for a kind the matrix does not know."""
    if kind == "float8_linear":
        return f"float8 {recipe}"
    if kind == "float8_scaled_mm_linear":
        return "float8 on F.scaled_mm"
    if kind == "mxfp8_linear":
        return "MX swizzled on F.scaled_mm" if recipe == "mxfp8_swizzled" else "MX"
    if kind == "nvfp4_linear":
        return "NVFP4"
    if kind == "float8_grouped_experts":
        return "grouped experts on F.scaled_grouped_mm" if family.endswith("F.scaled_grouped_mm") else "grouped experts"
    return None


#: The matrix rows of a drawing kind (``conformance.strategies``' kinds).
KIND_ROWS = {
    "float8_linear": ("float8 tensorwise", "float8 rowwise", "float8 rowwise_with_gw_hp"),
    "float8_scaled_mm_linear": ("float8 on F.scaled_mm",),
    "mxfp8_linear": ("MX",),
    "mxfp8_swizzled": ("MX swizzled on F.scaled_mm",),
    "nvfp4_linear": ("NVFP4",),
}


def left_out(left_by_property: Iterable[tuple[Iterable[str], Iterable[tuple[str, str]]]]) -> dict[str, dict[str, str]]:
    """Row -> area -> why that area's properties drew none of the row's modules, from
    ``(property IDs, (kind, reason) entries)`` pairs (``conformance.observe.evidence.left_out``)."""
    found: dict[str, dict[str, str]] = {}
    for property_ids, entries in left_by_property:
        for kind, reason in entries:
            for row in KIND_ROWS.get(kind, (kind,)):
                for property_id in property_ids:
                    found.setdefault(row, {}).setdefault(area_of(property_id), reason)
    return found


def area_of(property_id: str) -> str:
    """The area of a property: its ID before the number (``BND-003`` -> ``BND``)."""
    return property_id.rsplit("-", 1)[0]


def observed(built_by_property: Iterable[tuple[Iterable[str], Iterable[tuple[str, ...]]]]) -> dict[str, list[str]]:
    """Row -> the areas that built it, from ``(property IDs, built entries)`` pairs (the
    entries as ``conformance.observe.evidence.built`` notes them: family, kind, module, recipe, built by).
    A kind the matrix does not know is its own row, under its kind's name."""
    found: dict[str, set[str]] = {}
    for property_ids, entries in built_by_property:
        for family, kind, _module, recipe, _by in entries:
            row = row_of(family, kind, recipe) or kind
            found.setdefault(row, set()).update(area_of(p) for p in property_ids)
    return {row: [a for a in AREAS if a in areas] + sorted(areas - set(AREAS)) for row, areas in sorted(found.items())}


#: The recipe a row's modules have, by the backend's list that declares it (``Backend.float8_recipes``
#: for its own float8 linears, ``Backend.mx_recipes``): a backend that lacks it is shown none.
ROW_RECIPES = {
    **{f"float8 {recipe}": ("float8_recipes", recipe) for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp")},
    "MX": ("mx_recipes", "mxfp8"),
    "MX swizzled on F.scaled_mm": ("mx_recipes", "mxfp8_swizzled"),
}


def cells(
    seen: Mapping[str, Iterable[str]], capabilities: Iterable[str], rows: Mapping[str, Mapping[str, Any]],
    recipes: Mapping[str, Iterable[str]] | None = None, left: Mapping[str, Mapping[str, str]] | None = None,
) -> dict[str, dict[str, str]]:
    """Row -> area -> the cell's state in a run, for the backend under test: ``drawn``, or one of
    the other states with its reason (``not supported: capability nvfp4 not claimed``), from
    what the run observed:
    ``seen`` (:func:`observed`), the capabilities the backend claims, the report's property
    rows (their ``status`` and ``capability``) and the recipes the suite drew for it
    (``{"float8_recipes": [...], "mx_recipes": [...]}``, as the report's ``backend`` has them; a
    list left out: every recipe). A drawn cell is drawn whatever :data:`EXPECTED` says; a row the
    matrix does not know is drawn where it was built and not drawn elsewhere. ``left``
    (:func:`left_out`): a cell its area's properties left out because the device cannot run the
    family, and no property of the area built, is structure only, saying why."""
    claimed = set(capabilities)
    lacking = {row: f"{NOT_SUPPORTED}: recipe {recipe} not in the backend's {field}"
               for row, (field, recipe) in ROW_RECIPES.items()
               if recipes is not None and recipes.get(field) is not None and recipe not in set(recipes[field])}
    unsupported: dict[str, set[str]] = {}
    judged: set[str] = set()
    for property_id, row in rows.items():
        area = area_of(property_id)
        if row.get("status") == "not_supported":
            unsupported.setdefault(area, set()).add(row.get("capability") or "?")
        else:
            judged.add(area)
    # An area is not supported when every property of it that the run holds was.
    area_unsupported = {area: sorted(caps) for area, caps in unsupported.items() if area not in judged}
    return {
        row: {area: _state(row, area, set(seen.get(row, ())), claimed, area_unsupported.get(area, []), lacking.get(row),
                           (left or {}).get(row, {}).get(area))
              for area in AREAS}
        for row in list(EXPECTED) + [r for r in seen if r not in EXPECTED]
    }


def _state(row: str, area: str, drawn: set[str], claimed: set[str], area_unsupported: list[str], lacking: str | None,
           left_out_because: str | None = None) -> str:
    """One cell of :func:`cells`: ``area_unsupported``, the capabilities of the area's properties
    where all of them were ``not_supported`` in the run; ``lacking``, the state of a row whose
    recipe the backend does not declare."""
    if area in drawn:
        return DRAWN
    expected = EXPECTED.get(row, {}).get(area, DRAWN)
    reason = expected.removeprefix(f"{NOT_APPLICABLE}: ")
    structure_only = reason.startswith(f"{STRUCTURE_ONLY}: ")
    if expected != DRAWN and not structure_only:
        return expected
    needs = FAMILY_CAPABILITIES.get(row)
    if needs is not None and needs not in claimed:
        return f"{NOT_SUPPORTED}: capability {needs} not claimed"
    if lacking is not None:
        return lacking
    if area_unsupported:
        return f"{NOT_SUPPORTED}: every {area} property of the run not_supported (capability {', '.join(area_unsupported)})"
    if structure_only:
        return reason if drawn else expected
    if left_out_because is not None:
        return f"{STRUCTURE_ONLY}: {left_out_because}"
    return f"{NOT_DRAWN}: no property of {area} built it in this run"


def spec_table() -> list[str]:
    """SPEC.md's *Coverage* table: a row per family, a column per area; ``x`` drawn, a letter
    for each N/A with its reason below."""
    reasons: dict[str, str] = {}
    lines = ["| Family | " + " | ".join(AREAS) + " |", "|---|" + "---|" * len(AREAS)]
    for row, cells in EXPECTED.items():
        marks = []
        for area in AREAS:
            cell = cells[area]
            if cell == DRAWN:
                marks.append("x")
            else:
                reason = cell.removeprefix("N/A: ")
                reasons.setdefault(reason, chr(ord("a") + len(reasons)))
                marks.append(reasons[reason])
        lines.append(f"| {row} | " + " | ".join(marks) + " |")
    lines.append("")
    lines += [f"{letter}: {reason}." for reason, letter in reasons.items()]
    return lines
