"""The report for people: the terminal table at the end of a run and the Markdown file.

Both read the report dict of :func:`conformance.plugin.report.build_report` and nothing else.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from conformance.plugin.report import failing_rows

__all__ = ["markdown", "markdown_path", "print_summary", "score_line", "write_report"]

_COLUMNS = (
    ("property", 10), ("level", 7), ("capability", 17), ("status", 14), ("tests", 5), ("examples", 9)
)


class Terminal(Protocol):
    """What is used of pytest's ``TerminalReporter``."""

    def write_sep(self, sep: str, title: str) -> None: ...

    def write_line(self, line: str) -> None: ...


def score_line(report: dict[str, Any]) -> str:
    summary, backend = report["summary"], report["backend"]
    return (
        f"MUST score: {summary['must_passed']}/{summary['must_applicable']} "
        f"(backend {backend['name']} {backend['version']})"
    )


def _table_line(cells: tuple) -> str:
    widths = [width for _, width in _COLUMNS]
    text = "".join(f"{cell:<{w}}" for cell, w in zip(cells[:4], widths))
    return text + "".join(f"{cell:>{w}}" for cell, w in zip(cells[4:], widths[4:]))


def print_summary(terminal: Terminal, report: dict[str, Any], report_path: Path | None) -> None:
    """The per-property table, the MUST score, what replays each failure, and stale
    expectations."""
    terminal.write_sep("=", "fp8conf conformance")
    rows = report["properties"]
    if rows:
        terminal.write_line(_table_line(tuple(name for name, _ in _COLUMNS)))
        for property_id, row in rows.items():
            cells = (
                property_id, row["level"], row["capability"], row["status"], row["tests"],
                row["examples"],
            )
            terminal.write_line(_table_line(cells))
    else:
        terminal.write_line("no fp8_property test ran")
    terminal.write_line(score_line(report))
    for property_id, row in rows.items():
        found = row.get("reproducer")
        if row["status"] in ("fail", "error") and found:
            terminal.write_line(f"{property_id} {row['status']}: {found['test']}")
            terminal.write_line(f"  replay: {found['command']}")
        elif row["status"] == "xpass":
            terminal.write_line(
                f"{property_id} xpass: expected to fail, passed; drop its expectations entry"
            )
    if report_path is not None:
        terminal.write_line(f"report: {report_path} and {markdown_path(report_path)}")


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _header(report: dict[str, Any]) -> list[str]:
    backend, env, suite = report["backend"], report["environment"], report["suite"]
    capability = env["compute_capability"]
    options = report.get("options", {})
    expectations = options.get("expectations")
    return [
        "# fp8conf conformance report",
        "",
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
    notes = []
    for property_id, row in report["properties"].items():
        for key, entry in row.get("expectations", {}).items():
            link = f" ({entry['link']})" if entry.get("link") else ""
            notes.append(
                f"- {property_id} {row['status']}: expected to fail ({key}): {entry['reason']}{link}"
            )
        if row.get("reason"):
            notes.append(f"- {property_id} {row['status']}: {row['reason']}")
        notes.extend(f"- {property_id} {row['status']}: {text}" for text in row.get("notes", ()))
    return ["## Notes", "", *notes, ""] if notes else []


def _failure(property_id: str, row: dict[str, Any]) -> list[str]:
    found = row["reproducer"]
    lines = [
        f"### {property_id} ({row['status']})", "",
        f"Test `{found['test']}`:", "",
        "```text", found["message"], "```", "",
        "Replay:", "",
        "```bash", found["command"], "```", "",
    ]
    if found.get("model"):
        lines += ["Minimal model (runnable):", "", "```python", found["model"].rstrip("\n"), "```", ""]
    elif found.get("failing_case"):
        lines += ["Failing test case:", "", "```python", found["failing_case"], "```", ""]
    if found.get("reproduce_failure"):
        lines += [f"Or decorate the test with `{found['reproduce_failure']}`.", ""]
    return lines


def markdown(report: dict[str, Any]) -> str:
    """The report as a Markdown page: header, table, score, notes, then each failure."""
    lines = _header(report) + [
        "| Property | Level | Capability | Status | Tests | Examples | Title |",
        "|---|---|---|---|---:|---:|---|",
    ]
    for property_id, row in report["properties"].items():
        lines.append(
            f"| {property_id} | {row['level']} | {row['capability']} | {row['status']} "
            f"| {row['tests']} | {row['examples']} | {_cell(row['title'])} |"
        )
    lines += ["", f"**{score_line(report)}**", ""]
    lines += _notes(report)
    failures = failing_rows(report)
    if failures:
        lines += ["## Failures", ""]
    for property_id, row in failures:
        lines += _failure(property_id, row)
    return "\n".join(lines)


def markdown_path(path: Path) -> Path:
    """Where the Markdown of the JSON report at ``path`` goes: beside it, suffix ``.md``."""
    markdown_file = path.with_suffix(".md")
    # For PATH ending in .md, keep the JSON rather than overwrite it.
    return path.with_name(path.name + ".md") if markdown_file == path else markdown_file


def write_report(report: dict[str, Any], path: Path) -> None:
    """Write ``report`` as JSON at ``path`` and as Markdown at :func:`markdown_path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    markdown_path(path).write_text(markdown(report), encoding="utf-8")
