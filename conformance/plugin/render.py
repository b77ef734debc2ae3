"""The report for people: the terminal table at the end of a run and the Markdown file.

Both read the report dict of :func:`conformance.plugin.report.build_report` and nothing else.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator, Protocol

from conformance.plugin.report import ENVIRONMENT_ERROR, FAILED, STATUSES, failing_rows, status_label
from conformance.plugin.report_files import MARKDOWN_TITLE, replace_files

__all__ = [
    "MODEL_HEADINGS",
    "coverage_lines",
    "markdown",
    "markdown_path",
    "ordered_rows",
    "print_summary",
    "root_cause_lines",
    "run_line",
    "score_line",
    "unsupported_lines",
    "write_report",
]

_COLUMNS = (
    ("property", 10), ("level", 7), ("capability", 17), ("status", 14), ("tests", 5),
    ("examples", 9), ("  cause", 0),
)
_RANK = {status: rank for rank, status in enumerate(STATUSES)}
_OWN_PROPERTY = re.compile(r" \(property [A-Z0-9]+-\d+\)")
#: What the shown model of a failure is, by the reproducer's ``shrink``.
MODEL_HEADINGS = {
    "minimal": "Minimal model (runnable)",
    "shrunk": "Failing model, shrunk as many times as --fp8-shrinks allows (runnable)",
    "bounded": "Failing model, partly shrunk: shrinking stopped at its time guard (runnable)",
    "none": "Failing model, not shrunk (runnable)",
}


class Terminal(Protocol):
    """What is used of pytest's ``TerminalReporter``."""

    def write_sep(self, sep: str, title: str) -> None: ...

    def write_line(self, line: str) -> None: ...


def _ended_early(report: dict[str, Any]) -> dict[str, Any] | None:
    """The report's ``run`` when the run did not end complete; None for a complete run and for
    a report written before ``run`` existed."""
    run = report.get("run")
    return run if run and run["ended"] != "complete" else None


def run_line(report: dict[str, Any]) -> str | None:
    """``INTERRUPTED (KeyboardInterrupt: Ctrl-C or SIGINT): no conformance verdict; not
    reached: PROV-002, PROV-003; cut off: t.py::test_PROV_002``; None for a complete run."""
    run = _ended_early(report)
    if run is None:
        return None
    text = f"{run['ended'].upper()}" + (f" ({run['reason']})" if run.get("reason") else "")
    text += ": no conformance verdict"
    if run["not_reached"]:
        text += f"; not reached: {', '.join(run['not_reached'])}"
    if run["cut_off"]:
        text += f"; cut off: {', '.join(run['cut_off'])}"
    return text


def score_line(report: dict[str, Any]) -> str:
    """``MUST score: 45/47 passed, 2 skipped [CUDA is not available: NUM-004, MOE-008]
    (backend ...)``: skipped MUST properties count in the total and are named with their reason.
    A report written before those fields existed reads as passed out of applicable. A run that
    did not end complete has no score: the line says so first."""
    summary, backend = report["summary"], report["backend"]
    total = summary.get("must_total", summary["must_applicable"])
    run = _ended_early(report)
    if run is not None:
        return (
            f"MUST score: none, the run is {run['ended'].upper()}, no conformance verdict "
            f"({summary['must_passed']}/{total} passed before it ended; not reached: "
            f"{', '.join(run['not_reached']) or 'unknown'}) "
            f"(backend {backend['name']} {backend['version']})"
        )
    text = f"MUST score: {summary['must_passed']}/{total} passed"
    reasons = summary.get("must_skipped_reasons") or {}
    if reasons:
        groups = "; ".join(f"{reason}: {', '.join(ids)}" for reason, ids in reasons.items())
        text += f", {summary['must_skipped']} skipped [{groups}]"
    stopped = summary.get("must_environment_errors") or []
    if stopped:
        text += f", {len(stopped)} not checked: error (environment) [{', '.join(stopped)}]"
    return text + f" (backend {backend['name']} {backend['version']})"


def _table_line(cells: tuple) -> str:
    widths = [width for _, width in _COLUMNS]
    text = "".join(f"{cell:<{w}}" for cell, w in zip(cells[:4], widths))
    text += "".join(f"{cell:>{w}}" for cell, w in zip(cells[4:6], widths[4:6]))
    return (text + "".join(f"  {cell}" for cell in cells[6:] if cell)).rstrip()


def ordered_rows(report: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The report's rows, failures first and, among them, root causes before consequences;
    registry order within each status."""
    rows = list(report["properties"].items())
    return sorted(
        rows,
        key=lambda item: (
            _RANK[item[1]["status"]], bool(item[1].get("caused_by")), rows.index(item)
        ),
    )


def _defects(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The report's defects; for a report written before they were listed, one per entry of
    ``root_causes``."""
    summary = report["summary"]
    if "defects" in summary:
        return summary["defects"]
    return [
        {"properties": [root], "consequences": consequences, "examples": [], "named": [], "why": None}
        for root, consequences in summary.get("root_causes", {}).items()
    ]


def _cause(row: dict[str, Any], defects: list[dict[str, Any]], property_id: str) -> str:
    """The table's cause cell: what to fix first and what follows from what."""
    if row.get("caused_by"):
        text = "consequence of " + ", ".join(row["caused_by"])
        shared = row.get("caused_on") or []
        if shared:
            more = f" and {len(shared) - 2} more" if len(shared) > 2 else ""
            text += f" (both fail on model{'s' if len(shared) > 1 else ''} {', '.join(shared[:2])}{more})"
        return text
    defect = next((d for d in defects if property_id in d["properties"]), None)
    if defect is None:
        return ""
    others = [pid for pid in defect["properties"] if pid != property_id]
    if others:
        return "root cause: fix first, one defect with " + ", ".join(others)
    if defect["consequences"]:
        return "root cause: fix first"
    if defect.get("why"):
        return "root cause of its own; see below"
    return ""


def _unsupported(report: dict[str, Any]) -> dict[str, list[tuple[str, dict[str, Any]]]]:
    by_capability: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for property_id, row in report["properties"].items():
        if row["status"] == "not_supported":
            by_capability.setdefault(row["capability"], []).append((property_id, row))
    return by_capability


def _reason(row: dict[str, Any]) -> str:
    """A skip reason without its status prefix and without the property it was written for."""
    reason = (row.get("reason") or "").removeprefix("not_supported:").strip()
    return _OWN_PROPERTY.sub("", reason)


def unsupported_lines(report: dict[str, Any]) -> list[str]:
    """One line per capability whose properties are all or partly ``not_supported``."""
    return [
        f"not_supported  {capability}: {', '.join(pid for pid, _ in rows)}: {_reason(rows[0][1])}"
        for capability, rows in _unsupported(report).items()
    ]


def root_cause_lines(report: dict[str, Any]) -> list[str]:
    """One line per defect with something to say: the properties that see it (and the evidence
    that they see one defect), the failures that follow from it, or why a failure relying on
    another failing property is a root cause of its own."""
    lines = []
    for defect in _defects(report):
        ids, consequences = defect["properties"], defect["consequences"]
        if len(ids) > 1:
            text = f"fix {', '.join(ids)} first: one defect: {defect['why']}"
        elif consequences:
            text = f"fix {ids[0]} first"
        elif defect.get("why"):
            lines.append(f"{ids[0]} is a root cause of its own: it {defect['why']}")
            continue
        else:
            continue
        if consequences:
            one, many = len(consequences) == 1, len(ids) > 1
            text += (
                f"{';' if many else ':'} {', '.join(consequences)} {'relies' if one else 'rely'} on "
                f"{'them' if many else 'it'} and fail{'s' if one else ''} on no model "
                f"{'they pass' if many else 'it passes'}"
            )
        lines.append(text)
    return lines


def _failure_lines(property_id: str, row: dict[str, Any]) -> Iterator[str]:
    found = row.get("reproducer")
    if row["status"] in FAILED and found:
        yield f"{property_id} {row['status']}: {found['test']}"
        yield f"  replay: {found['command']}"
    elif row["status"] == "xpass":
        yield f"{property_id} xpass: expected to fail, passed; drop its expectations entry"
    elif row["status"] == "skipped":
        yield f"{property_id} skipped: {row.get('reason') or 'no reason given'}"
    elif row["status"] == ENVIRONMENT_ERROR:
        yield f"{property_id} {status_label(ENVIRONMENT_ERROR)}, not a failure of the backend: {row.get('reason')}"


def print_summary(terminal: Terminal, report: dict[str, Any], report_path: Path | None) -> None:
    """How the run ended when it did not end complete, the per-property table (failures first,
    ``not_supported`` one line per capability), the root causes, the MUST score, what replays
    each failure, skip reasons and stale expectations."""
    terminal.write_sep("=", "fp8conf conformance")
    ended_early = run_line(report)
    if ended_early:
        terminal.write_line(ended_early)
    defects = _defects(report)
    rows = [item for item in ordered_rows(report) if item[1]["status"] != "not_supported"]
    if report["properties"]:
        cells_of = {pid: _cause(row, defects, pid) for pid, row in rows}
        header = tuple(name.strip() for name, _ in _COLUMNS)
        terminal.write_line(_table_line(header if any(cells_of.values()) else header[:-1]))
        for property_id, row in rows:
            cells = (
                property_id, row["level"], row["capability"], status_label(row["status"]), row["tests"],
                row["examples"], cells_of[property_id],
            )
            terminal.write_line(_table_line(cells))
        for line in unsupported_lines(report):
            terminal.write_line(line)
        for line in built_with_lines(report):
            terminal.write_line(f"built  {line}")
        for line in coverage_lines(report):
            terminal.write_line(line)
    else:
        terminal.write_line("no fp8_property test ran")
    for line in root_cause_lines(report):
        terminal.write_line(line)
    terminal.write_line(score_line(report))
    for property_id, row in rows:
        for line in _failure_lines(property_id, row):
            terminal.write_line(line)
    if report_path is not None:
        terminal.write_line(f"report: {report_path} and {markdown_path(report_path)}")


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _header(report: dict[str, Any]) -> list[str]:
    backend, env, suite = report["backend"], report["environment"], report["suite"]
    capability = env["compute_capability"]
    options = report.get("options", {})
    expectations = options.get("expectations")
    ended_early = run_line(report)
    return [
        MARKDOWN_TITLE,
        "",
        *([f"**{ended_early}.** The rows of the tests it did not reach say `not_run`; rerun "
           "the suite for a verdict.", ""] if ended_early else []),
        f"- Backend: `{backend['name']}` {backend['version']} (`{backend['spec']}`), "
        f"checked against spec {report['checked_spec_version']}",
        f"- Capabilities: {', '.join(backend['capabilities']) or 'none'}",
        f"- Suite: {suite['name']} {suite['version']}, spec {report['spec_version']}, "
        f"report schema {report['schema_version']}",
        f"- Environment: Python {env['python']}; torch {env['torch']}; torchao {env['torchao']}; "
        f"device {env['device']}"
        + (f" (compute capability {capability})" if capability else ""),
        f"- Hypothesis profile `{env['hypothesis_profile']}`; expectations: "
        f"{'`' + expectations + '`' if expectations else 'none'}",
        "",
    ]


def _notes(report: dict[str, Any]) -> list[str]:
    notes = [f"- {line}" for line in root_cause_lines(report)]
    for property_id, row in ordered_rows(report):
        for key, entry in row.get("expectations", {}).items():
            link = f" ({entry['link']})" if entry.get("link") else ""
            notes.append(
                f"- {property_id} {row['status']}: expected to fail ({key}): {entry['reason']}{link}"
            )
        if row.get("reason") and row["status"] != "not_supported":
            notes.append(f"- {property_id} {status_label(row['status'])}: {row['reason']}")
        notes.extend(f"- {property_id} {row['status']}: {text}" for text in row.get("notes", ()))
    notes += [f"- {line}" for line in unsupported_lines(report)]
    return ["## Notes", "", *notes, ""] if notes else []


def _own_model(row: dict[str, Any], defect: dict[str, Any] | None, models: dict[str, Any]) -> list[str]:
    """For a root cause of its own, the first model it failed on that a property it relies on
    passed, with what it saw there: the evidence, to read beside the reproducer, which may be a
    model both fail on."""
    contrary = (defect or {}).get("contrary") or {}
    failed = row.get("evidence", {}).get("failed", {})
    key = next((keys[0] for keys in contrary.values() if keys and keys[0] in failed), None)
    if key is None:
        return []
    passing = [pid for pid, keys in contrary.items() if key in keys]
    lines = [f"Model `{key}`, which {', '.join(passing)} {'passes' if len(passing) == 1 else 'pass'}:", ""]
    if key in models:
        lines += ["```python", models[key]["code"].rstrip("\n"), "```", ""]
    if failed[key].get("seen"):
        lines += ["What it saw there:", "", "```text", failed[key]["seen"], "```", ""]
    return lines


def _failure(
    property_id: str, row: dict[str, Any], defect: dict[str, Any] | None, models: dict[str, Any]
) -> list[str]:
    found = row["reproducer"]
    lines = [
        f"### {property_id} ({row['status']})", "",
        f"Test `{found['test']}`:", "",
        "```text", found["message"], "```", "",
        "Replay:", "",
        "```bash", found["command"], "```", "",
    ]
    if row.get("caused_by"):
        lines[1:1] = ["", f"A consequence of {', '.join(row['caused_by'])}: fix that first."]
        if row.get("cause"):
            lines[3:3] = [f"Evidence: {row['cause'].split(': ', 1)[-1]}."]
    elif row.get("cause"):
        lines[1:1] = ["", row["cause"][0].upper() + row["cause"][1:] + "."]
    if found.get("model"):
        heading = MODEL_HEADINGS.get(found.get("shrink"), MODEL_HEADINGS["minimal"])
        lines += [f"{heading}:", "", "```python", found["model"].rstrip("\n"), "```", ""]
    elif found.get("failing_case"):
        lines += ["Failing test case:", "", "```python", found["failing_case"], "```", ""]
    if found.get("reproduce_failure"):
        lines += [f"Or decorate the test with `{found['reproduce_failure']}`.", ""]
    return lines + _own_model(row, defect, models)


def built_with_lines(report: dict[str, Any]) -> list[str]:
    """One line per family, kind and module class the run's models were built with."""
    return [
        f"{entry['family']}: {entry['kind']} as {entry['module']} (built by {entry['built_by'] or 'the suite'}; "
        f"recipes {', '.join(map(str, entry['recipes']))})"
        for entry in report.get("built_with", ())
    ]


def _built_with(report: dict[str, Any]) -> list[str]:
    entries = report.get("built_with", ())
    if not entries:
        return []
    lines = ["## Models built", "", "| Family | Kind | Module | Built by | Recipes | Properties |", "|---|---|---|---|---|---|"]
    for e in entries:
        lines.append(
            f"| {e['family']} | {e['kind']} | `{e['module']}` | {e['built_by'] or 'the suite'} "
            f"| {', '.join(map(str, e['recipes']))} | {_cell(', '.join(e['properties']))} |"
        )
    return lines + [""]


#: How a cell of the coverage matrix is printed, by its state (``conformance.report.coverage.cells``).
_COVERAGE_MARKS = {"drawn": "x", "not supported": "ns", "structure only": "so", "N/A": "n/a", "not drawn": "-"}


def _coverage_marks(report: dict[str, Any]) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """The run's coverage matrix as ``(family, a mark per area)`` rows, and a line for each cell
    not supported or structure only: which capability, or why."""
    cells = report.get("coverage_cells") or {}
    rows, why = [], {}
    for family, states in cells.items():
        marks = []
        for area, state in states.items():
            name, _, reason = state.partition(": ")
            marks.append(_COVERAGE_MARKS.get(name, "?"))
            if name in ("not supported", "structure only"):
                why.setdefault((name, reason), {}).setdefault(family, []).append(area)
        rows.append((family, marks))
    lines = [
        f"{name} ({reason}): " + "; ".join(f"{family} in {', '.join(areas)}" for family, areas in where.items())
        for (name, reason), where in why.items()
    ]
    return rows, lines


def coverage_lines(report: dict[str, Any]) -> list[str]:
    """The coverage matrix for the terminal: a line per family, a mark per area, then why each
    cell is not supported or structure only."""
    rows, why = _coverage_marks(report)
    if not rows:
        return []
    areas = list(next(iter(report["coverage_cells"].values())))
    width = max(len(family) for family, _ in rows) + 2
    lines = ["coverage (x drawn, ns not supported, so structure only, n/a, - not drawn in this run)",
             f"  {'':<{width}}" + "".join(f"{a:<6}" for a in areas)]
    lines += [f"  {family:<{width}}" + "".join(f"{m:<6}" for m in marks) for family, marks in rows]
    return [line.rstrip() for line in lines] + [f"  {line}" for line in why]


def _coverage(report: dict[str, Any]) -> list[str]:
    """The coverage matrix of the run for the backend under test: per module family and area,
    drawn (``x``), not supported (``ns``: the backend does not claim the capability the family
    or the area needs), structure only (``so``: drawn elsewhere, its numerics here not run on
    this torch and device), never drawn (``n/a``, SPEC's *Coverage* says why), or not drawn in
    this run (``-``: its properties not selected, or the run ended first)."""
    rows, why = _coverage_marks(report)
    if not rows:
        return []
    areas = list(next(iter(report["coverage_cells"].values())))
    lines = ["## Coverage (module families by area)", "", "| Family | " + " | ".join(areas) + " |", "|---|" + "---|" * len(areas)]
    lines += [f"| {family} | " + " | ".join(marks) + " |" for family, marks in rows]
    lines.append("")
    legend = "x: drawn; ns: not supported; so: structure only; n/a: never drawn (SPEC's Coverage says why); -: not drawn in this run."
    return lines + [legend, ""] + [f"- {_cell(line)}" for line in why] + ([""] if why else [])


def markdown(report: dict[str, Any]) -> str:
    """The report as a Markdown page: header, table, score, notes, then each failure."""
    lines = _header(report) + [
        "| Property | Level | Capability | Status | Tests | Examples | Title |",
        "|---|---|---|---|---:|---:|---|",
    ]
    defects = _defects(report)
    for property_id, row in ordered_rows(report):
        if row["status"] == "not_supported":
            continue
        status = status_label(row["status"])
        cause = _cause(row, defects, property_id)
        status += f" ({cause})" if cause else ""
        lines.append(
            f"| {property_id} | {row['level']} | {row['capability']} | {status} "
            f"| {row['tests']} | {row['examples']} | {_cell(row['title'])} |"
        )
    for capability, rows in _unsupported(report).items():
        ids = ", ".join(pid for pid, _ in rows)
        lines.append(
            f"| {ids} | | {capability} | not_supported | {sum(r['tests'] for _, r in rows)} "
            f"| 0 | {_cell(_reason(rows[0][1]))} |"
        )
    lines += ["", f"**{score_line(report)}**", ""]
    lines += _built_with(report)
    lines += _coverage(report)
    lines += _notes(report)
    order = [pid for pid, _ in ordered_rows(report)]
    failures = sorted(failing_rows(report), key=lambda item: order.index(item[0]))
    if failures:
        lines += ["## Failures", ""]
    for property_id, row in failures:
        defect = next((d for d in defects if property_id in d["properties"]), None)
        lines += _failure(property_id, row, defect, report.get("models", {}))
    return "\n".join(lines)


def markdown_path(path: Path) -> Path:
    """Where the Markdown of the JSON report at ``path`` goes: beside it, suffix ``.md``."""
    markdown_file = path.with_suffix(".md")
    # For PATH ending in .md, keep the JSON rather than overwrite it.
    return path.with_name(path.name + ".md") if markdown_file == path else markdown_file


def write_report(report: dict[str, Any], path: Path) -> None:
    """Write ``report`` as JSON at ``path`` and as Markdown at :func:`markdown_path`, each
    whole or not at all (:func:`~conformance.plugin.report_files.replace_files`; raises its
    ``ReportWriteError``)."""
    replace_files({
        path: json.dumps(report, indent=2) + "\n",
        markdown_path(path): markdown(report),
    })
