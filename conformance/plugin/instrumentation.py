"""What a conformance test records while it runs, for the report: the examples Hypothesis ran,
whether each passed or failed (keyed by its drawn model) and what a failure named, the reproducer
of a failure, the per-example timer, and the device and versions.

Per-test state lives on the pytest item's stash; what the report needs is added to the test
report's ``user_properties`` where the test ran, so it reaches the controller under xdist.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import platform
import sys
import time
from typing import Any, Callable, Iterator

import hypothesis
import pytest
from hypothesis import reporting, settings
from hypothesis.errors import StopTest, UnsatisfiedAssumption
from hypothesis.internal.conjecture import engine
from hypothesis.statistics import collector

from conformance.observe import evidence
from conformance.report import notes, replay
from conformance.run import watchdog
from conformance.run.environment import EnvironmentProblem
from conformance.plugin.profiles import DEFAULT_SHRINK_SECONDS, DEFAULT_SHRINKS
from conformance.plugin.report import (
    BUILT_KEY,
    LEFT_OUT_KEY,
    DEVICE_KEY,
    EXAMPLE_OUTCOMES_KEY,
    ENVIRONMENT_KEY,
    EXAMPLES_KEY,
    NOTE_KEY,
    PROPERTY_KEY,
    REPRODUCER_KEY,
    TIMEOUT_KEY,
)

__all__ = [
    "annotate_report",
    "device_info",
    "environment",
    "examples_from_statistics",
    "hypothesis_instrumented",
    "report_thread_timeout",
    "version_if_importable",
]

_STATS_KEY = pytest.StashKey[dict]()
_CALLS_KEY = pytest.StashKey[int]()
_SHRINK_KEY = pytest.StashKey[dict]()
#: Example key -> "pass", or what its failure named (see :func:`_note_example`).
_OUTCOMES_KEY = pytest.StashKey[dict]()
#: ``(key, repr of its drawn models)`` of the last failing example.
_LAST_FAILED_KEY = pytest.StashKey[tuple]()
#: Failing examples of one test whose model is carried to the report as code: the smallest.
#: Every example's outcome is carried; shrinking outside the shared corpus meets hundreds.
_MODELS_CARRIED = 24
#: Phases left out for a test under an expectation (explain needs shrink).
_SHRINK_PHASES = (hypothesis.Phase.shrink, hypothesis.Phase.explain)
#: Shrinking needs at least this many re-runs of the failing example to get anywhere: when
#: the budget holds fewer, the first failing example is shown as found.
_MIN_SHRINK_RUNS = 10
_NOT_A_FAILURE = (UnsatisfiedAssumption, StopTest, pytest.skip.Exception)
_SLOW_SHRINK_WARNING = "WARNING: Hypothesis has spent more than five minutes working to shrink"


def _shrink_budget(example_seconds: float, budget: float) -> float:
    """Seconds to shrink a failure whose example took ``example_seconds``; 0: do not shrink."""
    return budget if example_seconds * _MIN_SHRINK_RUNS <= budget else 0.0


@contextlib.contextmanager
def _bounded_shrinking(item: pytest.Item, shrinks: bool, budget: float, count: int) -> Iterator[Callable]:
    """Bound Hypothesis's shrinking of this test to ``count`` shrinks, guarded by ``budget``
    seconds, or skip it when one example costs too much to re-run; yields the wrapper that times
    each example.

    The count (``engine.MAX_SHRINKS``) is what normally ends a shrink, so that a derandomized
    run shows the same examples, and the report groups the same failures, however busy the
    machine. Hypothesis reads its shrink deadline (``engine.MAX_SHRINKING_SECONDS``, documented
    as monkeypatchable) when shrinking starts, after the first failure: the failing example's
    cost is known by then. Its warning about five minutes of shrinking is dropped: the report
    says that shrinking stopped (``shrink: bounded``).
    """
    state = item.stash[_SHRINK_KEY] = {"shrink": "minimal" if shrinks else "none"}
    saved = engine.MAX_SHRINKING_SECONDS, engine.MAX_SHRINKS
    engine.MAX_SHRINKS = count
    outer = reporting.current_reporter()

    def report(text: object) -> None:
        if not str(text).startswith(_SLOW_SHRINK_WARNING):
            outer(text)

    def timed(call: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        try:
            return call()
        except _NOT_A_FAILURE:
            raise
        except BaseException:  # pytest.fail's exception is one, and a failure
            if "seconds" not in state and shrinks:
                state["seconds"] = _shrink_budget(time.perf_counter() - start, budget)
                engine.MAX_SHRINKING_SECONDS = state["seconds"]
                if not state["seconds"]:
                    state["shrink"] = "none"
            raise

    try:
        with reporting.with_reporter(report):
            yield timed
    finally:
        engine.MAX_SHRINKING_SECONDS, engine.MAX_SHRINKS = saved


@contextlib.contextmanager
def hypothesis_instrumented(
    item: pytest.Item, *, expected_to_fail: bool, shrink_seconds: float = DEFAULT_SHRINK_SECONDS,
    shrinks: int = DEFAULT_SHRINKS,
) -> Iterator[None]:
    """Around the call of a Hypothesis test: note its statistics and count its examples,
    note each example's outcome by its drawn model (:func:`_noted`), re-arm the per-example
    timer at each one, bound shrinking to ``shrinks`` shrinks guarded by ``shrink_seconds`` (none
    when an example costs more than a tenth of that) and, for a test expected to fail, skip it.

    Enter it inside Hypothesis's own ``pytest_runtest_call`` wrapper, which installs its
    statistics collector and may replace the test's settings first.
    """
    handle = getattr(item.obj, "hypothesis", None)
    if handle is None:
        yield
        return
    function = getattr(item.obj, "__func__", item.obj)
    original_settings = getattr(function, "_hypothesis_internal_use_settings", None)
    inner = handle.inner_test
    previous_collector = collector.value
    item.stash[_CALLS_KEY] = 0

    def note_statistics(stats: dict[str, Any]) -> None:
        item.stash[_STATS_KEY] = stats
        if previous_collector is not None:
            previous_collector(stats)

    phases = list(original_settings.phases) if original_settings is not None else []
    # An expected failure needs no minimal example; the explain phase re-runs the shrunk
    # example once per choice it made: minutes of traces for a note on the failure.
    phases = [
        p for p in phases
        if p is not hypothesis.Phase.explain and not (expected_to_fail and p in _SHRINK_PHASES)
    ]
    shrink_count = shrinks
    shrinks = hypothesis.Phase.shrink in phases and shrink_seconds > 0 and shrink_count > 0
    if not shrinks:
        phases = [p for p in phases if p is not hypothesis.Phase.shrink]
    if original_settings is not None:
        function._hypothesis_internal_use_settings = settings(parent=original_settings, phases=phases)
    try:
        with _bounded_shrinking(item, shrinks, shrink_seconds, shrink_count) as timed:

            @functools.wraps(inner)
            def counted(*args: Any, **kwargs: Any) -> Any:
                item.stash[_CALLS_KEY] += 1
                watchdog.rearm()  # the timeout bounds one example, not the whole search
                return _noted(item, kwargs, lambda: timed(lambda: inner(*args, **kwargs)))

            handle.inner_test = counted
            with collector.with_value(note_statistics):
                yield
    finally:
        handle.inner_test = inner
        if original_settings is not None:
            function._hypothesis_internal_use_settings = original_settings


def _noted(item: pytest.Item, kwargs: dict[str, Any], call: Callable[[], Any]) -> Any:
    """Run one example (``call``, drawn with ``kwargs``) and note whether it passed or failed
    and what its failure named; shrinking's examples too, each a real run on a model."""
    models = _drawn_models(item, kwargs)
    key = evidence.example_key(*models) if models else None
    evidence.start_example()
    try:
        result = call()
    except _NOT_A_FAILURE:
        raise
    except BaseException:
        _note_example(item, key, evidence.take_failure() or {})
        if key is not None:
            item.stash[_LAST_FAILED_KEY] = (key, "\n".join(map(repr, models)))
        raise
    _note_example(item, key, None)
    return result


def _drawn_models(item: pytest.Item, kwargs: dict[str, Any]) -> list[Any]:
    """The models of the example called with ``kwargs``, which key it: the arguments that are no
    fixture and print themselves as code (``to_python``), as the suite's model specs do. An
    example that draws none is shared with no other property and is not noted."""
    fixtures = set(getattr(item, "fixturenames", ()))
    return [
        value for name, value in sorted(kwargs.items())
        if name not in fixtures and callable(getattr(value, "to_python", None))
    ]


def _note_example(item: pytest.Item, key: str | None, failure: dict[str, Any] | None) -> None:
    """Note that the example ``key`` passed (``failure`` None) or failed, naming what
    ``failure`` records (:func:`conformance.observe.evidence.record_failure`; empty when the failure
    came from elsewhere). An example that failed once stays failed."""
    if key is None:
        return
    outcomes = item.stash.setdefault(_OUTCOMES_KEY, {})
    if failure is None:
        outcomes.setdefault(key, "pass")
        return
    if not isinstance(outcomes.get(key), dict):
        failure = {name: value for name, value in failure.items() if name != "property"}
        outcomes[key] = {"modules": [], "nodes": [], "seen": None, "size": None, "code": None, **failure}


def _carried_outcomes(item: pytest.Item) -> dict[str, Any]:
    """The test's example outcomes as they travel to the report: the code of the smallest
    :data:`_MODELS_CARRIED` failing models, the outcome and what it named of every example."""
    outcomes = item.stash.get(_OUTCOMES_KEY, {})
    failed = [key for key, value in outcomes.items() if isinstance(value, dict)]
    by_size = sorted(failed, key=lambda key: outcomes[key]["size"] or [float("inf")])
    dropped = set(by_size[_MODELS_CARRIED:])
    return {
        key: dict(value, code=None) if key in dropped else value for key, value in outcomes.items()
    }


def examples_from_statistics(stats: dict[str, Any]) -> int:
    """Test cases Hypothesis ran to a verdict, shrinking not included."""
    total = 0
    for key, phase in stats.items():
        if key.endswith("-phase") and key != "shrink-phase" and isinstance(phase, dict):
            total += sum(
                case.get("status") in ("valid", "interesting") for case in phase.get("test-cases", ())
            )
    return total


def _examples(item: pytest.Item, excinfo: pytest.ExceptionInfo | None) -> int:
    stats = item.stash.get(_STATS_KEY, None)
    if stats is not None:
        return examples_from_statistics(stats)
    calls = item.stash.get(_CALLS_KEY, None)
    if calls is not None:  # a Hypothesis test cut short (a timeout): the calls made
        return calls
    # A plain test is one example when its body ran.
    return 0 if excinfo is not None and excinfo.errisinstance(pytest.skip.Exception) else 1


def annotate_report(
    item: pytest.Item, call: pytest.CallInfo, report: pytest.TestReport, backend_spec: str,
    *, send_device: bool,
) -> bool:
    """Add to ``report`` the examples run, a timeout, the reproducer of a failure (also as a
    report section) and, when ``send_device``, the device; True when the device was added. A
    test the machine stopped (:class:`~conformance.run.environment.EnvironmentProblem`) carries what
    stopped it instead of a reproducer: no model of the backend's is to blame."""
    extra = report.user_properties  # this report's own copy of item.user_properties
    excinfo = call.excinfo
    device_sent = False
    if call.when == "call":
        extra.append((EXAMPLES_KEY, _examples(item, excinfo)))
        if item.stash.get(_OUTCOMES_KEY, None):
            extra.append((EXAMPLE_OUTCOMES_KEY, _carried_outcomes(item)))
        extra.extend((NOTE_KEY, text) for text in notes.take())
        extra.extend((BUILT_KEY, list(entry)) for entry in evidence.take_built())
        extra.extend((LEFT_OUT_KEY, list(entry)) for entry in evidence.take_left_out())
        info = device_info() if send_device else None
        if info is not None:
            device_sent = True
            extra.append((DEVICE_KEY, info))
    if excinfo is not None and excinfo.errisinstance(EnvironmentProblem):
        extra.append((ENVIRONMENT_KEY, str(excinfo.value)))
        ids = ", ".join(value for key, value in extra if key == PROPERTY_KEY)
        report.longrepr = f"[{ids}] error (environment), not a failure of the backend: {excinfo.value}"
        return device_sent
    if excinfo is not None and not excinfo.errisinstance(pytest.skip.Exception):
        if excinfo.errisinstance(watchdog.BackendTimeout):
            extra.append((TIMEOUT_KEY, str(excinfo.value)))
        if report.failed or hasattr(report, "wasxfail"):
            found = replay.reproducer(item, excinfo.value, backend_spec)
            found["shrink"] = _shrink_outcome(item)
            found.update(_shown_example(item))
            extra.append((REPRODUCER_KEY, found))
            _name_the_model_shown(report, found["shrink"])
            if report.failed:
                report.sections.append(("fp8conf reproducer", replay.section_text(found)))
    return device_sent


def _name_the_model_shown(report: pytest.TestReport, shrink: str | None) -> None:
    """Say in the failure's text whether the model it shows was shrunk."""
    if shrink in (None, "minimal"):
        return
    from conformance.plugin.render import MODEL_HEADINGS

    old, new = replay.MODEL_MARKER, MODEL_HEADINGS[shrink] + ":"
    if isinstance(report.longrepr, str):
        report.longrepr = report.longrepr.replace(old, new)
        return
    # The short summary quotes the crash message, whole where $CI is set.
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None and isinstance(getattr(crash, "message", None), str):
        crash.message = crash.message.replace(old, new)
    # pytest.fail(..., pytrace=False) is rendered as an exception chain of "value" entries.
    for traceback, crash, _ in getattr(report.longrepr, "chain", ()):
        if crash is not None and isinstance(getattr(crash, "message", None), str):
            crash.message = crash.message.replace(old, new)
        for entry in getattr(traceback, "reprentries", ()):
            if hasattr(entry, "lines"):
                entry.lines = [line.replace(old, new) for line in entry.lines]


def _shown_example(item: pytest.Item) -> dict[str, Any]:
    """The key, one-line ``repr`` (``spec``, the machine-readable form of the model the message
    shows as code) and size of the model the failure shows: Hypothesis runs the example it
    reports last, so the last failing example."""
    last = item.stash.get(_LAST_FAILED_KEY, None)
    if last is None:
        return {}
    key, text = last
    return {"example": key, "spec": text, "size": item.stash[_OUTCOMES_KEY][key]["size"]}


def _shrink_outcome(item: pytest.Item) -> str | None:
    """Whether the failing example shown was shrunk: ``minimal`` (shrinking finished),
    ``shrunk`` (stopped after ``--fp8-shrinks`` shrinks), ``bounded`` (stopped by the guard
    ``--fp8-shrink-seconds``), ``none``; None for a plain test."""
    state = item.stash.get(_SHRINK_KEY, None)
    if state is None:
        return None
    stats = item.stash.get(_STATS_KEY, {})
    if state["shrink"] == "minimal" and "very slow" in str(stats.get("stopped-because", "")):
        return "bounded"
    if state["shrink"] == "minimal" and "shrunk test case" in str(stats.get("stopped-because", "")):
        return "shrunk"
    return state["shrink"]


def report_thread_timeout(item: pytest.Item, message: str, backend_spec: str) -> None:
    """Under pytest-timeout's thread method an xdist worker is about to end: send the
    controller a report of the timeout (pytest-xdist adds its own report of the crash)."""
    found = replay.reproducer(item, watchdog.BackendTimeout(message), backend_spec)
    report = pytest.TestReport(
        item.nodeid,
        item.location,
        {name: 1 for name in item.keywords},
        "failed",
        f"conformance.run.watchdog.BackendTimeout: {message}",
        "call",
        user_properties=[*item.user_properties, (TIMEOUT_KEY, message), (REPRODUCER_KEY, found)],
    )
    item.ihook.pytest_runtest_logreport(report=report)


def device_info() -> dict[str, Any] | None:
    """The accelerator, read only when torch is already imported; None otherwise."""
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    if cuda is None:
        return None
    try:
        if cuda.is_available():
            index = cuda.current_device()
            major, minor = cuda.get_device_capability(index)
            name = cuda.get_device_name(index)
            return {"device": f"cuda:{index} ({name})", "compute_capability": f"{major}.{minor}"}
    except Exception:  # a broken driver must not break the report
        pass
    return {"device": "cpu", "compute_capability": None}


def version_if_importable(module: str) -> str | None:
    """``module``'s version without importing it (torch's import is seconds)."""
    loaded = sys.modules.get(module)
    if loaded is not None:
        return getattr(loaded, "__version__", None)
    if importlib.util.find_spec(module) is None:
        return None
    try:
        return importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device: dict[str, Any] | None) -> dict[str, Any]:
    """The report's ``environment``: versions, the Hypothesis profile loaded, the device."""
    device = device or device_info() or {"device": "cpu", "compute_capability": None}
    return {
        "python": platform.python_version(),
        "torch": version_if_importable("torch"),
        "torchao": version_if_importable("torchao"),
        "pytest": pytest.__version__,
        "hypothesis": hypothesis.__version__,
        "hypothesis_profile": settings.get_current_profile_name(),
        "device": device["device"],
        "compute_capability": device["compute_capability"],
    }
