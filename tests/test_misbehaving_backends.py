"""A backend whose methods raise or return the wrong thing fails the properties that call them,
with a message naming the method, and the rest of the run goes on; a backend is shown only the
models it claims to handle, and what it does to the suite's graphs in place stays in one property."""

from __future__ import annotations

import pytest

from conformance.api.spec import PROPERTIES
from suite_runs import OTHER_BACKENDS, TEST_TIMEOUT_S, Run, reads_shared_run
from test_mutants import run_suite
from timings import SESSIONS

# Above run_suite's hang guard, so that a run that hangs is reported as one by the guard.
pytestmark = pytest.mark.timeout(TEST_TIMEOUT_S)

#: Models per property of the shared runs: what they show (a run goes on past a raising method,
#: contract exceptions satisfy the rules, nothing tagged in place leaks) needs no more; whether
#: a property bites is the mutants' runs' business, at 25.
EXAMPLES = 5
# The slow tests' runs, made one after the other in the process of the other backends' runs (a
# process start costs seconds):
# label -> (backend, properties).
_SHARED = {
    "ProvenanceRaises": ("mutants.misbehaving:ProvenanceRaises", ("PROV-001", "VAL-001")),
    "Float8Only": ("mutants.contract:Float8Only", tuple(p for p in PROPERTIES if p.startswith(("PROV-", "VAL-")))),
    "TagsInPlace": ("mutants.contract:TagsInPlace",
                    ("REG-001", "REG-004", "REG-006", "REG-007", "VAL-001", "VAL-005", "VAL-007")),
    "ContractErrorsOnly": ("mutants.contract:ContractErrorsOnly",
                           ("VAL-002", "VAL-003", "VAL-007", "EMU-002", "BND-002", "BND-006", "FPR-004")),
}


#: The runs of ``_SHARED``, in the plan of the other backends (tests/suite_runs.py: other_backend_runs).
SHARED_RUNS = [Run(label, backend, properties, examples=EXAMPLES) for label, (backend, properties) in _SHARED.items()]


@pytest.fixture(scope="module")
def shared_runs(other_backend_runs):
    """The verdicts of the runs in ``_SHARED``, made once for the tests that read them."""
    return other_backend_runs


def _shared(shared_runs, label, record_property) -> tuple[dict, list, str]:
    record_property(SESSIONS, (f"misbehaving {label}", shared_runs[label].seconds or 0.0))
    statuses, out = shared_runs[label].require()
    return statuses, list(_SHARED[label][1]), out


@reads_shared_run(OTHER_BACKENDS)
def test_a_raising_method_fails_its_properties_and_the_run_goes_on(shared_runs, record_property):
    statuses, _, out = _shared(shared_runs, "ProvenanceRaises", record_property)
    assert statuses["PROV-001"]["status"] == "fail"
    assert "provenance() raised KeyError: 'fp8_meta'" in out
    assert statuses["VAL-001"]["status"] == "pass", out[-3000:]


def test_a_wrong_return_type_is_named(tmp_path):
    statuses, out = run_suite("mutants.misbehaving:ValidateReturnsDict", ["VAL-004"], tmp_path)
    assert statuses["VAL-004"]["status"] == "fail"
    assert "validate() returned dict, expected ValidationReport" in out


@reads_shared_run(OTHER_BACKENDS)
def test_a_float8_only_backend_is_never_shown_an_mx_model(shared_runs, record_property):
    # PROV and VAL draw MX models for a backend that claims mx and models with linears on
    # F.scaled_mm for one that claims scaled_mm_v2 (the reference: about half of them); this one
    # claims neither, and refuses the graphs of both (test_the_float8_only_backend_refuses_other_kinds).
    statuses, wanted, out = _shared(shared_runs, "Float8Only", record_property)
    failing = {p: statuses.get(p, {}).get("status") for p in wanted if statuses.get(p, {}).get("status") != "pass"}
    assert not failing, f"{failing}:\n{out[-4000:]}"
    # ... and it is shown as many models as any backend, not fewer.
    for property_id in ("PROV-001", "VAL-001"):
        assert statuses[property_id]["examples"] >= EXAMPLES, statuses[property_id]


@reads_shared_run(OTHER_BACKENDS)
def test_what_a_backend_tags_in_place_stays_in_the_property_that_let_it(shared_runs, record_property):
    # REG runs regions() on the suite's graphs of models that VAL validates later in the session.
    statuses, wanted, out = _shared(shared_runs, "TagsInPlace", record_property)
    failing = {p: statuses.get(p, {}).get("status") for p in wanted if statuses.get(p, {}).get("status") != "pass"}
    assert not failing, f"{failing}:\n{out[-4000:]}"


@reads_shared_run(OTHER_BACKENDS)
def test_the_contract_exceptions_themselves_satisfy_the_properties(shared_runs, record_property):
    statuses, wanted, out = _shared(shared_runs, "ContractErrorsOnly", record_property)
    failing = {p: statuses.get(p, {}).get("status") for p in wanted if statuses.get(p, {}).get("status") != "pass"}
    assert not failing, f"{failing}:\n{out[-4000:]}"


def test_graphs_without_recorded_values_are_named_as_the_cause(tmp_path):
    statuses, out = run_suite("mutants.misbehaving:TraceKeepsNoValues", ["PROV-001"], tmp_path)
    assert statuses["PROV-001"]["status"] == "fail"
    assert "record no node.meta['val']" in out, out[-3000:]
    assert "holds no FP8 compute at all" not in out


@pytest.mark.parametrize("recipe", ["mxfp8", "scaled_mm_tensorwise"])
def test_the_float8_only_backend_refuses_other_kinds(recipe):
    # What makes the run above mean something: shown such a graph, it fails the property.
    from conformance.backends.reference import ReferenceBackend
    from conformance.run.harness import traced
    from conformance.draw.models import LayerSpec, ModelSpec
    from mutants.contract import Float8Only

    reference = ReferenceBackend()
    if recipe.startswith("scaled_mm") and "scaled_mm_v2" not in reference.capabilities:
        pytest.skip("this torch has no F.scaled_mm")
    gm = traced("VAL-001", reference, ModelSpec(in_features=32, layers=(LayerSpec(width=32, recipe=recipe),))).gm
    with pytest.raises(TypeError, match="float8-only backend was shown"):
        Float8Only().validate(gm, strict=True)
    fp8 = ModelSpec(in_features=32, layers=(LayerSpec(width=32, recipe="tensorwise"),))
    assert Float8Only().validate(traced("VAL-001", reference, fp8).gm, strict=True).compute_counts
