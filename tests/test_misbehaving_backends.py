"""A backend whose methods raise or return the wrong thing fails the properties that call them,
with a message naming the method, and the rest of the run goes on."""

from __future__ import annotations

from test_mutants import run_suite


def test_a_raising_method_fails_its_properties_and_the_run_goes_on(tmp_path):
    statuses, out = run_suite("mutants.misbehaving:ProvenanceRaises", ["PROV-001", "VAL-001"], tmp_path)
    assert statuses["PROV-001"]["status"] == "fail"
    assert "provenance() raised KeyError: 'fp8_meta'" in out
    assert statuses["VAL-001"]["status"] == "pass", out[-3000:]


def test_a_wrong_return_type_is_named(tmp_path):
    statuses, out = run_suite("mutants.misbehaving:ValidateReturnsDict", ["VAL-004"], tmp_path)
    assert statuses["VAL-004"]["status"] == "fail"
    assert "validate() returned dict, expected ValidationReport" in out
