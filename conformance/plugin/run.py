"""One conformance run: the hooks registered only when ``--fp8-backend`` is given.

:class:`ConformanceRun` holds the backend and the per-session state and wires the concerns
together: gating at collection (:mod:`~conformance.run.gating`), the machine probed for the
selected tests (:mod:`~conformance.plugin.probes`), expectations
(:mod:`conformance.judge.expectations`), instrumentation of each test
(:mod:`~conformance.plugin.instrumentation`), how the run ended
(:mod:`~conformance.plugin.ending`), the report (:mod:`~conformance.plugin.report`), its
rendering (:mod:`~conformance.plugin.render`) and its files
(:mod:`~conformance.plugin.report_files`).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any, Generator

import pytest

from conformance.judge import expectations as expectations_file
from conformance.run import watchdog
from conformance.api import PROPERTIES, SPEC_VERSION, Backend
from conformance.plugin import crashes, ending, instrumentation, probes, progress, quiet, render, usage, worker_end
from conformance.run import gating
from conformance.api.types import FLOAT8_RECIPES
from conformance.plugin import report as report_model
from conformance.plugin.report import (
    ENVIRONMENT_ERROR, ENVIRONMENT_KEY, EXPECTATION_KEY, PROPERTY_KEY, RunEnding, TestRecord,
)
from conformance.plugin.report_files import ReportWriteError

__all__ = ["ConformanceRun"]

_CITED_KEY = pytest.StashKey[bool]()
_EXPECTED_KEY = pytest.StashKey[bool]()


def _load_expectations(config: pytest.Config) -> dict[str, expectations_file.Expectation]:
    path = config.getoption("fp8_expectations")
    if not path:
        return {}
    path = Path(config.invocation_params.dir, path).resolve()
    # xdist hands the controller's options to its workers: they read the same file.
    config.option.fp8_expectations = str(path)
    try:
        return expectations_file.load(path, PROPERTIES)
    except expectations_file.ExpectationsError as exc:
        raise pytest.UsageError(f"--fp8-expectations: {exc}") from None


def _timeout(config: pytest.Config) -> float | None:
    """Seconds per example of a conformance test; None: no timeout of ours."""
    seconds = config.getoption("fp8_timeout")
    if not seconds or not config.pluginmanager.hasplugin("timeout"):
        return None  # 0, or pytest-timeout is not active (-p no:timeout)
    return seconds


class ConformanceRun:
    """Per-session state and hooks; registered only when ``--fp8-backend`` is given."""

    def __init__(self, config: pytest.Config, spec: str, backend: Backend) -> None:
        self.config = config
        self.spec = spec
        # Tracked: a timeout names the adapter method in progress.
        self.backend = watchdog.track(backend)
        self.tests: dict[str, TestRecord] = {}
        self.spec_version = gating.checked_spec_version(config, backend)
        self.expectations = _load_expectations(config)
        # Checked now, not when it is written: a bad path must not cost the whole run.
        self.report_path = usage.checked_report_path(config)
        self.selected = usage.checked_properties(config)
        for option in ("timeout", "shrink_seconds"):
            seconds = config.getoption("fp8_" + option)
            if seconds is not None and seconds < 0:
                name = "--fp8-" + option.replace("_", "-")
                raise pytest.UsageError(f"{name} must be 0 or more seconds, got {seconds:g}")
        if config.getoption("fp8_shrinks") < 0:
            raise pytest.UsageError(f"--fp8-shrinks must be 0 or more, got {config.getoption('fp8_shrinks')}")
        self.progress = progress.ProgressLines(config)
        self.crash_notes = crashes.CrashNotes(config, spec)
        self.tracker = ending.RunTracker(config)
        self.probes = probes.EnvironmentProbes(config)
        #: How the run ended; decided when the session finishes.
        self.ending = RunEnding()
        self._report_written = False
        self._unquiet = lambda: None  # removes the log filter installed at session start
        #: The accelerator: seen here, or reported by the first xdist worker that saw it.
        self.device: dict[str, Any] | None = None
        self._device_sent = False

    @functools.cached_property
    def timeout(self) -> float | None:
        """``--fp8-timeout`` in seconds, or None when pytest-timeout's own settings apply."""
        return _timeout(self.config)

    @property
    def _is_xdist_worker(self) -> bool:
        return hasattr(self.config, "workerinput")

    def pytest_report_header(self) -> str:
        return (
            f"fp8conf: backend {self.backend.name!r} {self.backend.version}, "
            f"capabilities: {', '.join(sorted(self.backend.capabilities)) or 'none'}, "
            f"spec {self.spec_version}"
        )

    # -- collection ------------------------------------------------------------------------
    # A hook wrapper turns a bad citation into an ordinary collection error, which
    # pytest-xdist reports cleanly from a worker, unlike an exception in a later hook.
    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(
        self, collector: pytest.Collector
    ) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
        collected = yield
        if collected.passed:
            problems = []
            for node in collected.result:
                if isinstance(node, pytest.Item):
                    try:
                        gating.cited_ids(node)
                    except gating.CitationError as exc:
                        problems.append(str(exc))
            if problems:
                collected.outcome = "failed"
                collected.longrepr = "\n".join(problems)
                collected.result = []
        return collected

    # tryfirst: before -k / -m deselect, so expectations are matched against every collected test.
    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        matched: set[str] = set()
        may_run = []
        for item in items:
            ids = gating.cited_ids(item)
            # user_properties travel with every report, also from xdist workers.
            item.user_properties.extend((PROPERTY_KEY, property_id) for property_id in ids)
            if ids:
                item.stash[_CITED_KEY] = True
                if self.timeout is not None and item.get_closest_marker("timeout") is None:
                    item.add_marker(pytest.mark.timeout(self.timeout))
            matched.update(self._mark_expected(item, ids))
            reason = gating.skip_reason_for(ids, self.backend, self.spec_version)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))
            else:
                may_run.append(item)
        gating.skip_unavailable_gpu_tests(may_run)
        unmatched = [key for key in self.expectations if key not in matched]
        if unmatched:
            self._unmatched_expectations(unmatched, items)
        self._select_properties(items)

    # tryfirst: under xdist, before the worker tells its controller which tests it kept.
    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.probes.collection_finished(session)
        self.tracker.collection_finished(session.items)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self.tracker.collected(report)

    def _select_properties(self, items: list[pytest.Item]) -> None:
        """Keep only the tests of ``--fp8-property``; a test citing none is not kept."""
        if not self.selected:
            return
        chosen = [usage.selects(self.selected, gating.cited_ids(item)) for item in items]
        kept = [item for item, keep in zip(items, chosen) if keep]
        dropped = [item for item, keep in zip(items, chosen) if not keep]
        if dropped:
            self.config.hook.pytest_deselected(items=dropped)
            items[:] = kept

    def _mark_expected(self, item: pytest.Item, ids: list[str]) -> set[str]:
        expected = expectations_file.matching(self.expectations, item.nodeid, ids)
        if expected:
            item.user_properties.extend((EXPECTATION_KEY, entry.key) for entry in expected)
            reason = "; ".join(entry.describe() for entry in expected)
            item.add_marker(pytest.mark.xfail(reason=reason, strict=False))
            item.stash[_EXPECTED_KEY] = True
        return {entry.key for entry in expected}

    def _unmatched_expectations(self, unmatched: list[str], items: list[pytest.Item]) -> None:
        message = "--fp8-expectations: " + "; ".join(
            f"entry {key!r} matches no collected test" for key in unmatched
        )
        if not self._is_xdist_worker:
            raise pytest.UsageError(message)
        # An exception here would crash the worker; a failed collect report with nothing left
        # to run ends the session with the message as a collection error.
        failed = pytest.CollectReport("fp8conf-expectations", "failed", message, [])
        self.config.hook.pytest_collectreport(report=failed)
        self.config.hook.pytest_deselected(items=list(items))
        items[:] = []

    # -- running ---------------------------------------------------------------------------
    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node: Any) -> None:
        self.crash_notes.configure_node(node)
        self.tracker.configure_node(node)
        self.probes.configure_node(node)

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: Any, ids: list[str]) -> None:
        self.probes.node_collected(node)

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        self.tracker.node_down(node)

    @pytest.hookimpl(optionalhook=True)
    def pytest_handlecrashitem(self, crashitem: str, report: pytest.TestReport, sched: Any) -> None:
        if self.tracker.mark_cut_off(report):
            return  # its worker was interrupted: the test was cut off, nothing crashed
        record = self.tests.get(crashitem)
        self.crash_notes.annotate(report, record.property_ids if record else ())

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        self.tracker.note_started(nodeid)

    def pytest_keyboard_interrupt(self, excinfo: pytest.ExceptionInfo[BaseException]) -> None:
        self.tracker.interrupted(excinfo)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        self.crash_notes.item_started(item)

    # trylast: inside Hypothesis's own wrapper, which installs its statistics collector and may
    # replace the test's settings first.
    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, Any, Any]:
        if not item.stash.get(_CITED_KEY, False):
            return (yield)
        expected = item.stash.get(_EXPECTED_KEY, False)
        with instrumentation.hypothesis_instrumented(
            item, expected_to_fail=expected, shrink_seconds=self.config.getoption("fp8_shrink_seconds"),
            shrinks=self.config.getoption("fp8_shrinks"),
        ):
            return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        made = yield
        if item.stash.get(_CITED_KEY, False):
            send_device = not self._device_sent
            if instrumentation.annotate_report(item, call, made, self.spec, send_device=send_device):
                self._device_sent = True
        return made

    # optionalhook: the hook exists only while pytest-timeout is active.
    @pytest.hookimpl(optionalhook=True)
    def pytest_timeout_set_timer(self, item: pytest.Item, settings: Any) -> bool | None:
        if not item.stash.get(_CITED_KEY, False):
            return None  # pytest-timeout's own timer
        on_thread_timeout = None
        if self._is_xdist_worker:
            on_thread_timeout = functools.partial(
                instrumentation.report_thread_timeout, item, backend_spec=self.spec
            )
        return watchdog.set_timer(item, settings, self.backend.name, on_thread_timeout)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        device = report_model.record_outcome(self.tests, report)
        if device is not None and self.device is None:
            self.device = device
        if not self._is_xdist_worker:
            self.progress.write(report)

    @pytest.hookimpl(wrapper=True)
    def pytest_report_teststatus(self, report: pytest.TestReport) -> Generator[None, Any, Any]:
        result = yield
        stopped = any(key == ENVIRONMENT_KEY for key, _ in getattr(report, "user_properties", ()))
        if result and report.failed and stopped:
            result = ("error", "E", "ERROR (environment)")  # counted with pytest's errors, not its failures
        if result and not self._is_xdist_worker:
            return self.progress.status_of(report, tuple(result))
        return result

    def pytest_sessionstart(self) -> None:
        self._unquiet = quiet.install(self.config)

    def pytest_unconfigure(self) -> None:
        self._unquiet()
        self.crash_notes.close()
        self.tracker.close()
        self.probes.close()
        worker_end.freeze_heap(self.config)  # last: the worker's reports are sent

    # -- the report ------------------------------------------------------------------------
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self._is_xdist_worker:
            self.tracker.worker_finished()
            return
        self.ending = self.tracker.ending(session, exitstatus, self.tests)
        if exitstatus == pytest.ExitCode.TESTS_FAILED and self.ending.complete and self._only_the_machine_failed():
            # The backend failed nothing: the run's failure is the machine's, a usage error.
            session.exitstatus = pytest.ExitCode.USAGE_ERROR
        if self.report_path is None:
            return
        if not self.ending.complete and not self.ending.started:
            # Before its first test: no report, and none of an earlier run left to read as this
            # one's (the cleanup of ending.remove_earlier_report_unless_written removes it).
            return
        try:
            render.write_report(self.build_report(), self.report_path)
        except ReportWriteError as exc:
            ending.report_written(self.config, why_not="its own could not be written")
            terminal = self.config.pluginmanager.get_plugin("terminalreporter")
            if terminal is not None:
                terminal.ensure_newline()  # not after the last test's progress on its line
            # A usage error, as a report path found unwritable before the run is: one line.
            print(f"ERROR: --fp8-report: {exc}", file=sys.stderr)
            session.exitstatus = pytest.ExitCode.USAGE_ERROR
        else:
            ending.report_written(self.config)
            self._report_written = True

    def _only_the_machine_failed(self) -> bool:
        statuses = {record.status for record in self.tests.values()}
        return ENVIRONMENT_ERROR in statuses and not statuses & {"fail", "error"}

    def pytest_terminal_summary(
        self, terminalreporter: pytest.TerminalReporter, exitstatus: int
    ) -> None:
        if exitstatus == pytest.ExitCode.USAGE_ERROR and not self.ending.started and not self.tests:
            return  # a usage error before the first test: its one line says all there is
        if not self._is_xdist_worker:
            written = self.report_path if self._report_written else None
            render.print_summary(terminalreporter, self.build_report(), written)

    def _drawn_recipes(self) -> dict[str, list[str] | None]:
        """The recipes the suite draws for the backend: its own float8 linears' (``float8_modules``;
        TorchAO's are all of them) and its MX linears' (None: it claims no ``mx``)."""
        capabilities = self.backend.capabilities
        own = "float8_modules" in capabilities
        return {
            "float8_recipes": sorted(self.backend.float8_recipes) if own else list(FLOAT8_RECIPES),
            "mx_recipes": sorted(self.backend.mx_recipes) if "mx" in capabilities else None,
        }

    def build_report(self) -> dict[str, Any]:
        """The report as plain JSON-ready data; see ``--fp8-report`` and the README."""
        return report_model.build_report(
            self.tests,
            PROPERTIES,
            suite={"name": "fp8conf", "version": instrumentation.version_if_importable("fp8conf")},
            spec_version=SPEC_VERSION,
            checked_spec_version=self.spec_version,
            backend={
                "name": self.backend.name,
                "version": self.backend.version,
                "spec": self.spec,
                "spec_version": getattr(self.backend, "spec_version", SPEC_VERSION),
                "capabilities": sorted(self.backend.capabilities),
                "provenance_has_recipe": bool(getattr(self.backend, "provenance_has_recipe", True)),
                **self._drawn_recipes(),
            },
            environment=instrumentation.environment(self.device),
            options={
                "expectations": self.config.getoption("fp8_expectations") or None,
                "timeout_s": self.timeout,
                "shrink_s": self.config.getoption("fp8_shrink_seconds"),
                "shrinks": self.config.getoption("fp8_shrinks"),
                "device": self.config.getoption("fp8_device"),
            },
            expectations=self.expectations,
            run=self.ending,
        )
