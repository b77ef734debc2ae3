"""The report model: from the outcome of each test to per-property statuses and the MUST score.

Outcomes arrive as pytest test reports (``pytest_runtest_logreport``, which pytest-xdist
forwards from its workers); everything a report needs beyond its outcome (property IDs, example
counts, reproducers, the device) travels in ``report.user_properties`` under the keys below, so
the result is the same with and without ``-n``. :func:`record_outcome` folds one test report
into a :class:`TestRecord`; :func:`build_report` turns the records into the JSON-ready report,
its root causes decided by :mod:`~conformance.plugin.causes` from what each property did on each
example. Neither touches pytest's or Hypothesis's state: they work on plain data.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from typing import Any, Mapping

from conformance.report import coverage
from conformance.plugin.causes import FAILED, decide
from conformance.run.gating import GPU_MARKERS, NOT_IN_SPEC, NOT_SUPPORTED

__all__ = [
    "ENDINGS",
    "ENVIRONMENT_ERROR",
    "NOT_RUN",
    "PROPERTY_KEY",
    "REPORT_SCHEMA_VERSION",
    "built_with",
    "STATUSES",
    "RunEnding",
    "TestRecord",
    "build_report",
    "failing_rows",
    "must_summary",
    "property_row",
    "outcome_status",
    "record_outcome",
    "status_label",
    "unreached_tests",
]

#: Statuses of a test and of a property, strongest first: a property takes the strongest
#: status among its tests, so one failure fails it and a skipped GPU variant does not hide
#: the passing CPU ones. ``xfail`` and ``xpass`` come from ``--fp8-expectations``; a property
#: is ``xpass`` only when none of its expected failures still fails. ``not_run``: a test the run
#: selected and ended before (cut off, or never started); it outranks every status that could
#: read as a verdict on the property. ``environment_error``: the machine, not the backend, stopped
#: the test (its gloo ranks could not connect; :class:`conformance.run.environment.EnvironmentProblem`):
#: no verdict either, printed ``error (environment)`` and counted apart from the backend's
#: failures, never in the MUST score.
STATUSES = ("fail", "error", "environment_error", "not_run", "xfail", "xpass", "pass", "not_supported", "skipped")
NOT_RUN = "not_run"
ENVIRONMENT_ERROR = "environment_error"
_RANK = {status: rank for rank, status in enumerate(STATUSES)}
#: How a status is printed where it differs from its JSON name.
_LABELS = {ENVIRONMENT_ERROR: "error (environment)"}
#: Version of the report's JSON layout: bumped when a field changes meaning or goes away.
#: 2: ``run`` (how the run ended), status ``not_run``, and ``must_score`` null for a run that
#: did not end complete. 3: status ``environment_error`` and ``summary.must_environment_errors``.
REPORT_SCHEMA_VERSION = 3
#: How a run ended (the report's ``run.ended``): every selected test ran to a verdict; a
#: KeyboardInterrupt (Ctrl-C, SIGINT, on the controller or an xdist worker) or ``pytest.exit``
#: ended it; or it ended otherwise before every selected test ran (``-x``, ``--maxfail``,
#: collection errors, an internal error, ``--collect-only``).
ENDINGS = ("complete", "interrupted", "incomplete")

_GPU_MARKER_PREFIX = re.compile(rf"^(?:{'|'.join(map(re.escape, GPU_MARKERS))}): ")

#: Key of the ``user_properties`` entries that carry a test's property IDs.
PROPERTY_KEY = "fp8_property"
# Keys of further ``user_properties`` entries, added where the test ran (an xdist worker too).
EXAMPLES_KEY = "fp8_examples"
EXAMPLE_OUTCOMES_KEY = "fp8_example_outcomes"
REPRODUCER_KEY = "fp8_reproducer"
TIMEOUT_KEY = "fp8_timeout"
EXPECTATION_KEY = "fp8_expectation"
DEVICE_KEY = "fp8_device"
NOTE_KEY = "fp8_note"
BUILT_KEY = "fp8_built"
#: ``[kind, reason]``: a kind the test left out of its models (``conformance.observe.evidence.left_out``).
LEFT_OUT_KEY = "fp8_left_out"
#: What stopped a test that the machine, not the backend, failed (``environment_error``).
ENVIRONMENT_KEY = "fp8_environment"
#: Added by the controller to xdist's report of a test whose worker was interrupted: the test
#: was cut off, not crashed.
CUT_OFF_KEY = "fp8_cut_off"


@dataclasses.dataclass
class TestRecord:
    """What is known of one test (one node ID) across its setup, call and teardown reports."""

    __test__ = False  # not a pytest test class, despite the name

    property_ids: tuple[str, ...]
    status: str | None = None
    examples: int = 0
    reproducer: dict[str, Any] | None = None
    reason: str | None = None
    expectations: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    #: ``(family, kind, module class, recipe, built by)`` of the quantized modules its models had.
    built: tuple[tuple[str, ...], ...] = ()
    #: ``(kind, reason)`` of the kinds its models left out: the device cannot run them.
    left_out: tuple[tuple[str, str], ...] = ()
    #: Example key -> ``"pass"``, or for a failing example what the failure named:
    #: ``{"modules", "nodes", "seen", "size", "code"}`` (``conformance.observe.evidence``).
    example_outcomes: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class RunEnding:
    """How a run ended, as its controller saw it when the session finished."""

    #: One of :data:`ENDINGS`.
    ended: str = "complete"
    #: What ended it early ("KeyboardInterrupt: Ctrl-C or SIGINT", "stopping after 1
    #: failures"); None for a complete run.
    reason: str | None = None
    #: Node ID -> property IDs of each test selected to run, in the order of the run; None where
    #: the run does not know them (its collection did not finish).
    selected: Mapping[str, tuple[str, ...]] | None = None
    #: Node IDs of the tests that started.
    started: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.ended not in ENDINGS:
            raise ValueError(f"RunEnding.ended must be one of {ENDINGS}, got {self.ended!r}")

    @property
    def complete(self) -> bool:
        return self.ended == "complete"


def skip_reason(report: Any) -> str:
    """The reason of a skipped test report, without pytest's ``Skipped: `` prefix."""
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
    return reason.removeprefix("Skipped: ")


def status_label(status: str) -> str:
    """How ``status`` is printed: ``environment_error`` as ``error (environment)``, the others as
    they are."""
    return _LABELS.get(status, status)


def outcome_status(report: Any) -> str | None:
    """This phase's contribution to the test's status; None for a passing setup/teardown.

    A failure outside the call phase, a timeout (``--fp8-timeout``) and a test that crashed its
    xdist worker are ``error``; a test the machine stopped is ``environment_error``, also under
    an expectation; an expected failure is ``xfail`` and a pass under an expectation ``xpass``.
    """
    if any(key == CUT_OFF_KEY for key, _ in report.user_properties):
        return NOT_RUN
    if any(key == ENVIRONMENT_KEY for key, _ in report.user_properties):
        return ENVIRONMENT_ERROR
    if hasattr(report, "wasxfail"):
        if report.skipped:
            return "xfail"
        if report.passed:
            return "xpass"
    if report.failed:
        timed_out = any(key == TIMEOUT_KEY for key, _ in report.user_properties)
        return "fail" if report.when == "call" and not timed_out else "error"
    if report.skipped:
        reason = skip_reason(report)
        return "not_supported" if reason.startswith((NOT_SUPPORTED, NOT_IN_SPEC)) else "skipped"
    return "pass" if report.when == "call" else None


def record_outcome(records: dict[str, TestRecord], report: Any) -> dict[str, Any] | None:
    """Fold one test report into ``records`` (keyed by node ID); return the device information
    the report carries, if any. Reports of tests that cite no property are ignored."""
    ids = tuple(value for key, value in report.user_properties if key == PROPERTY_KEY)
    record = records.get(report.nodeid)
    if record is None:
        if not ids:
            return None
        record = records[report.nodeid] = TestRecord(ids)
    # else: also a report without user_properties, as pytest-xdist makes for a test that
    # crashed its worker: the test's earlier setup report told its properties.
    device = None
    for key, value in report.user_properties:
        if key == EXAMPLES_KEY:
            record.examples += int(value)
        elif key == REPRODUCER_KEY and record.reproducer is None:
            record.reproducer = dict(value)
        elif key == EXAMPLE_OUTCOMES_KEY:
            _merge_outcomes(record.example_outcomes, value)
        elif key == EXPECTATION_KEY and value not in record.expectations:
            record.expectations += (value,)
        elif key == NOTE_KEY and value not in record.notes:
            record.notes += (value,)
        elif key == BUILT_KEY and tuple(value) not in record.built:
            record.built += (tuple(value),)
        elif key == LEFT_OUT_KEY and tuple(value) not in record.left_out:
            record.left_out += (tuple(value),)
        elif key == DEVICE_KEY and device is None:
            device = dict(value)
        elif key == ENVIRONMENT_KEY:
            record.reason = str(value)
    status = outcome_status(report)
    if status is not None:
        if status in ("not_supported", "skipped") and record.reason is None:
            record.reason = skip_reason(report) or None
        if record.status is None or _RANK[status] < _RANK[record.status]:
            record.status = status
    return device


def _merge_outcomes(into: dict[str, Any], outcomes: Mapping[str, Any]) -> None:
    """Add ``outcomes`` (example key -> outcome) to ``into``: a failure wins over a pass."""
    for key, outcome in outcomes.items():
        if isinstance(outcome, Mapping):
            if not isinstance(into.get(key), Mapping):
                into[key] = dict(outcome)
        else:
            into.setdefault(key, outcome)


def _evidence(records: list[TestRecord]) -> dict[str, Any]:
    """The examples a property failed (each with the modules and nodes its failure named, and
    what was seen) and those it passed, over all its tests."""
    outcomes: dict[str, Any] = {}
    for record in records:
        _merge_outcomes(outcomes, record.example_outcomes)
    failed = {
        key: {"modules": value["modules"], "nodes": value["nodes"], "seen": value["seen"]}
        for key, value in sorted(outcomes.items()) if isinstance(value, Mapping)
    }
    return {"failed": failed, "passed": sorted(key for key in outcomes if key not in failed)}


def _smallest(reproducers: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The reproducer whose model is smallest (fewest linears, then parameters); the first one
    among equals and where sizes are unknown."""
    if not reproducers:
        return None
    return min(reproducers, key=lambda found: tuple(found.get("size") or (float("inf"),)))


def property_row(
    prop: Any, records: list[TestRecord], expectations: Mapping[str, Any] = {}
) -> dict[str, Any]:
    """The report row of ``prop`` (a :class:`conformance.api.spec.Property`) from its tests.

    ``expectations`` maps expectation keys to entries with ``as_json()``. A failing row carries
    ``evidence``: the examples the property failed and passed, by key. A test without a status
    never ran to a verdict (the run ended while it ran): it is ``not_run``.
    """
    statuses = [record.status or NOT_RUN for record in records]
    status = min(statuses, key=_RANK.__getitem__)
    deciding = [record for record in records if (record.status or NOT_RUN) == status]
    row: dict[str, Any] = {
        "level": prop.level,
        "capability": prop.capability,
        "since": prop.since,
        "title": prop.title,
        "status": status,
        "tests": len(records),
        "examples": sum(record.examples for record in records),
        "outcomes": dict(sorted(Counter(statuses).items())),
        "reproducer": None,
    }
    if status in ("fail", "error", "xfail"):
        row["reproducer"] = _smallest([r.reproducer for r in deciding if r.reproducer])
    if status in FAILED:
        row["evidence"] = _evidence(records)
    if status in ("not_supported", "skipped", ENVIRONMENT_ERROR):
        row["reason"] = next((r.reason for r in deciding if r.reason), None)
    notes = sorted({text for record in records for text in record.notes})
    if notes:
        row["notes"] = notes
    keys = sorted({key for record in records for key in record.expectations})
    if keys:
        row["expectations"] = {key: expectations[key].as_json() for key in keys if key in expectations}
    return row


def _grouping_reason(row: Mapping[str, Any]) -> str:
    """A skipped row's reason without the GPU marker that gave it, so that properties skipped
    for one cause (no CUDA device) group together whichever compute capability they need."""
    reason = row.get("reason") or "no reason given"
    return _GPU_MARKER_PREFIX.sub("", reason)


def must_summary(rows: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """MUST properties passed out of those checked or skipped, the skipped ones grouped by
    reason, those the machine stopped, and the count of each status.

    A skipped MUST property (a GPU test on a machine without one) was not checked: it counts in
    ``must_total``, the number the score is read against, so "45/47 passed, 2 skipped" never
    reads as a full score. So does one the machine stopped (``environment_error``, listed in
    ``must_environment_errors``): it is no failure of the backend, and no pass either.
    ``must_applicable`` keeps its first meaning, the properties that ran to a verdict;
    ``must_score`` is the share of them that passed, or None where the machine stopped one: a
    score over what remained would read as a pass of what was never checked.
    """
    # An expected failure is applicable and not passed; an xpass passed all its tests.
    must = [(pid, row) for pid, row in rows.items() if row["level"] == "MUST"]
    unchecked = ("not_supported", "skipped", ENVIRONMENT_ERROR)
    applicable = [row for _, row in must if row["status"] not in unchecked]
    skipped = [(pid, row) for pid, row in must if row["status"] == "skipped"]
    stopped = [pid for pid, row in must if row["status"] == ENVIRONMENT_ERROR]
    passed = sum(row["status"] in ("pass", "xpass") for row in applicable)
    reasons: dict[str, list[str]] = {}
    for property_id, row in skipped:
        reasons.setdefault(_grouping_reason(row), []).append(property_id)
    return {
        "must_passed": passed,
        "must_applicable": len(applicable),
        "must_score": passed / len(applicable) if applicable and not stopped else None,
        "must_skipped": len(skipped),
        "must_total": len(applicable) + len(skipped) + len(stopped),
        "must_skipped_reasons": reasons,
        "must_environment_errors": stopped,
        "statuses": dict(Counter(row["status"] for row in rows.values())),
    }


def unreached_tests(
    records: Mapping[str, TestRecord], selected: Mapping[str, tuple[str, ...]] | None
) -> list[str]:
    """Node IDs of the tests that did not run to a verdict: those of ``selected`` (see
    :class:`RunEnding`) that no report gave a status, in the order of the run, then any other
    recorded test without one."""
    chosen = selected or {}
    missing = [nodeid for nodeid in chosen if _without_verdict(records.get(nodeid))]
    return missing + [
        nodeid for nodeid, record in records.items() if nodeid not in chosen and _without_verdict(record)
    ]


def _without_verdict(record: TestRecord | None) -> bool:
    return record is None or record.status in (None, NOT_RUN)


def _with_tests_not_run(
    records: Mapping[str, TestRecord], run: RunEnding, not_run: list[str]
) -> dict[str, TestRecord]:
    """``records`` with each test of ``not_run`` as ``not_run``, also those never started."""
    selected = run.selected or {}
    every = dict(records)
    for nodeid in not_run:
        found = every.get(nodeid)
        every[nodeid] = (
            TestRecord(tuple(selected[nodeid]), NOT_RUN) if found is None
            else dataclasses.replace(found, status=NOT_RUN)
        )
    return every


def _run_field(
    run: RunEnding, not_run: list[str], records: Mapping[str, TestRecord], properties: Mapping[str, Any]
) -> dict[str, Any]:
    """The report's ``run``: how the run ended, why, and what it did not reach."""
    cited = {pid for nodeid in not_run for pid in records[nodeid].property_ids}
    return {
        "ended": run.ended,
        "reason": run.reason,
        "not_reached": [pid for pid in properties if pid in cited],
        "tests_not_run": not_run,
        "cut_off": [nodeid for nodeid in not_run if nodeid in run.started],
    }


def build_report(
    records: Mapping[str, TestRecord],
    properties: Mapping[str, Any],
    *,
    suite: dict[str, Any],
    spec_version: str,
    checked_spec_version: str,
    backend: dict[str, Any],
    environment: dict[str, Any],
    options: dict[str, Any],
    expectations: Mapping[str, Any] = {},
    run: RunEnding = RunEnding(),
) -> dict[str, Any]:
    """The report of a run: how it ended, its header fields as given, then the MUST summary,
    one row per property of ``properties`` (the spec registry) that a test cites, and the
    untested ones.

    A test of ``run.selected`` that did not run to a verdict is ``not_run`` in its properties'
    rows; a run that did not end complete has no MUST score (``must_score`` None), whatever
    its rows say, so that a run cut short never reads as a pass.
    """
    not_run = unreached_tests(records, run.selected)
    records = _with_tests_not_run(records, run, not_run)
    by_property: dict[str, list[TestRecord]] = {}
    for _, record in sorted(records.items()):
        for property_id in record.property_ids:
            by_property.setdefault(property_id, []).append(record)
    rows = {
        property_id: property_row(prop, by_property[property_id], expectations)
        for property_id, prop in properties.items()
        if property_id in by_property
    }
    verdict = decide(rows, properties)
    for property_id, roots in verdict.caused_by.items():
        rows[property_id]["caused_by"] = roots
        rows[property_id]["caused_on"] = verdict.caused_on[property_id]
    for property_id, text in verdict.causes.items():
        rows[property_id]["cause"] = text
    summary = must_summary(rows)
    if not run.complete:
        summary["must_score"] = None
    summary["root_causes"] = verdict.root_causes()
    summary["defects"] = [defect.as_json() for defect in verdict.defects]
    seen = coverage.observed((record.property_ids, record.built) for record in records.values())
    left = coverage.left_out((record.property_ids, record.left_out) for record in records.values())
    return {
        "schema_version": REPORT_SCHEMA_VERSION,
        "run": _run_field(run, not_run, records, properties),
        "suite": suite,
        "spec_version": spec_version,
        "checked_spec_version": checked_spec_version,
        "backend": backend,
        "environment": environment,
        "options": options,
        "summary": summary,
        "properties": rows,
        "untested": [pid for pid in properties if pid not in rows],
        "models": _failing_models(records, rows),
        "built_with": built_with(records),
        # Row (module family) -> the areas whose properties built it (conformance.report.coverage).
        "coverage": seen,
        # Row -> area -> why the area's properties drew none of the row: the device cannot run it.
        "coverage_left_out": left,
        # Row -> area -> the cell's state for this backend: drawn, not supported, structure only, N/A.
        "coverage_cells": coverage.cells(seen, backend.get("capabilities", ()), rows, backend, left),
    }


def built_with(records: Mapping[str, TestRecord]) -> list[dict[str, Any]]:
    """What the quantized modules of the run's models were, per family and kind: the module
    classes seen on the built models, their recipes and whose conversion built them (the
    backend's ``convert_*`` or TorchAO), and the properties that built them."""
    groups: dict[tuple[str, str, str, str], dict[str, set]] = {}
    for record in records.values():
        for family, kind, module, recipe, by in record.built:
            group = groups.setdefault((family, kind, module, by), {"recipes": set(), "properties": set()})
            group["recipes"].add(recipe)
            group["properties"].update(record.property_ids)
    return [
        {"family": family, "kind": kind, "module": module, "built_by": by,
         "recipes": sorted(g["recipes"]), "properties": sorted(g["properties"])}
        for (family, kind, module, by), g in sorted(groups.items())
    ]


def _failing_models(records: Mapping[str, TestRecord], rows: Mapping[str, Any]) -> dict[str, Any]:
    """Example key -> ``{"size", "code"}`` of every model a failing row failed on, whose code
    was carried: what the evidence of a root cause points at."""
    wanted = {key for row in rows.values() for key in row.get("evidence", {}).get("failed", ())}
    models: dict[str, Any] = {}
    for _, record in sorted(records.items()):
        for key, outcome in record.example_outcomes.items():
            if key in wanted and isinstance(outcome, Mapping) and outcome.get("code") and key not in models:
                models[key] = {"size": outcome.get("size"), "code": outcome["code"]}
    return dict(sorted(models.items()))


def failing_rows(report: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The rows of ``report`` that carry a reproducer, in report order."""
    return [(pid, row) for pid, row in report["properties"].items() if row.get("reproducer")]
