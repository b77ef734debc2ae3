"""How a run ended (complete, interrupted or incomplete) and which selected tests it did not
reach; and what becomes of an earlier report when a run writes none.

:class:`RunTracker` follows what pytest tells every plugin: the tests selected to run
(``pytest_collection_finish``; under xdist only the workers collect, so each writes its selection
to a file in a folder the controller names), the tests that start (``pytest_runtest_logstart``,
which xdist forwards), a KeyboardInterrupt or ``pytest.exit`` (``pytest_keyboard_interrupt``; a
worker's reaches the controller with the worker's output), collection errors, pytest's exit status
and the session's ``shouldfail``/``shouldstop``. At the end of the session the controller turns
them into a :class:`~conformance.plugin.report.RunEnding`.

A run that ends before its first test started, and not complete (Ctrl-C while torch loads, a
usage error, a collection error, ``--collect-only``), writes no report, and an earlier run's
report at its path is removed, with a line on stderr saying so
(:func:`remove_earlier_report_unless_written`). Removed rather than replaced by a report that says
"interrupted": before the session starts nothing a report holds is known, not even the backend
(the usage error may be that it cannot be loaded), so such a report would be a stub whose fields
depend on where start-up stopped; a missing file fails every reader at once, and stderr says why.
"""

from __future__ import annotations

import functools
import json
import sys
import warnings
from pathlib import Path
from typing import Any, Mapping

import pytest

from conformance.plugin import report_files
from conformance.plugin.handoff import WorkerFolder
from conformance.plugin.render import markdown_path
from conformance.plugin.report import CUT_OFF_KEY, PROPERTY_KEY, RunEnding, TestRecord, unreached_tests

__all__ = ["RunTracker", "remove_earlier_report_unless_written", "report_written"]

#: ``workerinput`` key: the folder where each xdist worker writes the tests it selected.
_FOLDER_KEY = "fp8conf_selection"
#: ``workeroutput`` key: what interrupted a worker (KeyboardInterrupt, ``pytest.exit``).
_INTERRUPTION_KEY = "fp8conf_interruption"
#: Why this run wrote no report of its own; absent once it wrote one.
_NO_REPORT_KEY = pytest.StashKey[str]()


class RunTracker:
    """What the controller needs to tell how the run ended; a worker's side sends its part."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        #: Node ID -> property IDs of the tests selected to run; None until collection finishes.
        self.selected: dict[str, tuple[str, ...]] | None = None
        self.started: set[str] = set()
        self._interruption: str | None = None
        self._stopped: str | None = None
        self._collection_errors: set[str] = set()
        self._interrupted_workers: dict[str, str] = {}
        self._handoff = WorkerFolder(config, _FOLDER_KEY, ".json")

    def close(self) -> None:
        self._handoff.close()

    # -- what pytest tells --------------------------------------------------------------
    def configure_node(self, node: Any) -> None:
        self._handoff.configure_node(node)

    def collection_finished(self, items: list[pytest.Item]) -> None:
        selected = {}
        for item in items:
            ids = tuple(value for key, value in item.user_properties if key == PROPERTY_KEY)
            if ids:
                selected[item.nodeid] = ids
        self.selected = selected
        if self._handoff.mine is None:
            return
        try:
            report_files.replace_files({self._handoff.mine: json.dumps(selected)})
        except report_files.ReportWriteError as exc:
            # The controller then knows the tests that ran, not those that never started.
            warnings.warn(pytest.PytestWarning(
                f"fp8conf: the tests this worker selected are not known to the controller: {exc}"
            ))

    def note_started(self, nodeid: str) -> None:
        self.started.add(nodeid)

    def collected(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self._collection_errors.add(report.nodeid)

    def interrupted(self, excinfo: pytest.ExceptionInfo[BaseException]) -> None:
        value = excinfo.value
        if isinstance(value, pytest.exit.Exception):
            self._interruption = f"pytest.exit: {value.msg}"
        elif type(value) is KeyboardInterrupt:
            # ``fp8conf check`` raises it with the signal's name for a SIGTERM (its workers go too).
            self._interruption = f"KeyboardInterrupt: {value}" if str(value) else "KeyboardInterrupt: Ctrl-C or SIGINT"
        else:
            # A subclass: pytest's or xdist's Interrupted, a stop of theirs (collection errors,
            # -x under xdist, an interrupted worker, which node_down has named), not a person's.
            self._stopped = str(value)

    def worker_finished(self) -> None:
        """On a worker: send the controller what interrupted it, if anything did."""
        output = getattr(self.config, "workeroutput", None)
        if output is not None and self._interruption is not None:
            output[_INTERRUPTION_KEY] = self._interruption

    def node_down(self, node: Any) -> None:
        interruption = (getattr(node, "workeroutput", None) or {}).get(_INTERRUPTION_KEY)
        if interruption is not None:
            self._interrupted_workers[node.gateway.id] = interruption
            if self._interruption is None:
                self._interruption = f"xdist worker {node.gateway.id}: {interruption}"

    def mark_cut_off(self, report: pytest.TestReport) -> bool:
        """Mark xdist's "worker crashed while running" report of a test whose worker was
        interrupted as that test cut off (``not_run``), not crashed; True when it did."""
        worker = getattr(getattr(report, "node", None), "gateway", None)
        if worker is None or worker.id not in self._interrupted_workers:
            return False
        cut_off = (CUT_OFF_KEY, self._interrupted_workers[worker.id])
        report.user_properties = [*report.user_properties, cut_off]
        return True

    # -- the end ------------------------------------------------------------------------
    def _selection(self) -> dict[str, tuple[str, ...]] | None:
        if self._handoff.folder is None:
            return self.selected
        # Every worker collects the same tests; the first whole file tells them.
        for path in self._handoff.files():
            try:
                found = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue  # a worker interrupted while it wrote
            return {nodeid: tuple(ids) for nodeid, ids in found.items()}
        return None

    def ending(
        self, session: pytest.Session, exitstatus: int, records: Mapping[str, TestRecord]
    ) -> RunEnding:
        """How the run ended, with the tests it selected and those that started."""
        selected = self._selection()
        ended, reason = self._decide(session, exitstatus, selected, unreached_tests(records, selected))
        return RunEnding(ended, reason, selected, frozenset(self.started))

    def _decide(
        self, session: pytest.Session, exitstatus: int, selected: Mapping[str, Any] | None,
        not_run: list[str],
    ) -> tuple[str, str | None]:
        """``(ended, reason)``: a person's interrupt first, then what pytest says, then whether
        every selected test ran to a verdict."""
        if self._interruption is not None:
            return "interrupted", self._interruption
        if exitstatus == pytest.ExitCode.INTERNAL_ERROR:
            return "incomplete", "an internal error of pytest or a plugin"
        if exitstatus == pytest.ExitCode.USAGE_ERROR:
            return "incomplete", "a usage error"
        if self._collection_errors:
            count = len(self._collection_errors)
            return "incomplete", f"{_counted(count, 'collection error')}: the tests there were not collected"
        if session.config.option.collectonly:
            return "incomplete", "--collect-only: no test runs"
        stopped = self._stopped or session.shouldfail or session.shouldstop
        why = stopped if isinstance(stopped, str) else None
        if selected is None and not self.started:
            return "incomplete", why or "the run ended before its collection finished"
        if not_run:
            return "incomplete", why or f"{_counted(len(not_run), 'selected test')} did not run"
        return "complete", None


def _counted(count: int, noun: str) -> str:
    return f"{count} {noun}{'s' if count != 1 else ''}"


def report_written(config: pytest.Config, why_not: str | None = None) -> None:
    """Record that this run wrote its report, or, with ``why_not``, why it wrote none."""
    if why_not is None:
        if _NO_REPORT_KEY in config.stash:
            del config.stash[_NO_REPORT_KEY]
    else:
        config.stash[_NO_REPORT_KEY] = why_not


def remove_earlier_report_unless_written(config: pytest.Config, given: str) -> None:
    """At the start of pytest, before any conftest loads: when pytest ends (also on a usage error
    or a KeyboardInterrupt in its start-up), unless this run wrote its report at ``--fp8-report``,
    remove an earlier run's report there, JSON and Markdown, and say so on stderr."""
    path = Path(config.invocation_params.dir, given).resolve()
    config.stash[_NO_REPORT_KEY] = "it ended before its first test"
    config.add_cleanup(functools.partial(_remove_unless_written, config, path))


def _remove_unless_written(config: pytest.Config, path: Path) -> None:
    why = config.stash.get(_NO_REPORT_KEY, None)
    if why is None or hasattr(config, "workerinput"):
        return  # it wrote its report, or it is an xdist worker, which writes none
    removed, problems = report_files.remove_earlier_report((path, markdown_path(path)))
    if removed:
        print(
            f"fp8conf: removed {' and '.join(map(str, removed))}, an earlier run's report: this run "
            f"wrote none ({why})",
            file=sys.stderr,
        )
    for problem in problems:
        print(
            f"fp8conf: could not remove an earlier run's report, {problem}; it is not this run's",
            file=sys.stderr,
        )
