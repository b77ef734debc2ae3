"""The report model (conformance/plugin/report.py) and its rendering (render.py) on plain data:
no pytester, no pytest run; test reports are stand-ins with the attributes the model reads."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from conformance.api.spec import PROPERTIES
from conformance.plugin import render
from conformance.plugin.report import (
    DEVICE_KEY,
    EXAMPLES_KEY,
    EXPECTATION_KEY,
    PROPERTY_KEY,
    REPRODUCER_KEY,
    TIMEOUT_KEY,
    TestRecord,
    build_report,
    must_summary,
    outcome_status,
    property_row,
    record_outcome,
)


def outcome(nodeid="t.py::test", when="call", result="passed", props=(), reason=None, extra=(), xfail=None):
    report = SimpleNamespace(
        nodeid=nodeid,
        when=when,
        passed=result == "passed",
        failed=result == "failed",
        skipped=result == "skipped",
        longrepr=("t.py", 1, f"Skipped: {reason}") if reason is not None else None,
        user_properties=[(PROPERTY_KEY, pid) for pid in props] + list(extra),
    )
    if xfail is not None:
        report.wasxfail = xfail
    return report


@pytest.mark.parametrize(
    ("kwargs", "status"),
    [
        ({}, "pass"),
        ({"when": "setup"}, None),
        ({"result": "failed"}, "fail"),
        ({"result": "failed", "when": "setup"}, "error"),
        ({"result": "failed", "extra": [(TIMEOUT_KEY, "ran too long")]}, "error"),
        ({"result": "skipped", "reason": "no GPU"}, "skipped"),
        ({"result": "skipped", "reason": "not_supported: backend 'x' does not claim"}, "not_supported"),
        ({"result": "skipped", "reason": "not_in_spec_version: backend 'x' is checked"}, "not_supported"),
        ({"result": "skipped", "xfail": "known bug"}, "xfail"),
        ({"result": "passed", "xfail": "known bug"}, "xpass"),
    ],
)
def test_outcome_status(kwargs, status):
    assert outcome_status(outcome(**kwargs)) == status


def test_record_outcome_keeps_the_strongest_status_and_sums_examples():
    records: dict[str, TestRecord] = {}
    ids = ("PROV-001",)
    assert record_outcome(records, outcome(when="setup", props=ids)) is None
    device = {"device": "cpu", "compute_capability": None}
    seen = record_outcome(
        records, outcome(result="failed", props=ids, extra=[(EXAMPLES_KEY, 7), (DEVICE_KEY, device)])
    )
    assert seen == device
    record_outcome(records, outcome(when="teardown", props=ids, extra=[(EXAMPLES_KEY, 0)]))
    record = records["t.py::test"]
    assert (record.property_ids, record.status, record.examples) == (ids, "fail", 7)


def test_record_outcome_ignores_uncited_tests_but_not_a_crash_report_of_a_cited_one():
    records: dict[str, TestRecord] = {}
    record_outcome(records, outcome(nodeid="t.py::plain"))
    assert records == {}
    record_outcome(records, outcome(when="setup", props=("PROV-001",)))
    # pytest-xdist's report of a crashed worker carries no user_properties.
    record_outcome(records, outcome(result="failed"))
    assert records["t.py::test"].status == "fail"


def test_record_outcome_notes_reason_reproducer_and_expectations():
    records: dict[str, TestRecord] = {}
    found = {"test": "t.py::test", "command": "pytest ..."}
    record_outcome(
        records,
        outcome(
            result="skipped", props=("PROV-001",), reason="not_supported: no",
            extra=[(REPRODUCER_KEY, found), (EXPECTATION_KEY, "PROV-001"), (EXPECTATION_KEY, "PROV-001")],
        ),
    )
    record = records["t.py::test"]
    assert record.reason == "not_supported: no"
    assert record.reproducer == found and record.reproducer is not found
    assert record.expectations == ("PROV-001",)


def _record(status, examples=1, reproducer=None, reason=None, expectations=()):
    return TestRecord(("PROV-001",), status, examples, reproducer, reason, expectations)


def test_property_row_takes_the_strongest_status_and_its_reproducer():
    found = {"test": "t.py::b"}
    row = property_row(
        PROPERTIES["PROV-001"],
        [
            _record("pass", 3), _record("fail", 2, reproducer=found),
            _record("skipped", 0, reason="gpu"), _record(None, 0),
        ],
    )
    assert row["status"] == "fail"
    assert (row["tests"], row["examples"]) == (4, 5)
    # A test without a status never ran to a verdict: not_run, not skipped.
    assert row["outcomes"] == {"fail": 1, "not_run": 1, "pass": 1, "skipped": 1}
    assert row["reproducer"] == found
    assert "reason" not in row
    assert (row["level"], row["capability"]) == ("MUST", "provenance")


def test_property_row_of_a_skipped_property_gives_the_reason_and_expectations():
    expectation = SimpleNamespace(as_json=lambda: {"reason": "bug", "link": None})
    row = property_row(
        PROPERTIES["PROV-001"],
        [_record("skipped", 0, reason="fp8_gpu: CUDA is not available", expectations=("PROV-001",))],
        {"PROV-001": expectation},
    )
    assert row["status"] == "skipped" and row["reproducer"] is None
    assert row["reason"] == "fp8_gpu: CUDA is not available"
    assert row["expectations"] == {"PROV-001": {"reason": "bug", "link": None}}


def test_must_summary_counts_xpass_as_passed_and_xfail_as_applicable():
    rows = {
        "A": {"level": "MUST", "status": "pass"},
        "B": {"level": "MUST", "status": "xpass"},
        "C": {"level": "MUST", "status": "xfail"},
        "D": {"level": "MUST", "status": "error"},
        "E": {"level": "MUST", "status": "not_supported"},
        "F": {"level": "MUST", "status": "skipped"},
        "G": {"level": "SHOULD", "status": "fail"},
    }
    summary = must_summary(rows)
    assert (summary["must_passed"], summary["must_applicable"], summary["must_score"]) == (2, 4, 0.5)
    assert (summary["must_total"], summary["must_skipped"]) == (5, 1)
    assert summary["must_skipped_reasons"] == {"no reason given": ["F"]}
    assert summary["statuses"]["not_supported"] == 1 and sum(summary["statuses"].values()) == 7
    assert must_summary({"E": rows["E"]})["must_score"] is None


def test_must_summary_counts_skipped_must_properties_grouped_by_reason():
    """A MUST property skipped for want of a GPU was not checked: it counts in the total the
    score is read against, with its reason, never silently left out."""
    rows = {
        "NUM-004": {"level": "MUST", "status": "skipped", "reason": "fp8_sm89: CUDA is not available"},
        "MOE-008": {"level": "MUST", "status": "skipped", "reason": "fp8_sm90: CUDA is not available"},
        "MX-009": {"level": "MUST", "status": "skipped",
                   "reason": "fp8_sm100: needs compute capability 10.0, the device has 9.0"},
        "PROV-001": {"level": "MUST", "status": "pass"},
        "PROV-005": {"level": "SHOULD", "status": "skipped", "reason": "fp8_gpu: CUDA is not available"},
    }
    summary = must_summary(rows)
    assert (summary["must_passed"], summary["must_total"], summary["must_skipped"]) == (1, 4, 3)
    assert (summary["must_applicable"], summary["must_score"]) == (1, 1.0)  # as before: over those that ran
    assert summary["must_skipped_reasons"] == {
        "CUDA is not available": ["NUM-004", "MOE-008"],
        "needs compute capability 10.0, the device has 9.0": ["MX-009"],
    }
    report = {"summary": summary, "backend": {"name": "fake", "version": "1.2"}}
    assert render.score_line(report) == (
        "MUST score: 1/4 passed, 3 skipped [CUDA is not available: NUM-004, MOE-008; "
        "needs compute capability 10.0, the device has 9.0: MX-009] (backend fake 1.2)"
    )


def _report(records, capabilities=("provenance",)):
    return build_report(
        records,
        PROPERTIES,
        suite={"name": "fp8conf", "version": "0.1.0"},
        spec_version="1.0",
        checked_spec_version="1.0",
        backend={"name": "fake", "version": "1.2", "spec": "m:Fake", "spec_version": "1.0",
                 "capabilities": list(capabilities)},
        environment={"python": "3.11", "torch": None, "torchao": None, "pytest": "9", "hypothesis": "6",
                     "hypothesis_profile": "fp8conf-ci", "device": "cpu", "compute_capability": None},
        options={"expectations": None, "timeout_s": 300.0},
    )


FAILURE = {
    "test": "t.py::test_b",
    "message": "[PROV-002] MUST: ...",
    "command": "pytest --fp8-backend=m:Fake t.py::test_b",
    "model": "x = 3\n", "failing_case": None, "reproduce_failure": "@reproduce_failure('6', b'AA==')",
}


@pytest.fixture
def report():
    return _report({
        "t.py::test_b": TestRecord(("PROV-002",), "fail", 4, FAILURE),
        "t.py::test_a": TestRecord(("PROV-001", "PROV-002"), "pass", 10),
        "t.py::test_c": TestRecord(("VAL-001",), "not_supported", 0, reason="not_supported: no validation"),
    })


def test_build_report_rows_follow_the_registry_and_list_the_untested(report):
    assert list(report) == [
        "schema_version", "run", "suite", "spec_version", "checked_spec_version", "backend",
        "environment", "options", "summary", "properties", "untested", "models", "built_with", "coverage",
        "coverage_left_out", "coverage_cells",
    ]
    assert list(report["properties"]) == ["PROV-001", "PROV-002", "VAL-001"]
    assert report["properties"]["PROV-002"]["tests"] == 2
    assert report["untested"] == [pid for pid in PROPERTIES if pid not in report["properties"]]
    assert (report["summary"]["must_passed"], report["summary"]["must_applicable"]) == (1, 2)
    assert (report["summary"]["must_total"], report["summary"]["must_skipped"]) == (2, 0)
    json.dumps(report)  # JSON-ready


def test_markdown_has_the_table_the_notes_and_each_failure(report):
    text = render.markdown(report)
    assert "| PROV-002 | MUST | provenance | fail | 2 | 14 |" in text
    # Failures first; not_supported collapses to one row and one note per capability.
    assert text.index("| PROV-002 |") < text.index("| PROV-001 |")
    assert "| VAL-001 | | validation | not_supported | 1 | 0 | no validation |" in text
    assert "**MUST score: 1/2 passed (backend fake 1.2)**" in text
    assert "- not_supported  validation: VAL-001: no validation" in text
    assert "not_supported: not_supported" not in text
    assert "### PROV-002 (fail)" in text and "```python\nx = 3\n```" in text
    assert FAILURE["command"] in text and f"`{FAILURE['reproduce_failure']}`" in text
    assert "Hypothesis profile `fp8conf-ci`" in text
    assert "### PROV-001" not in text


class RecordingTerminal:
    def __init__(self):
        self.lines: list[str] = []

    def write_sep(self, sep, title):
        self.lines.append(f"{sep * 3} {title} {sep * 3}")

    def write_line(self, line):
        self.lines.append(line)


def test_print_summary_lists_rows_score_and_replay(report, tmp_path):
    terminal = RecordingTerminal()
    render.print_summary(terminal, report, tmp_path / "r.json")
    assert terminal.lines[0] == "=== fp8conf conformance ==="
    assert terminal.lines[1].split() == ["property", "level", "capability", "status", "tests", "examples"]
    assert terminal.lines[2].split() == ["PROV-002", "MUST", "provenance", "fail", "2", "14"]
    assert terminal.lines[3].split()[:4] == ["PROV-001", "MUST", "provenance", "pass"]
    assert "not_supported  validation: VAL-001: no validation" in terminal.lines
    assert "MUST score: 1/2 passed (backend fake 1.2)" in terminal.lines
    assert "PROV-002 fail: t.py::test_b" in terminal.lines
    assert f"  replay: {FAILURE['command']}" in terminal.lines
    assert terminal.lines[-1] == f"report: {tmp_path / 'r.json'} and {tmp_path / 'r.md'}"



def test_the_coverage_matrix_shows_each_cell_s_state_for_the_backend():
    """Drawn, not supported (the capability named), structure only (why) and N/A, in the JSON,
    the Markdown and the terminal summary."""
    nvfp4 = ("stacks", "nvfp4_linear", "X", "nvfp4", "convert_nvfp4")
    report = _report({
        "t.py::test_a": TestRecord(("PROV-001",), "pass", 3, built=(nvfp4,)),
        "t.py::test_c": TestRecord(("VAL-001",), "not_supported", 0, reason="not_supported: no validation"),
    }, capabilities=["provenance", "nvfp4"])
    cells = report["coverage_cells"]["NVFP4"]
    assert (cells["PROV"], cells["MOE"]) == ("drawn", "N/A: MOE draws grouped experts only")
    assert cells["VAL"] == "not supported: every VAL property of the run not_supported (capability validation)"
    assert cells["NUM"].startswith("structure only: no CPU kernel") and cells["REG"].startswith("not drawn")
    assert report["coverage_cells"]["MX"]["PROV"] == "not supported: capability mx not claimed"
    text = render.markdown(report)
    assert "| NVFP4 | x | ns | - | - | so | - | - | - | n/a | n/a | n/a | - | n/a |" in text
    assert "- not supported (capability mx not claimed): MX in PROV, VAL, EMU, REG, NUM, BND, FPR, RWR; " in text
    assert "- not supported (every VAL property of the run not_supported (capability validation)): float8 tensorwise in VAL; " in text
    assert "- structure only (no CPU kernel and no Inductor lowering in this torch; " in text
    terminal = RecordingTerminal()
    render.print_summary(terminal, report, None)
    assert ["NVFP4", "x", "ns", "-", "-", "so"] == next(l.split()[:6] for l in terminal.lines if l.strip().startswith("NVFP4"))
    assert any(l.strip().startswith("structure only (no CPU kernel") and l.endswith("NVFP4 in NUM") for l in terminal.lines)

def test_print_summary_without_rows():
    terminal = RecordingTerminal()
    render.print_summary(terminal, _report({}), None)
    assert terminal.lines[1:] == ["no fp8_property test ran", "MUST score: 0/0 passed (backend fake 1.2)"]


def test_markdown_path_and_write_report(report, tmp_path):
    assert render.markdown_path(Path("out/r.json")) == Path("out/r.md")
    assert render.markdown_path(Path("out/r.md")) == Path("out/r.md.md")
    render.write_report(report, tmp_path / "deep" / "r.json")
    assert json.loads((tmp_path / "deep" / "r.json").read_text()) == report
    assert (tmp_path / "deep" / "r.md").read_text() == render.markdown(report)


def _failing(*ids, outcomes=None):
    """Failing tests of ``ids``; ``outcomes`` maps a property to its example outcomes
    (key -> "pass" or "fail")."""
    outcomes = outcomes or {}
    return {
        f"t.py::test_{pid.replace('-', '_')}": TestRecord(
            (pid,), "fail", 1, dict(FAILURE, test=pid),
            example_outcomes={
                key: {"modules": [], "nodes": [], "seen": None, "size": None, "code": None} if seen == "fail" else "pass"
                for key, seen in outcomes.get(pid, {}).items()
            },
        )
        for pid in ids
    }


def test_failures_relying_on_a_failing_property_are_its_consequences():
    outcomes = {
        "PROV-003": {"m1": "fail", "m2": "fail", "m3": "pass"},
        "PROV-001": {"m1": "fail", "m3": "pass"},
        "VAL-001": {"m2": "fail", "m3": "pass"},
        "EMU-002": {"m1": "fail"},
    }
    records = _failing("PROV-001", "PROV-003", "VAL-001", "EMU-002", outcomes=outcomes)
    records["t.py::test_reg"] = TestRecord(("REG-001",), "pass", 3)
    report = _report(records)
    assert report["summary"]["root_causes"] == {"PROV-003": ["PROV-001", "VAL-001", "EMU-002"]}
    rows = report["properties"]
    assert "caused_by" not in rows["PROV-003"] and "caused_by" not in rows["REG-001"]
    assert rows["VAL-001"]["caused_by"] == ["PROV-003"] == rows["PROV-001"]["caused_by"]
    assert rows["VAL-001"]["evidence"] == {
        "failed": {"m2": {"modules": [], "nodes": [], "seen": None}}, "passed": ["m3"]
    }
    assert [pid for pid, _ in render.ordered_rows(report)] == [
        "PROV-003", "PROV-001", "VAL-001", "EMU-002", "REG-001"
    ]


def test_a_failure_with_nothing_failing_upstream_is_its_own_root():
    report = _report(_failing("VAL-001", "FPR-001"))
    assert report["summary"]["root_causes"] == {}
    assert "caused_by" not in report["properties"]["VAL-001"]
    assert render.root_cause_lines(report) == []


def test_terminal_and_markdown_say_which_to_fix_first():
    outcomes = {"PROV-003": {"m1": "fail"}, "VAL-003": {"m1": "fail"}}
    report = _report(_failing("PROV-003", "VAL-003", outcomes=outcomes))
    terminal = RecordingTerminal()
    render.print_summary(terminal, report, None)
    line = "fix PROV-003 first: VAL-003 relies on it and fails on no model it passes"
    assert line in terminal.lines
    assert terminal.lines[1].split()[-1] == "cause"
    assert terminal.lines[2].startswith("PROV-003") and terminal.lines[2].endswith("root cause: fix first")
    assert terminal.lines[3].startswith("VAL-003")
    assert terminal.lines[3].endswith("consequence of PROV-003 (both fail on model m1)")
    text = render.markdown(report)
    assert f"- {line}" in text
    assert "| VAL-003 | MUST | validation | fail (consequence of PROV-003 (both fail on model m1)) |" in text
    assert "A consequence of PROV-003: fix that first." in text
    assert "Evidence: fails with PROV-003 on model m1 and on no model it passes." in text


def test_terminal_shows_skip_reasons():
    report = _report({"t.py::test_n": TestRecord(("NUM-004",), "skipped", 0, reason="fp8_gpu: CUDA is not available")})
    terminal = RecordingTerminal()
    render.print_summary(terminal, report, None)
    assert "NUM-004 skipped: fp8_gpu: CUDA is not available" in terminal.lines


@pytest.mark.parametrize(
    ("shrink", "heading"),
    [("minimal", "Minimal model (runnable):"), ("none", "Failing model, not shrunk (runnable):"),
     ("shrunk", "Failing model, shrunk as many times as --fp8-shrinks allows (runnable):"),
     ("bounded", "Failing model, partly shrunk: shrinking stopped at its time guard (runnable):")],
)
def test_markdown_says_whether_the_model_was_shrunk(shrink, heading):
    records = {"t.py::test_b": TestRecord(("PROV-002",), "fail", 4, dict(FAILURE, shrink=shrink))}
    assert f"{heading}\n\n```python\nx = 3\n```" in render.markdown(_report(records))
