"""A line per conformance test as it finishes, on the terminal, also when it is a pipe.

``PROV-003  test_PROV_003_backward_provenance  pass  25 examples  4.1 s``: a CI log or a
``tee`` shows which property is running and how each went, where pytest's dots say neither.
The lines are written by the process that prints the terminal (the xdist controller too, from
the reports its workers send) and flushed each time; under ``-v`` pytest's own per-test lines
are kept instead, and without pytest's terminal plugin nothing is written.
"""

from __future__ import annotations

from typing import Any

import pytest

from conformance.plugin.report import EXAMPLES_KEY, PROPERTY_KEY, outcome_status, status_label

__all__ = ["ProgressLines", "progress_line"]


def progress_line(report: Any) -> str | None:
    """The line of a finished test's report; None for a phase that says nothing new (a
    passing setup or teardown), for a test citing no property and for a ``not_supported`` one."""
    if not isinstance(report, pytest.TestReport):
        return None  # a collect report
    ids = [value for key, value in report.user_properties if key == PROPERTY_KEY]
    status = outcome_status(report)
    if not ids or status is None or status == "not_supported":
        # A property of a capability the backend does not claim ran nothing; the summary gives
        # them one line per capability instead of one per test.
        return None
    if report.when == "teardown" and status == "error":
        status = "error in teardown"
    name = report.nodeid.rsplit("::", 1)[-1]
    examples = sum(int(value) for key, value in report.user_properties if key == EXAMPLES_KEY)
    line = f"{', '.join(ids):<10} {name}  {status_label(status)}"
    if report.when == "call":
        line += f"  {examples} example{'s' if examples != 1 else ''}  {report.duration:.1f} s"
    return line


class ProgressLines:
    """Writes :func:`progress_line` for each report, in place of pytest's dots."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self._after: object = None

    @property
    def _terminal(self) -> Any:
        if self.config.get_verbosity() > 0:
            return None  # pytest's own per-test lines say it
        return self.config.pluginmanager.get_plugin("terminalreporter")

    def status_of(self, report: Any, result: tuple) -> tuple:
        """pytest's (category, letter, word) of ``report``, with no letter where a line of
        ours stands for it."""
        if self._terminal is None or progress_line(report) is None:
            return result
        category, _, word = result
        return category, "", word

    def write(self, report: Any) -> None:
        terminal = self._terminal
        line = progress_line(report)
        if terminal is None or line is None:
            return
        # write_line forgets the file being reported, which pytest would then name again
        # before the next test of the same file; kept, it would end the line it thinks it is
        # on before each of ours: a blank line, unless nothing was written since ours.
        current = terminal.currentfspath
        if current is not None and current is self._after:
            terminal.line(line)
        else:
            terminal.write_line(line)
        terminal.currentfspath = self._after = current
        terminal.flush()
