"""The pytest plugin of the conformance suite (entry point ``pytest11: fp8conf``).

Without ``--fp8-backend`` it only registers its options, markers and the Hypothesis profiles
``dev`` / ``ci`` / ``thorough`` (``dev`` is loaded unless ``--hypothesis-profile`` or
``$FP8CONF_HYPOTHESIS_PROFILE`` picks another), so installing fp8conf leaves other pytest runs
alone. With ``--fp8-backend=NAME`` (an entry
point of the group ``fp8conf.backends``) or ``--fp8-backend=package.module:Class`` it:

* loads and instantiates the backend once per session (fixture ``fp8_backend``);
* collects ``conformance/properties/`` of the installed package when no test path is given;
* checks every ``@pytest.mark.fp8_property(ID)`` against :mod:`conformance.api.spec` and skips a
  test as ``not_supported`` when the backend does not claim the property's capability;
* skips ``gpu`` / ``sm89`` / ``sm90`` / ``sm100`` tests the local device cannot run;
* skips a property newer than the spec version checked (``--fp8-spec-version``, default the
  backend's ``spec_version``) as ``not_supported`` with a reason starting ``not_in_spec_version:``;
* marks the tests under an entry of ``--fp8-expectations`` xfail, not strict (a pass is reported
  ``xpass``), and runs their Hypothesis tests without shrinking (:mod:`conformance.expectations`);
* gives every suite test a pytest-timeout of ``--fp8-timeout`` seconds; one that runs past it is
  reported ``error`` naming the backend method in progress (:mod:`conformance.watchdog`);
* adds to every failure the command that replays it (:mod:`conformance.replay`);
* prints a per-property summary and, with ``--fp8-report=PATH``, writes it as JSON at PATH and
  as Markdown next to it (suffix ``.md``).

Outcomes are gathered from ``pytest_runtest_logreport``, which pytest-xdist forwards from its
workers to the controller; the property IDs, example counts, reproducers and the device travel
inside ``report.user_properties``, so the report is the same with and without ``-n``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Generator

import hypothesis
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.errors import InvalidArgument

import conformance
from conformance import expectations as expectations_file
from conformance import replay, watchdog
from conformance.api.backend import Backend
from conformance.api.spec import PROPERTIES, SPEC_VERSION, get_property

__all__ = [
    "ENTRY_POINT_GROUP",
    "PROFILE_ENV",
    "PROPERTIES_DIR",
    "PROPERTY_KEY",
    "REPORT_SCHEMA_VERSION",
    "STATUSES",
    "fp8_backend",
    "load_backend",
]

ENTRY_POINT_GROUP = "fp8conf.backends"
#: Environment variable naming the Hypothesis profile to load instead of ``dev``.
PROFILE_ENV = "FP8CONF_HYPOTHESIS_PROFILE"
#: The suite's own property tests, collected when ``--fp8-backend`` comes without test paths.
PROPERTIES_DIR = Path(conformance.__file__).resolve().parent / "properties"
#: Key of the ``item.user_properties`` entries that carry a test's property IDs.
PROPERTY_KEY = "fp8_property"
#: Statuses of a test and of a property, strongest first: a property takes the strongest
#: status among its tests, so one failure fails it and a skipped GPU variant does not hide
#: the passing CPU ones. ``xfail`` and ``xpass`` come from ``--fp8-expectations``; a property
#: is ``xpass`` only when none of its expected failures still fails.
STATUSES = ("fail", "error", "xfail", "xpass", "pass", "not_supported", "skipped")
_RANK = {status: rank for rank, status in enumerate(STATUSES)}
_NOT_SUPPORTED = "not_supported:"
#: Skip reason of a property newer than the spec version checked; reported ``not_supported``.
_NOT_IN_SPEC = "not_in_spec_version:"
#: Version of the report's JSON layout: bumped when a field changes meaning or goes away.
REPORT_SCHEMA_VERSION = 1
#: Default of ``--fp8-timeout``: seconds per example of a conformance test (a plain test is one
#: example); the timer restarts at every Hypothesis example.
DEFAULT_TIMEOUT = 300.0
# Keys of further ``user_properties`` entries, added where the test ran (an xdist worker too).
_EXAMPLES_KEY = "fp8_examples"
_REPRODUCER_KEY = "fp8_reproducer"
_TIMEOUT_KEY = "fp8_timeout"
_EXPECTATION_KEY = "fp8_expectation"
_DEVICE_KEY = "fp8_device"
_RUN_KEY = pytest.StashKey["ConformanceRun"]()
_CITED_KEY = pytest.StashKey[bool]()
_EXPECTED_KEY = pytest.StashKey[bool]()
_STATS_KEY = pytest.StashKey[dict]()
_CALLS_KEY = pytest.StashKey[int]()
_VERSION = re.compile(r"^\d+(\.\d+)*$")

#: Minimum CUDA compute capability per marker; ``None``: any CUDA device.
_GPU_MARKERS: dict[str, tuple[int, int] | None] = {
    "gpu": None,
    "sm89": (8, 9),
    "sm90": (9, 0),
    "sm100": (10, 0),
}
_MARKERS = (
    "fp8_property(id): the test checks spec property `id` of conformance.api.spec; it is skipped "
    "as not_supported when the backend does not claim the property's capability",
    "gpu: needs a CUDA device",
    "sm89: needs a CUDA device of compute capability 8.9 or newer",
    "sm90: needs a CUDA device of compute capability 9.0 or newer",
    "sm100: needs a CUDA device of compute capability 10.0 or newer",
)

_HEALTH_CHECKS = (
    HealthCheck.too_slow,
    HealthCheck.data_too_large,
    HealthCheck.filter_too_much,
    HealthCheck.differing_executors,
    # A derandomized profile draws the shared corpus of models (conformance.strategies) with
    # Hypothesis, once per process, when a test first asks for it, possibly from inside its own
    # @given: a one-time nesting, not the per-example kind this check is about.
    *[check for check in (getattr(HealthCheck, "nested_given", None),) if check is not None],
)
_NO_SHRINK = (hypothesis.Phase.explicit, hypothesis.Phase.reuse, hypothesis.Phase.generate)
#: Phases left out for a test under an expectation (explain needs shrink).
_SHRINK_PHASES = (hypothesis.Phase.shrink, hypothesis.Phase.explain)

_PROFILES: dict[str, dict[str, Any]] = {
    "dev": {"max_examples": 10},
    "ci": {"derandomize": True, "max_examples": 25, "database": None, "print_blob": True},
    "thorough": {"max_examples": 200},
    # For proving that a mutant backend is caught: a failure is enough, a minimal one is not
    # needed, so shrinking (minutes on traced models) is skipped.
    "mutants": {"derandomize": True, "max_examples": 25, "database": None, "phases": _NO_SHRINK},
}


# -- always active: options, markers, profiles --------------------------------------------------
def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fp8conf", "fp8conf conformance suite")
    group.addoption(
        "--fp8-backend",
        metavar="NAME|MODULE:CLASS",
        help=f"check this backend: an entry point of group {ENTRY_POINT_GROUP!r} or "
        "package.module:Class. Without test paths, runs the suite's own property tests.",
    )
    group.addoption(
        "--fp8-report",
        metavar="PATH",
        help="write the conformance report as JSON at PATH and as Markdown at PATH with "
        "suffix .md (needs --fp8-backend)",
    )
    group.addoption(
        "--fp8-expectations",
        metavar="FILE",
        help="JSON (or .toml) file mapping property IDs or test node IDs to {reason, link}: "
        "those tests are expected to fail (xfail; one that passes is reported xpass) and are "
        "not shrunk. An entry that matches no collected test is an error.",
    )
    group.addoption(
        "--fp8-spec-version",
        metavar="X.Y",
        help="the spec version the backend is checked against: properties added later are "
        "skipped as not_supported (reason not_in_spec_version). Default: the backend's "
        f"spec_version (conformance.Backend's default: {SPEC_VERSION}).",
    )
    group.addoption(
        "--fp8-timeout",
        metavar="SECONDS",
        type=float,
        default=DEFAULT_TIMEOUT,
        help="pytest-timeout of each conformance test, restarted at every Hypothesis example "
        f"(default {DEFAULT_TIMEOUT:g}; 0 leaves pytest-timeout's own settings). A test with "
        "an example that runs longer is reported 'error', naming the backend method in "
        "progress.",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(
    early_config: pytest.Config, parser: pytest.Parser, args: list[str]
) -> None:
    # Injecting the path into the command line here, before pytest decides its initial paths,
    # makes it an ordinary argument: the conftest.py of the properties dir loads as an initial
    # conftest, while the rootdir, already decided, stays the user's.
    namespace = early_config.known_args_namespace
    if getattr(namespace, "fp8_backend", None) and not namespace.file_or_dir:
        args.append(str(PROPERTIES_DIR))
        namespace.file_or_dir = [str(PROPERTIES_DIR)]


# tryfirst: the profiles must exist before Hypothesis's own plugin loads --hypothesis-profile.
@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    for line in _MARKERS:
        config.addinivalue_line("markers", line)
    _configure_hypothesis(config)
    spec = config.getoption("fp8_backend")
    if not spec:
        for option in ("report", "expectations", "spec_version"):
            if config.getoption("fp8_" + option):
                raise pytest.UsageError(f"--fp8-{option.replace('_', '-')} needs --fp8-backend")
        return
    run = ConformanceRun(config, spec, load_backend(spec))
    config.stash[_RUN_KEY] = run
    config.pluginmanager.register(run, "fp8conf-run")


def _configure_hypothesis(config: pytest.Config) -> None:
    # Without an explicit parent a profile inherits whatever profile is loaded right now.
    base = settings.get_profile("default")
    for name, values in _PROFILES.items():
        settings.register_profile(
            name, base, deadline=None, suppress_health_check=_HEALTH_CHECKS, **values
        )
    if config.getoption("--hypothesis-profile", None):
        return  # Hypothesis's plugin loads it right after this hook
    name = os.environ.get(PROFILE_ENV) or "dev"
    try:
        settings.load_profile(name)
    except InvalidArgument as exc:
        raise pytest.UsageError(f"{PROFILE_ENV}={name!r}: {exc}") from None


@pytest.fixture(scope="session")
def fp8_backend(request: pytest.FixtureRequest) -> Backend:
    """The backend under test, one instance for the whole session."""
    run = request.config.stash.get(_RUN_KEY, None)
    if run is None:
        pytest.skip("no --fp8-backend given")
    return run.backend


@pytest.fixture(scope="session")
def warm_inductor() -> None:
    """Inductor's one-time start in a process (its imports, the C++ toolchain probe, the first
    build) paid once, before the first compile property's Hypothesis loop, so that the first
    example is not charged for it. It compiles a plain function, not the backend's graph."""
    import torch

    torch.compile(lambda x: torch.relu(x) * 2, backend="inductor", fullgraph=True)(torch.ones(8))


# -- backend loading -----------------------------------------------------------------------------
def load_backend(spec: str) -> Backend:
    """Instantiate the backend ``spec`` names; any failure becomes a one-paragraph UsageError."""
    cls = _backend_class(spec)
    try:
        return cls()
    except Exception as exc:
        raise pytest.UsageError(_failure(spec, "could not be constructed", exc)) from None


def _backend_class(spec: str) -> type[Backend]:
    if ":" in spec:
        module_name, _, qualname = spec.partition(":")

        def load() -> object:
            obj: object = importlib.import_module(module_name)
            for attr in qualname.split("."):
                obj = getattr(obj, attr)
            return obj

    else:
        # Only the names are read here: listing must not import any backend's module.
        entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        if spec not in entry_points.names:
            installed = ", ".join(sorted(entry_points.names)) or "none"
            raise pytest.UsageError(
                f"unknown fp8conf backend {spec!r}; installed backends: {installed}. "
                "Pass an installed name or --fp8-backend=package.module:Class."
            )
        load = entry_points[spec].load
    try:
        obj = load()
    except Exception as exc:
        raise pytest.UsageError(_failure(spec, "could not be imported", exc)) from None
    if not (isinstance(obj, type) and issubclass(obj, Backend)):
        raise pytest.UsageError(
            f"fp8conf backend {spec!r} is {obj!r}, which is not a subclass of conformance.Backend."
        )
    return obj


def _failure(spec: str, what: str, exc: BaseException) -> str:
    message = " ".join(str(exc).split())  # one paragraph even for multi-line messages
    return f"fp8conf backend {spec!r} {what}: {type(exc).__name__}: {message}"


# -- active with a backend -----------------------------------------------------------------------
class _CitationError(Exception):
    """A test cites a property that is not in the registry, or cites it wrongly."""


def _cited_ids(item: pytest.Item) -> list[str]:
    ids: list[str] = []
    for mark in item.iter_markers(name="fp8_property"):
        if len(mark.args) != 1 or mark.kwargs or not isinstance(mark.args[0], str):
            raise _CitationError(
                f"{item.nodeid}: fp8_property takes one property ID, got "
                f"args={mark.args!r} kwargs={mark.kwargs!r}"
            )
        property_id = mark.args[0]
        try:
            get_property(property_id)
        except KeyError:
            raise _CitationError(
                f"{item.nodeid} cites unknown spec property {property_id!r} "
                "(not in conformance.api.spec.PROPERTIES)"
            ) from None
        if property_id not in ids:
            ids.append(property_id)
    return ids


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip GPU-marked tests the device cannot run, in any pytest run (fp8conf's own tests too).

    With a backend, :class:`ConformanceRun` does it together with capability gating.
    """
    if config.stash.get(_RUN_KEY, None) is not None:
        return
    gpu_items = [item for item in items if any(item.get_closest_marker(name) for name in _GPU_MARKERS)]
    for item, reason in (_gpu_skip_reasons(gpu_items) if gpu_items else {}).items():
        item.add_marker(pytest.mark.skip(reason=reason))


def _gpu_skip_reasons(items: list[pytest.Item]) -> dict[pytest.Item, str]:
    import torch  # only now: a collected test asked for a GPU

    have = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    reasons = {}
    for item in items:
        for name, need in _GPU_MARKERS.items():
            if item.get_closest_marker(name) is None:
                continue
            if have is None:
                reasons[item] = f"{name}: CUDA is not available"
                break
            if need is not None and have < need:
                reasons[item] = (
                    f"{name}: needs compute capability {need[0]}.{need[1]}, "
                    f"the device has {have[0]}.{have[1]}"
                )
                break
    return reasons


def _skip_reason(report: pytest.TestReport) -> str:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
    return reason.removeprefix("Skipped: ")


def _test_status(report: pytest.TestReport) -> str | None:
    """This phase's contribution to the test's status; None for a passing setup/teardown.

    A failure outside the call phase, a timeout (``--fp8-timeout``) and a test that crashed its
    xdist worker are ``error``; an expected failure is ``xfail`` and a pass under an
    expectation ``xpass``.
    """
    if hasattr(report, "wasxfail"):
        if report.skipped:
            return "xfail"
        if report.passed:
            return "xpass"
    if report.failed:
        timed_out = any(key == _TIMEOUT_KEY for key, _ in report.user_properties)
        return "fail" if report.when == "call" and not timed_out else "error"
    if report.skipped:
        reason = _skip_reason(report)
        return "not_supported" if reason.startswith((_NOT_SUPPORTED, _NOT_IN_SPEC)) else "skipped"
    return "pass" if report.when == "call" else None


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def _checked_spec_version(config: pytest.Config, backend: Backend) -> str:
    given = config.getoption("fp8_spec_version")
    version = str(given or getattr(backend, "spec_version", None) or SPEC_VERSION)
    if not _VERSION.match(version):
        where = "--fp8-spec-version" if given else f"backend {backend.name!r}: spec_version"
        raise pytest.UsageError(f"{where} {version!r} is not a version like {SPEC_VERSION!r}")
    return version


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


def _device_info() -> dict[str, Any] | None:
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


def _examples_from_statistics(stats: dict[str, Any]) -> int:
    """Test cases Hypothesis ran to a verdict, shrinking not included."""
    total = 0
    for key, phase in stats.items():
        if key.endswith("-phase") and key != "shrink-phase" and isinstance(phase, dict):
            total += sum(
                case.get("status") in ("valid", "interesting") for case in phase.get("test-cases", ())
            )
    return total


def _version_if_importable(module: str) -> str | None:
    loaded = sys.modules.get(module)
    if loaded is not None:
        return getattr(loaded, "__version__", None)
    if importlib.util.find_spec(module) is None:
        return None
    try:
        return importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclasses.dataclass
class _TestRecord:
    property_ids: tuple[str, ...]
    status: str | None = None
    examples: int = 0
    reproducer: dict[str, Any] | None = None
    reason: str | None = None
    expectations: tuple[str, ...] = ()


class ConformanceRun:
    """Per-session state and hooks; registered only when ``--fp8-backend`` is given."""

    def __init__(self, config: pytest.Config, spec: str, backend: Backend) -> None:
        self.config = config
        self.spec = spec
        # Tracked: a timeout names the adapter method in progress.
        self.backend = watchdog.track(backend)
        self.tests: dict[str, _TestRecord] = {}
        self.report_path: Path | None = None
        self.spec_version = _checked_spec_version(config, backend)
        self.expectations = _load_expectations(config)
        seconds = config.getoption("fp8_timeout")
        if seconds is not None and seconds < 0:
            raise pytest.UsageError(f"--fp8-timeout must be 0 or more seconds, got {seconds:g}")
        #: The accelerator: seen here, or reported by the first xdist worker that saw it.
        self.device: dict[str, Any] | None = None
        self._device_sent = False

    # A hook wrapper turns a bad citation into an ordinary collection error, which
    # pytest-xdist reports cleanly from a worker, unlike an exception in a later hook.
    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(
        self, collector: pytest.Collector
    ) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
        report = yield
        if report.passed:
            problems = []
            for node in report.result:
                if isinstance(node, pytest.Item):
                    try:
                        _cited_ids(node)
                    except _CitationError as exc:
                        problems.append(str(exc))
            if problems:
                report.outcome = "failed"
                report.longrepr = "\n".join(problems)
                report.result = []
        return report

    # tryfirst: before -k / -m deselect, so expectations are matched against every collected test.
    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        claimed = set(self.backend.capabilities)
        checked = _version_tuple(self.spec_version)
        timeout = self.timeout
        matched: set[str] = set()
        gpu_items = []
        for item in items:
            ids = _cited_ids(item)
            # user_properties travel with every report, also from xdist workers.
            item.user_properties.extend((PROPERTY_KEY, property_id) for property_id in ids)
            if ids:
                item.stash[_CITED_KEY] = True
                if timeout is not None and item.get_closest_marker("timeout") is None:
                    item.add_marker(pytest.mark.timeout(timeout))
            expected = expectations_file.matching(self.expectations, item.nodeid, ids)
            if expected:
                matched.update(entry.key for entry in expected)
                item.user_properties.extend((_EXPECTATION_KEY, entry.key) for entry in expected)
                reason = "; ".join(entry.describe() for entry in expected)
                item.add_marker(pytest.mark.xfail(reason=reason, strict=False))
                item.stash[_EXPECTED_KEY] = True
            newer = [
                f"property {pid} is since spec {get_property(pid).since}"
                for pid in ids
                if _version_tuple(get_property(pid).since) > checked
            ]
            missing = [
                f"capability {get_property(pid).capability!r} (property {pid})"
                for pid in ids
                if get_property(pid).capability not in claimed
            ]
            if newer:
                reason = (
                    f"{_NOT_IN_SPEC} backend {self.backend.name!r} is checked against spec "
                    f"{self.spec_version}; "
                )
                item.add_marker(pytest.mark.skip(reason=reason + "; ".join(newer)))
            elif missing:
                reason = f"{_NOT_SUPPORTED} backend {self.backend.name!r} does not claim "
                item.add_marker(pytest.mark.skip(reason=reason + "; ".join(missing)))
            elif any(item.get_closest_marker(name) for name in _GPU_MARKERS):
                gpu_items.append(item)
        for item, reason in (_gpu_skip_reasons(gpu_items) if gpu_items else {}).items():
            item.add_marker(pytest.mark.skip(reason=reason))
        unmatched = [key for key in self.expectations if key not in matched]
        if unmatched:
            self._unmatched_expectations(unmatched, items)

    def _unmatched_expectations(self, unmatched: list[str], items: list[pytest.Item]) -> None:
        message = "--fp8-expectations: " + "; ".join(
            f"entry {key!r} matches no collected test" for key in unmatched
        )
        if not self._is_xdist_worker:
            raise pytest.UsageError(message)
        # An exception here would crash the worker; a failed collect report with nothing left
        # to run ends the session with the message as a collection error.
        report = pytest.CollectReport("fp8conf-expectations", "failed", message, [])
        self.config.hook.pytest_collectreport(report=report)
        self.config.hook.pytest_deselected(items=list(items))
        items[:] = []

    # trylast: inside Hypothesis's own wrapper, which installs its statistics collector and may
    # replace the test's settings first.
    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, Any, Any]:
        handle = getattr(item.obj, "hypothesis", None)
        if handle is None or not item.stash.get(_CITED_KEY, False):
            return (yield)
        from hypothesis.statistics import collector

        function = getattr(item.obj, "__func__", item.obj)
        original_settings = getattr(function, "_hypothesis_internal_use_settings", None)
        inner = handle.inner_test
        previous_collector = collector.value
        item.stash[_CALLS_KEY] = 0

        def note_statistics(stats: dict[str, Any]) -> None:
            item.stash[_STATS_KEY] = stats
            if previous_collector is not None:
                previous_collector(stats)

        @functools.wraps(inner)
        def counted(*args: Any, **kwargs: Any) -> Any:
            item.stash[_CALLS_KEY] += 1
            watchdog.rearm()  # the timeout bounds one example, not the whole search
            return inner(*args, **kwargs)

        handle.inner_test = counted
        if item.stash.get(_EXPECTED_KEY, False) and original_settings is not None:
            # An expected failure needs no minimal example: skip shrinking (minutes on models).
            phases = [p for p in original_settings.phases if p not in _SHRINK_PHASES]
            function._hypothesis_internal_use_settings = settings(parent=original_settings, phases=phases)
        try:
            with collector.with_value(note_statistics):
                return (yield)
        finally:
            handle.inner_test = inner
            if original_settings is not None:
                function._hypothesis_internal_use_settings = original_settings

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        report = yield
        if not item.stash.get(_CITED_KEY, False):
            return report
        extra = report.user_properties  # this report's own copy of item.user_properties
        excinfo = call.excinfo
        if call.when == "call":
            extra.append((_EXAMPLES_KEY, self._examples(item, excinfo)))
            if not self._device_sent:
                info = _device_info()
                if info is not None:
                    self._device_sent = True
                    extra.append((_DEVICE_KEY, info))
        if excinfo is not None and not excinfo.errisinstance(pytest.skip.Exception):
            if excinfo.errisinstance(watchdog.BackendTimeout):
                extra.append((_TIMEOUT_KEY, str(excinfo.value)))
            if report.failed or hasattr(report, "wasxfail"):
                found = replay.reproducer(item, excinfo.value, self.spec)
                extra.append((_REPRODUCER_KEY, found))
                if report.failed:
                    report.sections.append(("fp8conf reproducer", replay.section_text(found)))
        return report

    @staticmethod
    def _examples(item: pytest.Item, excinfo: pytest.ExceptionInfo | None) -> int:
        stats = item.stash.get(_STATS_KEY, None)
        if stats is not None:
            return _examples_from_statistics(stats)
        calls = item.stash.get(_CALLS_KEY, None)
        if calls is not None:  # a Hypothesis test cut short (a timeout): the calls made
            return calls
        # A plain test is one example when its body ran.
        return 0 if excinfo is not None and excinfo.errisinstance(pytest.skip.Exception) else 1

    # optionalhook: the hook exists only while pytest-timeout is active.
    @pytest.hookimpl(optionalhook=True)
    def pytest_timeout_set_timer(self, item: pytest.Item, settings: Any) -> bool | None:
        if not item.stash.get(_CITED_KEY, False):
            return None  # pytest-timeout's own timer
        on_thread_timeout = None
        if self._is_xdist_worker:
            on_thread_timeout = functools.partial(self._report_thread_timeout, item)
        return watchdog.set_timer(item, settings, self.backend.name, on_thread_timeout)

    def _report_thread_timeout(self, item: pytest.Item, message: str) -> None:
        """Under pytest-timeout's thread method the worker is about to end: send the controller
        a report of the timeout (pytest-xdist adds its own report of the crash)."""
        found = replay.reproducer(item, watchdog.BackendTimeout(message), self.spec)
        report = pytest.TestReport(
            item.nodeid,
            item.location,
            {name: 1 for name in item.keywords},
            "failed",
            f"conformance.watchdog.BackendTimeout: {message}",
            "call",
            user_properties=[*item.user_properties, (_TIMEOUT_KEY, message), (_REPRODUCER_KEY, found)],
        )
        item.ihook.pytest_runtest_logreport(report=report)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        ids = tuple(value for key, value in report.user_properties if key == PROPERTY_KEY)
        record = self.tests.get(report.nodeid)
        if record is None:
            if not ids:
                return
            record = self.tests[report.nodeid] = _TestRecord(ids)
        # else: also a report without user_properties, as pytest-xdist makes for a test that
        # crashed its worker: the test's earlier setup report told its properties.
        for key, value in report.user_properties:
            if key == _EXAMPLES_KEY:
                record.examples += int(value)
            elif key == _REPRODUCER_KEY and record.reproducer is None:
                record.reproducer = dict(value)
            elif key == _EXPECTATION_KEY and value not in record.expectations:
                record.expectations += (value,)
            elif key == _DEVICE_KEY and self.device is None:
                self.device = dict(value)
        status = _test_status(report)
        if status is None:
            return
        if status in ("not_supported", "skipped") and record.reason is None:
            record.reason = _skip_reason(report) or None
        if record.status is None or _RANK[status] < _RANK[record.status]:
            record.status = status

    def pytest_report_header(self) -> str:
        return (
            f"fp8conf: backend {self.backend.name!r} {self.backend.version}, "
            f"capabilities: {', '.join(sorted(self.backend.capabilities)) or 'none'}, "
            f"spec {self.spec_version}"
        )

    @functools.cached_property
    def timeout(self) -> float | None:
        """``--fp8-timeout`` in seconds, or None when pytest-timeout's own settings apply."""
        return _timeout(self.config)

    @property
    def _is_xdist_worker(self) -> bool:
        return hasattr(self.config, "workerinput")

    def pytest_sessionfinish(self) -> None:
        path = self.config.getoption("fp8_report")
        if path and not self._is_xdist_worker:
            self.report_path = self.config.invocation_params.dir / path
            _write_report(self.build_report(), self.report_path)

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self._is_xdist_worker:
            _print_summary(terminalreporter, self.build_report(), self.report_path)

    def build_report(self) -> dict[str, Any]:
        """The report as plain JSON-ready data; see ``--fp8-report`` and the README."""
        by_property: dict[str, list[_TestRecord]] = {}
        for _, record in sorted(self.tests.items()):
            for property_id in record.property_ids:
                by_property.setdefault(property_id, []).append(record)
        rows = {}
        for property_id, prop in PROPERTIES.items():
            if property_id in by_property:
                rows[property_id] = self._row(prop, by_property[property_id])
        device = self.device or _device_info() or {"device": "cpu", "compute_capability": None}
        return {
            "schema_version": REPORT_SCHEMA_VERSION,
            "suite": {"name": "fp8conf", "version": _version_if_importable("fp8conf")},
            "spec_version": SPEC_VERSION,
            "checked_spec_version": self.spec_version,
            "backend": {
                "name": self.backend.name,
                "version": self.backend.version,
                "spec": self.spec,
                "spec_version": getattr(self.backend, "spec_version", SPEC_VERSION),
                "capabilities": sorted(self.backend.capabilities),
            },
            "environment": {
                "python": platform.python_version(),
                "torch": _version_if_importable("torch"),
                "torchao": _version_if_importable("torchao"),
                "pytest": pytest.__version__,
                "hypothesis": hypothesis.__version__,
                "hypothesis_profile": settings.get_current_profile_name(),
                "device": device["device"],
                "compute_capability": device["compute_capability"],
            },
            "options": {
                "expectations": self.config.getoption("fp8_expectations") or None,
                "timeout_s": self.timeout,
            },
            "summary": _must_summary(rows),
            "properties": rows,
            "untested": [pid for pid in PROPERTIES if pid not in rows],
        }

    def _row(self, prop: Any, records: list[_TestRecord]) -> dict[str, Any]:
        statuses = [record.status or "skipped" for record in records]
        status = min(statuses, key=_RANK.__getitem__)
        deciding = [record for record in records if (record.status or "skipped") == status]
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
            row["reproducer"] = next((r.reproducer for r in deciding if r.reproducer), None)
        if status in ("not_supported", "skipped"):
            row["reason"] = next((r.reason for r in deciding if r.reason), None)
        keys = sorted({key for record in records for key in record.expectations})
        if keys:
            row["expectations"] = {
                key: self.expectations[key].as_json() for key in keys if key in self.expectations
            }
        return row


def _must_summary(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    # An expected failure is applicable and not passed; an xpass passed all its tests.
    applicable = [
        row for row in rows.values()
        if row["level"] == "MUST" and row["status"] not in ("not_supported", "skipped")
    ]
    passed = sum(row["status"] in ("pass", "xpass") for row in applicable)
    return {
        "must_passed": passed,
        "must_applicable": len(applicable),
        "must_score": passed / len(applicable) if applicable else None,
        "statuses": dict(Counter(row["status"] for row in rows.values())),
    }


def _score_line(report: dict[str, Any]) -> str:
    summary, backend = report["summary"], report["backend"]
    return (
        f"MUST score: {summary['must_passed']}/{summary['must_applicable']} "
        f"(backend {backend['name']} {backend['version']})"
    )


_COLUMNS = (
    ("property", 10), ("level", 7), ("capability", 17), ("status", 14), ("tests", 5), ("examples", 9)
)


def _table_line(cells: tuple) -> str:
    widths = [width for _, width in _COLUMNS]
    text = "".join(f"{cell:<{w}}" for cell, w in zip(cells[:4], widths))
    return text + "".join(f"{cell:>{w}}" for cell, w in zip(cells[4:], widths[4:]))


def _print_summary(
    terminal: pytest.TerminalReporter, report: dict[str, Any], report_path: Path | None
) -> None:
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
    terminal.write_line(_score_line(report))
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
        terminal.write_line(f"report: {report_path} and {_markdown_path(report_path)}")


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _markdown(report: dict[str, Any]) -> str:
    backend, env, suite = report["backend"], report["environment"], report["suite"]
    capability = env["compute_capability"]
    options = report.get("options", {})
    lines = [
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
        f"{'`' + options['expectations'] + '`' if options.get('expectations') else 'none'}",
        "",
        "| Property | Level | Capability | Status | Tests | Examples | Title |",
        "|---|---|---|---|---:|---:|---|",
    ]
    for property_id, row in report["properties"].items():
        lines.append(
            f"| {property_id} | {row['level']} | {row['capability']} | {row['status']} "
            f"| {row['tests']} | {row['examples']} | {_cell(row['title'])} |"
        )
    lines += ["", f"**{_score_line(report)}**", ""]
    notes = []
    for property_id, row in report["properties"].items():
        for key, entry in row.get("expectations", {}).items():
            link = f" ({entry['link']})" if entry.get("link") else ""
            notes.append(f"- {property_id} {row['status']}: expected to fail ({key}): {entry['reason']}{link}")
        if row.get("reason"):
            notes.append(f"- {property_id} {row['status']}: {row['reason']}")
    if notes:
        lines += ["## Notes", "", *notes, ""]
    failures = [
        (property_id, row) for property_id, row in report["properties"].items() if row.get("reproducer")
    ]
    if failures:
        lines += ["## Failures", ""]
    for property_id, row in failures:
        found = row["reproducer"]
        lines += [
            f"### {property_id} ({row['status']})",
            "",
            f"Test `{found['test']}`:",
            "",
            "```text",
            found["message"],
            "```",
            "",
            "Replay:",
            "",
            "```bash",
            found["command"],
            "```",
            "",
        ]
        if found.get("model"):
            lines += ["Minimal model (runnable):", "", "```python", found["model"].rstrip("\n"), "```", ""]
        elif found.get("failing_case"):
            lines += ["Failing test case:", "", "```python", found["failing_case"], "```", ""]
        if found.get("reproduce_failure"):
            lines += [f"Or decorate the test with `{found['reproduce_failure']}`.", ""]
    return "\n".join(lines)


def _markdown_path(path: Path) -> Path:
    markdown = path.with_suffix(".md")
    # For PATH ending in .md, keep the JSON rather than overwrite it.
    return path.with_name(path.name + ".md") if markdown == path else markdown


def _write_report(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    _markdown_path(path).write_text(_markdown(report), encoding="utf-8")

