"""The second in-tree backend, ``makefx`` (a make_fx + torch.autograd.grad trainer), passes every
property it claims, and the mutants of its contract points are caught on it.

The run is the suite itself in a subprocess, as the reference's is (tests/test_mutants.py), with
the same profile: ``fp8conf-mutants``, that is ``fp8conf-ci`` (derandomized, 25 examples per
structural property) without shrinking.
"""

from __future__ import annotations

from mutants import peers
from test_mutants import run_suite

BACKEND = "conformance.backends.makefx:MakeFxBackend"
CLAIMED_AT_LEAST = {"provenance", "validation", "emulation", "regions", "graphpp", "fingerprint"}


def test_makefx_claims_the_contract_points_a_peer_needs():
    from conformance.backends.makefx import MakeFxBackend

    assert CLAIMED_AT_LEAST <= MakeFxBackend.capabilities
    assert not MakeFxBackend.provenance_has_recipe


def test_makefx_passes_every_property_it_claims(tmp_path):
    statuses, out = run_suite(BACKEND, None, tmp_path)
    failing = {k: v["status"] for k, v in statuses.items() if v["status"] not in ("pass", "not_supported", "skipped")}
    assert not failing, f"makefx fails {failing}:\n{out[-4000:]}"
    passed = {k for k, v in statuses.items() if v["status"] == "pass"}
    assert {m.KILLED_BY for m in peers.MAKEFX_MUTANTS} <= passed
    # The recipe is not checked for a backend that records none, and the report says so.
    assert any("recipe not checked" in note for note in statuses["PROV-002"].get("notes", ()))
    assert statuses["FPR-004"]["status"] == "not_supported"  # artifacts are not claimed


def test_makefx_passes_the_fingerprint_rules_as_a_whole_step_key_over_recipe_names(tmp_path):
    # Its key covers registration order, structure and the whole job, its signature the modules
    # only: the rules of a whole-step scope pass, saying what they did not compare; its jobs
    # express no config field, so those changes are not_supported, not failed.
    statuses, out = run_suite(BACKEND, ["FPR-001", "FPR-002", "FPR-003", "FPR-005", "FPR-006"], tmp_path)
    for property_id in ("FPR-001", "FPR-002", "FPR-003", "FPR-005", "FPR-006"):
        assert statuses[property_id]["status"] == "pass", out[-4000:]
    for property_id in ("FPR-002", "FPR-003", "FPR-005", "FPR-006"):
        assert any("whole_step" in note for note in statuses[property_id].get("notes", ())), statuses[property_id]
    for property_id in ("FPR-001", "FPR-005"):
        assert statuses[property_id]["outcomes"] == {"pass": 7, "not_supported": 2}, statuses[property_id]
        assert any("expressible_config_fields []" in note for note in statuses[property_id]["notes"])


def test_a_backend_reporting_no_region_fails_the_region_rules_saying_so(tmp_path):
    statuses, out = run_suite("mutants.peers:NoRegions", ["REG-002", "REG-005"], tmp_path)
    for property_id in ("REG-002", "REG-005"):
        row = statuses[property_id]
        assert row["status"] == "fail", out[-3000:]
        assert "reported no region" in row["reproducer"]["message"], row["reproducer"]["message"]
        assert "Cannot sample" not in row["reproducer"]["message"]
