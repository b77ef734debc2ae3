"""Root causes on evidence (conformance/plugin/causes.py) and the reproducer each failing property
shows: the decision on hand-made report rows, the recording of examples, the readable model, the
smallest failing model, and two backends with planted defects run through the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings

from conformance.observe import evidence
from conformance.api.spec import PROPERTIES
from conformance.draw.models import LayerSpec, ModelSpec
from conformance.plugin import render
from conformance.plugin.causes import decide
from conformance.plugin.report import (
    EXAMPLE_OUTCOMES_KEY, PROPERTY_KEY, TestRecord, build_report, property_row, record_outcome,
)
from conformance.draw.strategies import ALL_KINDS, Constraints, _smallest_first, model_specs, served

ROOT = Path(__file__).resolve().parent.parent


def row(failed=None, passed=(), status="fail"):
    """A report row: ``failed`` maps an example key to the modules its failure named."""
    failed = failed or {}
    return {
        "status": status,
        "evidence": {
            "failed": {key: {"modules": list(modules), "nodes": [], "seen": f"saw {key}"} for key, modules in failed.items()},
            "passed": list(passed),
        },
    }


def defects(verdict):
    return [defect.properties for defect in verdict.defects]


# -- consequences --------------------------------------------------------------------------------
def test_a_failure_only_where_the_property_it_relies_on_fails_is_its_consequence():
    verdict = decide(
        {
            "PROV-003": row({"m1": [], "m2": []}, passed=["m3"]),
            # m9: a model PROV-003 never ran, evidence neither way.
            "VAL-003": row({"m1": [], "m9": []}, passed=["m3"]),
        },
        PROPERTIES,
    )
    assert defects(verdict) == [["PROV-003"]]
    assert verdict.caused_by == {"VAL-003": ["PROV-003"]} and verdict.caused_on == {"VAL-003": ["m1"]}
    assert verdict.root_causes() == {"PROV-003": ["VAL-003"]}
    assert verdict.causes["VAL-003"] == "consequence of PROV-003: fails with PROV-003 on model m1 and on no model it passes"


def test_a_failure_where_the_property_it_relies_on_passes_is_a_root_cause_of_its_own():
    verdict = decide({"PROV-002": row({"m1": []}, passed=["m4"]), "VAL-002": row({"m1": [], "m4": []})}, PROPERTIES)
    assert defects(verdict) == [["PROV-002"], ["VAL-002"]]
    assert verdict.caused_by == {} and verdict.root_causes() == {}
    assert verdict.defects[1].why == "relies on PROV-002, which fails too, but fails on model m4, which PROV-002 passes"
    assert verdict.defects[1].contrary == {"PROV-002": ["m4"]}
    assert verdict.causes["VAL-002"].startswith("root cause of its own: relies on PROV-002")


def test_a_failure_sharing_no_model_with_the_property_it_relies_on_is_a_root_cause_of_its_own():
    verdict = decide({"PROV-002": row({"m1": []}), "VAL-002": row({"m5": []}), "VAL-004": row()}, PROPERTIES)
    assert defects(verdict) == [["PROV-002"], ["VAL-002"], ["VAL-004"]]
    assert verdict.defects[1].why == "relies on PROV-002, which fails too, but no model failed both it and PROV-002"
    # A failure with no examples at all (a plain test, an error) is no evidence either.
    assert "no model failed both it and PROV-002" in verdict.defects[2].why


def test_a_consequence_names_the_root_behind_the_property_it_fails_with():
    # VAL-001 relies on PROV-001, which relies on PROV-003.
    failing = {"m1": []}
    verdict = decide({"PROV-001": row(failing), "PROV-003": row(failing), "VAL-001": row(failing)}, PROPERTIES)
    assert defects(verdict) == [["PROV-003"]]
    assert verdict.caused_by == {"PROV-001": ["PROV-003"], "VAL-001": ["PROV-003"]}


def test_the_reason_names_each_property_relied_on_with_its_evidence():
    verdict = decide(
        {"PROV-002": row({"m1": []}, passed=["m2"]), "PROV-004": row({"m3": []}, passed=["m2"]), "VAL-002": row({"m2": []})},
        PROPERTIES,
    )
    assert verdict.defects[-1].why == (
        "relies on PROV-002 and PROV-004, which fail too, but fails on model m2, which PROV-002 and PROV-004 pass"
    )


# -- one defect, several properties -------------------------------------------------------------
def test_properties_failing_on_the_same_models_at_the_same_module_are_one_defect():
    adapter = ["layers.0.adapter"]
    verdict = decide(
        {
            "PROV-002": row({"m1": adapter, "m2": ["layers.1.adapter"]}, passed=["m3"]),
            "PROV-003": row({"m1": ["layers.0", *adapter]}, passed=["m3"]),
            "PROV-004": row({"m1": ["layers.0", *adapter], "m2": ["layers.1"]}, passed=["m3"]),
            "VAL-001": row({"m1": adapter}, passed=["m3"]),
        },
        PROPERTIES,
    )
    assert defects(verdict) == [["PROV-002", "PROV-003", "PROV-004"]]
    defect = verdict.defects[0]
    assert (defect.examples, defect.named, defect.consequences) == (["m1"], ["module layers.0.adapter"], ["VAL-001"])
    assert defect.why == "all 3 fail on the same models and name the same module layers.0.adapter on model m1"
    assert verdict.causes["PROV-003"].startswith("one defect with PROV-002 and PROV-004: all 3 fail")
    assert verdict.root_causes() == {"PROV-002": ["VAL-001"]}


def test_properties_naming_different_modules_are_different_defects():
    verdict = decide({"PROV-002": row({"m1": ["layers.0"]}), "PROV-004": row({"m1": ["layers.1"]})}, PROPERTIES)
    assert defects(verdict) == [["PROV-002"], ["PROV-004"]]


def test_a_property_failing_where_another_passes_is_another_defect():
    same = ["layers.0.adapter"]
    verdict = decide({"PROV-002": row({"m1": same, "m2": same}), "PROV-004": row({"m1": same}, passed=["m2"])}, PROPERTIES)
    assert defects(verdict) == [["PROV-002"], ["PROV-004"]]


def test_a_defect_needs_something_named_by_all_its_properties():
    # Each pair names something in common on m1, the three nothing.
    verdict = decide(
        {"PROV-002": row({"m1": ["a", "b"]}), "PROV-004": row({"m1": ["a", "c"]}), "PROV-006": row({"m1": ["b", "c"]})},
        PROPERTIES,
    )
    assert defects(verdict) == [["PROV-002", "PROV-004"], ["PROV-006"]]


# -- what the report carries ----------------------------------------------------------------------
class SimpleReport:
    """A call-phase test report with the attributes ``record_outcome`` reads."""

    def __init__(self, outcomes, nodeid="t.py::test", result="failed"):
        self.nodeid, self.when, self.longrepr = nodeid, "call", None
        self.passed, self.failed, self.skipped = result == "passed", result == "failed", False
        self.user_properties = [(PROPERTY_KEY, "PROV-002"), (EXAMPLE_OUTCOMES_KEY, outcomes)]


def test_an_example_that_failed_once_stays_failed_across_reports_and_tests():
    records: dict[str, TestRecord] = {}
    failure = {"modules": ["layers.0"], "nodes": ["t"], "seen": "x", "size": [1, 256], "code": "spec = 1\n"}
    record_outcome(records, SimpleReport({"m1": "pass", "m2": failure}))
    record_outcome(records, SimpleReport({"m1": dict(failure, modules=["layers.1"]), "m2": "pass", "m3": "pass"}))
    assert records["t.py::test"].example_outcomes == {
        "m1": dict(failure, modules=["layers.1"]), "m2": failure, "m3": "pass"
    }
    other = TestRecord(("PROV-002",), "pass", 3, example_outcomes={"m3": failure})
    found = property_row(PROPERTIES["PROV-002"], [records["t.py::test"], other])["evidence"]
    assert sorted(found["failed"]) == ["m1", "m2", "m3"] and found["passed"] == []
    assert found["failed"]["m2"] == {"modules": ["layers.0"], "nodes": ["t"], "seen": "x"}


def test_a_failing_row_shows_the_smallest_model_among_its_tests():
    big = {"test": "t.py::a", "size": [3, 6000]}
    small = {"test": "t.py::b", "size": [1, 256]}
    unknown = {"test": "t.py::c"}
    records = [TestRecord(("PROV-002",), "fail", 1, found) for found in (unknown, big, small)]
    assert property_row(PROPERTIES["PROV-002"], records)["reproducer"] == small


def _report(records):
    return build_report(
        records, PROPERTIES, suite={"name": "fp8conf", "version": "0"}, spec_version="1.1", checked_spec_version="1.1",
        backend={"name": "fake", "version": "1", "spec": "m:Fake", "spec_version": "1.1", "capabilities": []},
        environment={"python": "3", "torch": None, "torchao": None, "pytest": "9", "hypothesis": "6",
                     "hypothesis_profile": "fp8conf-ci", "device": "cpu", "compute_capability": None},
        options={},
    )


def test_the_markdown_shows_the_model_a_root_cause_of_its_own_fails_on():
    code = "spec = ModelSpec(\n    in_features=16,\n)\n"
    failure = {"modules": [], "nodes": [], "seen": "lowered, yet strict validation passed", "size": [1, 256], "code": code}
    found = {"test": "t.py::test", "message": "[VAL-002] ...", "command": "pytest ...", "model": "x = 1\n"}
    records = {
        "t.py::p": TestRecord(("PROV-002",), "fail", 2, dict(found), example_outcomes={"m1": failure, "m4": "pass"}),
        "t.py::v": TestRecord(("VAL-002",), "fail", 2, dict(found), example_outcomes={"m1": failure, "m4": failure}),
    }
    report = _report(records)
    assert report["models"] == {"m1": {"size": [1, 256], "code": code}, "m4": {"size": [1, 256], "code": code}}
    text = render.markdown(report)
    assert "| VAL-002 | MUST | validation | fail (root cause of its own; see below) |" in text
    assert "- VAL-002 is a root cause of its own: it relies on PROV-002, which fails too, but fails on model m4" in text
    assert (
        "Model `m4`, which PROV-002 passes:\n\n```python\n" + code.rstrip("\n") + "\n```\n\n"
        "What it saw there:\n\n```text\nlowered, yet strict validation passed\n```"
    ) in text


# -- what a failure names, and the model it shows ----------------------------------------------
def test_a_failure_names_the_modules_and_nodes_of_its_message():
    message = "forward node 't_2' (aten.t.default) was issued by 'layers.1', but carries provenance 'layers.1.adapter'"
    assert evidence.named_modules(message, ("layers.1", "layers.1.adapter", "layers.10", "layers.0")) == [
        "layers.1", "layers.1.adapter"
    ]
    assert evidence.named_nodes(message + "; backward node 't_21' too, node 't_2' again") == ["t_2", "t_21"]
    spec = ModelSpec(16, (LayerSpec(16, adapter=True, adapter_recipe=None), LayerSpec(32, recipe=None)))
    assert evidence.example_key(spec) == evidence.example_key(ModelSpec(16, spec.layers)) != evidence.example_key(
        ModelSpec(16, spec.layers[:1])
    )
    assert spec.module_fqns() == ("layers.0", "layers.0.adapter", "layers.1")
    assert spec.size() == (3, 16 * 16 * 2 + 16 * 32)


def test_a_reproducer_is_readable_python_one_layer_per_line():
    spec = ModelSpec(
        in_features=16,
        layers=(
            LayerSpec(width=32, recipe="rowwise_with_gw_hp", emulate=True, bias=True),
            LayerSpec(width=48, recipe="rowwise", activation="gelu", adapter=True, adapter_recipe=None),
            LayerSpec(width=48, recipe=None, residual=True, calls=2),
        ),
        input_requires_grad=False,
    )
    code = spec.to_python()
    assert code == (
        "import torch\n"
        "from conformance.draw.models import *\n"
        "\n"
        "spec = ModelSpec(\n"
        "    in_features=16,\n"
        "    layers=(\n"
        "        LayerSpec(width=32, recipe='rowwise_with_gw_hp', emulate=True, bias=True),\n"
        "        LayerSpec(width=48, recipe='rowwise', activation='gelu', adapter=True, adapter_recipe=None),\n"
        "        LayerSpec(width=48, recipe=None, residual=True, calls=2),\n"
        "    ),\n"
        "    input_requires_grad=False,\n"
        ")\n"
        "model, args = build_model(spec)\n"
    )
    namespace: dict = {}
    exec(code, namespace)  # builds the model with TorchAO, as a person pasting it would
    assert namespace["spec"] == spec
    assert type(namespace["model"].layers[1]).__name__ == "AdaptedFloat8Linear"


def test_a_failing_property_shows_the_smallest_model_it_was_seen_failing_on():
    """Under the shared corpus, Hypothesis reports the failing example of lowest index in the
    property's sample: the smallest of those it ran, not the first failing one in the corpus's
    order (varied, large models first)."""
    settings.load_profile("fp8conf-ci")  # derandomized: models from the shared corpus
    sample = _smallest_first(served(Constraints(kinds=ALL_KINDS)), None, settings.default.max_examples)
    assert [spec.size() for spec in sample] == sorted(spec.size() for spec in sample)
    failures = []

    @given(spec=model_specs(kinds=ALL_KINDS))
    def check(spec):
        if len(spec.layers) > 1:
            failures.append(spec)
            raise AssertionError("fails")

    with pytest.raises(AssertionError):
        check()
    # What Hypothesis runs last is the example it reports.
    assert len(set(failures)) > 1 and failures[-1].size() == min(spec.size() for spec in failures)


# -- planted defects, through the suite ------------------------------------------------------------
def run_suite(backend: str, property_ids, tmp_path: Path) -> dict:
    """Run the suite's tests of ``property_ids`` against ``backend`` and read its report back."""
    report = tmp_path / f"{backend.rsplit(':', 1)[-1]}.json"
    selection = " or ".join("test_" + pid.replace("-", "_") + "_" for pid in property_ids)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", f"--fp8-backend={backend}", f"--fp8-report={report}",
         "--hypothesis-profile=fp8conf-ci", "-k", selection, "-q", "-p", "no:cacheprovider", "-p", "no:randomly"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert report.exists(), f"no report from {backend}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(report.read_text())


def test_two_independent_planted_defects_are_two_root_causes(tmp_path):
    report = run_suite("mutants.combined:RecipeAndTensorwiseFastPath", ["PROV-002", "VAL-002"], tmp_path)
    rows = report["properties"]
    assert rows["PROV-002"]["status"] == rows["VAL-002"]["status"] == "fail"
    assert [d["properties"] for d in report["summary"]["defects"]] == [["PROV-002"], ["VAL-002"]]
    assert report["summary"]["root_causes"] == {}
    assert "caused_by" not in rows["VAL-002"]
    assert rows["VAL-002"]["cause"].startswith("root cause of its own: relies on PROV-002, which fails too, but ")
    # Each shows a model failing it: PROV-002 one with a recipe other than tensorwise, VAL-002 one
    # whose modules are all tensorwise.
    assert "recipe='tensorwise'" not in rows["PROV-002"]["reproducer"]["model"]
    assert "recipe='row" not in rows["VAL-002"]["reproducer"]["model"]


def test_one_planted_defect_seen_by_three_properties_is_one_root_cause(tmp_path):
    three = ["PROV-002", "PROV-003", "PROV-004"]
    report = run_suite("mutants.combined:ReusedCallsRenamed", three, tmp_path)
    rows = report["properties"]
    assert {pid: rows[pid]["status"] for pid in three} == dict.fromkeys(three, "fail")
    [defect] = report["summary"]["defects"]
    assert defect["properties"] == three
    # The reused module: a drawn stack's layer called twice, or the siblings family's `shared`.
    assert defect["named"] and all(name.startswith(("module layers.", "module shared")) for name in defect["named"])
    assert set(defect["examples"]) <= set(report["models"])
    for pid in three:
        assert rows[pid]["cause"].startswith("one defect with ")
        model = rows[pid]["reproducer"]["model"]
        # A model with a reused module, printed as code: the siblings family (its `shared` linear
        # is called twice) or a drawn stack with a layer called twice, one layer per line.
        assert "family='siblings'" in model or ("calls=2" in model and "    layers=(\n        LayerSpec(" in model), model
