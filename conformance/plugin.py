"""The pytest plugin of the conformance suite (entry point ``pytest11: fp8conf``).

Without ``--fp8-backend`` it only registers its options, markers and the Hypothesis profiles
``dev`` / ``ci`` / ``thorough`` (``dev`` is loaded unless ``--hypothesis-profile`` or
``$FP8CONF_HYPOTHESIS_PROFILE`` picks another), so installing fp8conf leaves other pytest runs
alone. With ``--fp8-backend=NAME`` (an entry
point of the group ``fp8conf.backends``) or ``--fp8-backend=package.module:Class`` it:

* loads and instantiates the backend once per session (fixture ``fp8_backend``);
* collects ``conformance/properties/`` of the installed package when no test path is given;
* checks every ``@pytest.mark.fp8_property(ID)`` against :mod:`conformance.spec` and skips a
  test as ``not_supported`` when the backend does not claim the property's capability;
* skips ``gpu`` / ``sm89`` / ``sm90`` / ``sm100`` tests the local device cannot run;
* prints a per-property summary and, with ``--fp8-report=PATH``, writes it as JSON at PATH and
  as Markdown next to it (suffix ``.md``).

Outcomes are gathered from ``pytest_runtest_logreport``, which pytest-xdist forwards from its
workers to the controller, and the property IDs travel inside ``report.user_properties``.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Generator

import hypothesis
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.errors import InvalidArgument

import conformance
from conformance.adapter import Backend
from conformance.spec import PROPERTIES, SPEC_VERSION, get_property

__all__ = [
    "ENTRY_POINT_GROUP",
    "PROFILE_ENV",
    "PROPERTIES_DIR",
    "PROPERTY_KEY",
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
#: the passing CPU ones.
STATUSES = ("fail", "error", "pass", "not_supported", "skipped")
_RANK = {status: rank for rank, status in enumerate(STATUSES)}
_NOT_SUPPORTED = "not_supported:"
_RUN_KEY = pytest.StashKey["ConformanceRun"]()

#: Minimum CUDA compute capability per marker; ``None``: any CUDA device.
_GPU_MARKERS: dict[str, tuple[int, int] | None] = {
    "gpu": None,
    "sm89": (8, 9),
    "sm90": (9, 0),
    "sm100": (10, 0),
}
_MARKERS = (
    "fp8_property(id): the test checks spec property `id` of conformance.spec; it is skipped "
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
)
_NO_SHRINK = (hypothesis.Phase.explicit, hypothesis.Phase.reuse, hypothesis.Phase.generate)

_PROFILES: dict[str, dict[str, Any]] = {
    "dev": {"max_examples": 10},
    "ci": {"derandomize": True, "max_examples": 6, "database": None, "print_blob": True},
    "thorough": {"max_examples": 200},
    # For proving that a mutant backend is caught: a failure is enough, a minimal one is not
    # needed, so shrinking (minutes on traced models) is skipped.
    "mutants": {"derandomize": True, "max_examples": 12, "database": None, "phases": _NO_SHRINK},
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
        if config.getoption("fp8_report"):
            raise pytest.UsageError("--fp8-report needs --fp8-backend")
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
                "(not in conformance.spec.PROPERTIES)"
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


def _test_status(report: pytest.TestReport) -> str | None:
    """This phase's contribution to the test's status; None for a passing setup/teardown."""
    if report.failed:
        return "fail" if report.when == "call" else "error"
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
        reason = reason.removeprefix("Skipped: ")
        return "not_supported" if reason.startswith(_NOT_SUPPORTED) else "skipped"
    return "pass" if report.when == "call" else None


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


class ConformanceRun:
    """Per-session state and hooks; registered only when ``--fp8-backend`` is given."""

    def __init__(self, config: pytest.Config, spec: str, backend: Backend) -> None:
        self.config = config
        self.spec = spec
        self.backend = backend
        self.tests: dict[str, _TestRecord] = {}
        self.report_path: Path | None = None

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

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        claimed = set(self.backend.capabilities)
        gpu_items = []
        for item in items:
            ids = _cited_ids(item)
            # user_properties travel with every report, also from xdist workers.
            item.user_properties.extend((PROPERTY_KEY, property_id) for property_id in ids)
            missing = [
                f"capability {get_property(pid).capability!r} (property {pid})"
                for pid in ids
                if get_property(pid).capability not in claimed
            ]
            if missing:
                reason = f"{_NOT_SUPPORTED} backend {self.backend.name!r} does not claim "
                item.add_marker(pytest.mark.skip(reason=reason + "; ".join(missing)))
            elif any(item.get_closest_marker(name) for name in _GPU_MARKERS):
                gpu_items.append(item)
        for item, reason in (_gpu_skip_reasons(gpu_items) if gpu_items else {}).items():
            item.add_marker(pytest.mark.skip(reason=reason))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        ids = tuple(value for key, value in report.user_properties if key == PROPERTY_KEY)
        status = _test_status(report)
        if not ids or status is None:
            return
        record = self.tests.setdefault(report.nodeid, _TestRecord(ids))
        if record.status is None or _RANK[status] < _RANK[record.status]:
            record.status = status

    def pytest_report_header(self) -> str:
        return (
            f"fp8conf: backend {self.backend.name!r} {self.backend.version}, "
            f"capabilities: {', '.join(sorted(self.backend.capabilities)) or 'none'}"
        )

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
        """The report as plain JSON-ready data; see ``--fp8-report``."""
        by_property: dict[str, list[str]] = {}
        for record in self.tests.values():
            for property_id in record.property_ids:
                by_property.setdefault(property_id, []).append(record.status or "skipped")
        rows = {}
        for property_id, prop in PROPERTIES.items():
            if property_id in by_property:
                statuses = by_property[property_id]
                rows[property_id] = {
                    "level": prop.level,
                    "capability": prop.capability,
                    "title": prop.title,
                    "status": min(statuses, key=_RANK.__getitem__),
                    "tests": len(statuses),
                    "outcomes": dict(sorted(Counter(statuses).items())),
                }
        return {
            "spec_version": SPEC_VERSION,
            "backend": {
                "name": self.backend.name,
                "version": self.backend.version,
                "spec": self.spec,
                "capabilities": sorted(self.backend.capabilities),
            },
            "environment": {
                "python": platform.python_version(),
                "torch": _version_if_importable("torch"),
                "torchao": _version_if_importable("torchao"),
                "pytest": pytest.__version__,
                "hypothesis": hypothesis.__version__,
                "hypothesis_profile": settings.get_current_profile_name(),
            },
            "summary": _must_summary(rows),
            "properties": rows,
            "untested": [pid for pid in PROPERTIES if pid not in rows],
        }


def _must_summary(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    applicable = [
        row for row in rows.values()
        if row["level"] == "MUST" and row["status"] not in ("not_supported", "skipped")
    ]
    passed = sum(row["status"] == "pass" for row in applicable)
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


_COLUMNS = (("property", 10), ("level", 7), ("capability", 17), ("status", 14), ("tests", 5))


def _table_line(cells: tuple) -> str:
    *text, count = cells
    widths = [width for _, width in _COLUMNS]
    return "".join(f"{cell:<{w}}" for cell, w in zip(text, widths)) + f"{count:>{widths[-1]}}"


def _print_summary(
    terminal: pytest.TerminalReporter, report: dict[str, Any], report_path: Path | None
) -> None:
    terminal.write_sep("=", "fp8conf conformance")
    rows = report["properties"]
    if rows:
        terminal.write_line(_table_line(tuple(name for name, _ in _COLUMNS)))
        for property_id, row in rows.items():
            cells = (property_id, row["level"], row["capability"], row["status"], row["tests"])
            terminal.write_line(_table_line(cells))
    else:
        terminal.write_line("no fp8_property test ran")
    terminal.write_line(_score_line(report))
    if report_path is not None:
        terminal.write_line(f"report: {report_path} and {_markdown_path(report_path)}")


def _markdown(report: dict[str, Any]) -> str:
    backend, env = report["backend"], report["environment"]
    lines = [
        "# fp8conf conformance report",
        "",
        f"- Backend: `{backend['name']}` {backend['version']} (`{backend['spec']}`)",
        f"- Capabilities: {', '.join(backend['capabilities']) or 'none'}",
        f"- Spec {report['spec_version']}; Python {env['python']}; torch {env['torch']}; "
        f"torchao {env['torchao']}; Hypothesis profile `{env['hypothesis_profile']}`",
        "",
        "| Property | Level | Capability | Status | Tests | Title |",
        "|---|---|---|---|---:|---|",
    ]
    for property_id, row in report["properties"].items():
        title = row["title"].replace("|", "\\|")
        lines.append(
            f"| {property_id} | {row['level']} | {row['capability']} | {row['status']} "
            f"| {row['tests']} | {title} |"
        )
    lines += ["", f"**{_score_line(report)}**", ""]
    return "\n".join(lines)


def _markdown_path(path: Path) -> Path:
    markdown = path.with_suffix(".md")
    # For PATH ending in .md, keep the JSON rather than overwrite it.
    return path.with_name(path.name + ".md") if markdown == path else markdown


def _write_report(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    _markdown_path(path).write_text(_markdown(report), encoding="utf-8")

