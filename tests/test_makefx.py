"""The second in-tree backend, ``makefx`` (a make_fx + torch.autograd.grad trainer), passes every
property it claims, and the mutants of its contract points are caught on it.

The run is the suite itself in a subprocess, as the reference's is (tests/test_mutants.py), with
the same profile: ``fp8conf-mutants``, that is ``fp8conf-ci`` (derandomized, 25 examples per
structural property) without shrinking. The whole-suite run is made once, by a module fixture,
and read by each test that judges it.
"""

from __future__ import annotations

import pytest

from mutants import peers
from suite_runs import TEST_TIMEOUT_S, Run, reads_shared_run, run_suite, run_suites

BACKEND = "conformance.backends.makefx:MakeFxBackend"
CLAIMED_AT_LEAST = {"provenance", "validation", "emulation", "regions", "graphpp", "fingerprint"}


def test_makefx_claims_the_contract_points_a_peer_needs():
    from conformance.backends.makefx import MakeFxBackend

    assert CLAIMED_AT_LEAST <= MakeFxBackend.capabilities
    assert not MakeFxBackend.provenance_has_recipe


@pytest.fixture(scope="module")
def makefx_run(tmp_path_factory):
    """The whole suite against makefx, once for the tests that read it."""
    return run_suites([Run("makefx", BACKEND)], tmp_path_factory.mktemp("makefx"))["makefx"]


@reads_shared_run("suite-makefx")
def test_makefx_passes_every_property_it_claims(makefx_run):
    statuses, out = makefx_run.require()
    failing = {k: v["status"] for k, v in statuses.items() if v["status"] not in ("pass", "not_supported", "skipped")}
    assert not failing, f"makefx fails {failing}:\n{out[-4000:]}"


@reads_shared_run("suite-makefx")
def test_makefx_passes_every_property_its_mutants_break(makefx_run):
    statuses, out = makefx_run.require()
    passed = {k for k, v in statuses.items() if v["status"] == "pass"}
    wanted = {m.KILLED_BY for m in peers.MAKEFX_MUTANTS}
    assert wanted <= passed, f"not passed: {sorted(wanted - passed)}"


@reads_shared_run("suite-makefx")
def test_makefx_report_notes_that_the_recipe_is_not_checked(makefx_run):
    # The recipe is not checked for a backend that records none, and the report says so.
    statuses, _ = makefx_run.require()
    assert any("recipe not checked" in note for note in statuses["PROV-002"].get("notes", ())), statuses["PROV-002"]


@reads_shared_run("suite-makefx")
def test_makefx_passes_the_fingerprint_rules_as_a_whole_step_key_over_recipe_names(makefx_run):
    # Its key covers registration order, structure and the whole job, its signature the modules
    # only: the rules of a whole-step scope pass, saying what they did not compare; its jobs
    # express no config field, so those changes are not_supported, not failed.
    statuses, out = makefx_run.require()
    for property_id in ("FPR-001", "FPR-002", "FPR-003", "FPR-005", "FPR-006"):
        assert statuses[property_id]["status"] == "pass", out[-4000:]
    for property_id in ("FPR-002", "FPR-003", "FPR-005", "FPR-006"):
        assert any("whole_step" in note for note in statuses[property_id].get("notes", ())), statuses[property_id]
    for property_id in ("FPR-001", "FPR-005"):
        assert statuses[property_id]["outcomes"] == {"pass": 7, "not_supported": 2}, statuses[property_id]
        assert any("expressible_config_fields []" in note for note in statuses[property_id]["notes"])


@reads_shared_run("suite-makefx")
def test_makefx_artifacts_are_not_supported(makefx_run):
    statuses, _ = makefx_run.require()
    assert statuses["FPR-004"]["status"] == "not_supported", statuses["FPR-004"]  # artifacts are not claimed


@pytest.mark.timeout(TEST_TIMEOUT_S)  # above run_suite's hang guard, which speaks first
def test_a_backend_reporting_no_region_fails_the_region_rules_saying_so(tmp_path):
    statuses, out = run_suite("mutants.peers:NoRegions", ["REG-002", "REG-005"], tmp_path)
    for property_id in ("REG-002", "REG-005"):
        row = statuses[property_id]
        assert row["status"] == "fail", out[-3000:]
        assert "reported no region" in row["reproducer"]["message"], row["reproducer"]["message"]
        assert "Cannot sample" not in row["reproducer"]["message"]
