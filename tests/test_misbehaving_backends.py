"""A backend whose methods raise or return the wrong thing fails the properties that call them,
with a message naming the method, and the rest of the run goes on; a backend is shown only the
models it claims to handle, and what it does to the suite's graphs in place stays in one property."""

from __future__ import annotations

import pytest

from conformance.api.spec import PROPERTIES
from suite_runs import TEST_TIMEOUT_S
from test_mutants import run_suite

# Above run_suite's hang guard, so that a run that hangs is reported as one by the guard.
pytestmark = pytest.mark.timeout(TEST_TIMEOUT_S)


@pytest.mark.slow
def test_a_raising_method_fails_its_properties_and_the_run_goes_on(tmp_path):
    statuses, out = run_suite("mutants.misbehaving:ProvenanceRaises", ["PROV-001", "VAL-001"], tmp_path)
    assert statuses["PROV-001"]["status"] == "fail"
    assert "provenance() raised KeyError: 'fp8_meta'" in out
    assert statuses["VAL-001"]["status"] == "pass", out[-3000:]


def test_a_wrong_return_type_is_named(tmp_path):
    statuses, out = run_suite("mutants.misbehaving:ValidateReturnsDict", ["VAL-004"], tmp_path)
    assert statuses["VAL-004"]["status"] == "fail"
    assert "validate() returned dict, expected ValidationReport" in out


@pytest.mark.slow
def test_a_float8_only_backend_is_never_shown_an_mx_model(tmp_path):
    # PROV and VAL draw MX models for a backend that claims mx and models with linears on
    # F.scaled_mm for one that claims scaled_mm_v2 (the reference: about half of them); this one
    # claims neither, and its tracer refuses both.
    wanted = [p for p in PROPERTIES if p.startswith(("PROV-", "VAL-"))]
    statuses, out = run_suite("mutants.contract:Float8Only", wanted, tmp_path)
    failing = {p: statuses.get(p, {}).get("status") for p in wanted if statuses.get(p, {}).get("status") != "pass"}
    assert not failing, f"{failing}:\n{out[-4000:]}"
    # ... and it is shown as many models as any backend, not fewer.
    for property_id in ("PROV-001", "VAL-001"):
        assert statuses[property_id]["examples"] >= 25, statuses[property_id]


@pytest.mark.slow
def test_what_a_backend_tags_in_place_stays_in_the_property_that_let_it(tmp_path):
    # REG runs regions() on the suite's graphs of models that VAL validates later in the session.
    wanted = ["REG-001", "REG-004", "REG-006", "REG-007", "VAL-001", "VAL-005", "VAL-007"]
    statuses, out = run_suite("mutants.contract:TagsInPlace", wanted, tmp_path)
    failing = {p: statuses.get(p, {}).get("status") for p in wanted if statuses.get(p, {}).get("status") != "pass"}
    assert not failing, f"{failing}:\n{out[-4000:]}"


@pytest.mark.slow
def test_the_contract_exceptions_themselves_satisfy_the_properties(tmp_path):
    wanted = ["VAL-002", "VAL-003", "VAL-007", "EMU-002", "BND-002", "BND-006", "FPR-004"]
    statuses, out = run_suite("mutants.contract:ContractErrorsOnly", wanted, tmp_path)
    failing = {p: statuses.get(p, {}).get("status") for p in wanted if statuses.get(p, {}).get("status") != "pass"}
    assert not failing, f"{failing}:\n{out[-4000:]}"


def test_graphs_without_recorded_values_are_named_as_the_cause(tmp_path):
    statuses, out = run_suite("mutants.misbehaving:TraceKeepsNoValues", ["PROV-001"], tmp_path)
    assert statuses["PROV-001"]["status"] == "fail"
    assert "record no node.meta['val']" in out, out[-3000:]
    assert "holds no FP8 compute at all" not in out
