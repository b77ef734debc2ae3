"""The coverage matrix (conformance/report/coverage.py): a row for every family the suite can draw, a
cell for every area, SPEC.md showing the same table. Whether the reference's run draws what the
matrix says is checked on that run (tests/test_mutants.py)."""

from __future__ import annotations

from pathlib import Path

import conformance
from conformance.report import coverage
from conformance.api.spec import PROPERTIES
from conformance.draw.models import MX_RECIPES, NVFP4_RECIPES, SCALED_MM_RECIPES, base_recipe, kind_of
from conformance.draw.moe import GROUPED_KIND
from conformance.draw.strategies import FLOAT8_RECIPES

SPEC = Path(conformance.__file__).resolve().parent / "SPEC.md"
NVFP4 = ("stacks", "nvfp4_linear", "X", "nvfp4", "convert_nvfp4")


def test_every_area_of_the_spec_is_a_column_and_every_row_fills_it():
    assert set(coverage.AREAS) == {coverage.area_of(p) for p in PROPERTIES}
    for row, cells in coverage.EXPECTED.items():
        assert list(cells) == list(coverage.AREAS), row
        for area, cell in cells.items():
            assert cell == coverage.DRAWN or (cell.startswith("N/A: ") and len(cell) > 10), (row, area, cell)


def test_every_family_the_suite_draws_has_a_row():
    # Every recipe of every kind of layer the models build, and grouped experts on both APIs.
    built = [("stacks", kind_of(r), base_recipe(r)) for r in (*FLOAT8_RECIPES, *SCALED_MM_RECIPES, *MX_RECIPES, *NVFP4_RECIPES)]
    built += [("moe", GROUPED_KIND, "rowwise"), ("moe on F.scaled_grouped_mm", GROUPED_KIND, "rowwise")]
    rows = {coverage.row_of(*b) for b in built}
    assert None not in rows, built
    assert rows == set(coverage.EXPECTED), (sorted(rows), sorted(coverage.EXPECTED))


def test_the_observed_matrix_groups_what_each_property_built_by_area():
    entries = [("stacks", "float8_linear", "Float8Linear", "rowwise", "TorchAO"), ("stacks", "nvfp4_linear", "X", "nvfp4", "convert_nvfp4")]
    seen = coverage.observed([(("BND-003", "PROV-001"), entries), (("NVF-001",), entries[1:]), (("XYZ-001",), [("s", "new_kind", "M", "r", "")])])
    assert seen == {"NVFP4": ["PROV", "BND", "NVF"], "float8 rowwise": ["PROV", "BND"], "new_kind": ["XYZ"]}


def test_spec_shows_the_matrix():
    text = SPEC.read_text(encoding="utf-8")
    table = "\n".join(coverage.spec_table())
    assert table in text, f"SPEC.md's Coverage table differs from conformance.report.coverage.EXPECTED; it should read:\n{table}"


def test_a_run_s_cells_are_read_off_the_run():
    # NVFP4 drawn by PROV: its NUM cell, whose reason starts "structure only", is structure only;
    # MX is not claimed; DP's only property was not_supported; REG ran without building NVFP4.
    seen = coverage.observed([(("PROV-001",), [NVFP4]), (("NVF-001",), [NVFP4])])
    rows = {"PROV-001": {"status": "pass", "capability": "provenance"},
            "REG-001": {"status": "fail", "capability": "regions"},
            "DP-001": {"status": "not_supported", "capability": "distributed"}}
    cells = coverage.cells(seen, ["provenance", "regions", "nvfp4"], rows)
    nvfp4 = cells["NVFP4"]
    assert (nvfp4["PROV"], nvfp4["NVF"]) == ("drawn", "drawn")
    assert nvfp4["NUM"] == coverage.EXPECTED["NVFP4"]["NUM"].removeprefix("N/A: ")
    assert nvfp4["NUM"].startswith("structure only: ")
    assert nvfp4["REG"].startswith("not drawn") and nvfp4["MOE"] == coverage.EXPECTED["NVFP4"]["MOE"]
    not_claimed = "not supported: capability mx not claimed"
    assert set(cells["MX"].values()) == {not_claimed} | {c for c in coverage.EXPECTED["MX"].values() if c != "drawn"}
    assert cells["float8 tensorwise"]["DP"] == "not supported: every DP property of the run not_supported (capability distributed)"
    # Not drawn anywhere, the family's structure-only cell is what the matrix says: N/A.
    assert coverage.cells({}, ["nvfp4"], {})["NVFP4"]["NUM"] == coverage.EXPECTED["NVFP4"]["NUM"]
    assert list(cells) == list(coverage.EXPECTED) and all(list(c) == list(coverage.AREAS) for c in cells.values())


def test_a_recipe_the_backend_does_not_declare_is_not_supported_not_missing():
    # A trainer whose own float8 linears are rowwise only, with MX but no swizzled MX: the rows of
    # the recipes it lacks say so in every area that would draw them, not "not drawn".
    seen = coverage.observed([(("PROV-001",), [("float8", "float8_linear", "layers.0", "rowwise", "backend")])])
    recipes = {"float8_recipes": ["rowwise"], "mx_recipes": ["mxfp8", "mxfp8_emulated"]}
    cells = coverage.cells(seen, ["provenance", "regions", "mx", "float8_modules"], {}, recipes)
    assert cells["float8 rowwise"]["PROV"] == "drawn" and cells["float8 rowwise"]["REG"].startswith("not drawn")
    for row, field in (("float8 tensorwise", "float8_recipes"), ("float8 rowwise_with_gw_hp", "float8_recipes"),
                       ("MX swizzled on F.scaled_mm", "mx_recipes")):
        recipe = coverage.ROW_RECIPES[row][1]
        assert cells[row]["PROV"] == f"not supported: recipe {recipe} not in the backend's {field}", (row, cells[row])
        assert all(c.startswith(("not supported: recipe", "N/A")) for c in cells[row].values()), (row, cells[row])
    assert cells["MX"]["REG"].startswith("not drawn")
    # Without the lists (an older report) nothing changes.
    assert coverage.cells(seen, ["provenance"], {})["float8 tensorwise"]["PROV"].startswith("not drawn")


def test_a_family_the_device_cannot_run_is_structure_only_where_it_was_left_out():
    # A torch with no CPU kernel for F.scaled_mm: NUM-001 and BND-001 left the v2 linears out and
    # said why; PROV built them. The NUM and BND cells say structure only with that reason, not
    # "not drawn"; an area that neither built nor left them out stays not drawn.
    reason = "float8_scaled_mm_linear layers are not drawn by the properties that run graphs: this torch has no cpu kernel"
    v2 = ("float8 on F.scaled_mm", "float8_scaled_mm_linear", "Linear", "tensorwise", "backend")
    seen = coverage.observed([(("PROV-001",), [v2])])
    left = coverage.left_out([(("NUM-001",), [("float8_scaled_mm_linear", reason)]), (("BND-001",), [("float8_scaled_mm_linear", reason)]),
                              (("PROV-001",), [])])
    cells = coverage.cells(seen, ["provenance", "compile.full", "graphpp", "scaled_mm_v2"], {}, None, left)["float8 on F.scaled_mm"]
    assert cells["PROV"] == "drawn"
    assert cells["NUM"] == cells["BND"] == f"structure only: {reason}"
    assert cells["REG"].startswith("not drawn")
    # Left out by one property but built by another of the area: drawn.
    seen = coverage.observed([(("PROV-001",), [v2]), (("NUM-002",), [v2])])
    assert coverage.cells(seen, ["provenance", "scaled_mm_v2"], {}, None, left)["float8 on F.scaled_mm"]["NUM"] == "drawn"
