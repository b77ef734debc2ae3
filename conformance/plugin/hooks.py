"""The plugin's always-registered hooks and fixtures.

Installed everywhere, they change nothing until ``--fp8-backend`` is given: without it they
register the ``--fp8-*`` options and the names of fp8conf's markers, and return (``--fp8-report``
without it is a usage error, which removes an earlier run's report there, as any run ending before
its first test does). Hypothesis, torch and the rest of the run's machinery
(:mod:`conformance.plugin.run`) are imported only for a run with a backend.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import conformance
from conformance.api import SPEC_VERSION, Backend
from conformance.run import gating
from conformance.plugin import profiles, usage
from conformance.plugin.profiles import DEFAULT_SHRINK_SECONDS, DEFAULT_SHRINKS
from conformance.run.loading import ENTRY_POINT_GROUP, load_backend

__all__ = [
    "DEFAULT_TIMEOUT",
    "PROPERTIES_DIR",
    "fp8_backend",
    "fp8_device",
    "pytest_addoption",
    "pytest_configure",
    "pytest_load_initial_conftests",
    "warm_inductor",
]

#: The suite's own property tests, collected when ``--fp8-backend`` comes without test paths.
PROPERTIES_DIR = Path(conformance.__file__).resolve().parent / "properties"
#: Default of ``--fp8-timeout``: seconds per example of a conformance test (a plain test is one
#: example); the timer restarts at every Hypothesis example.
DEFAULT_TIMEOUT = 300.0
_RUN_KEY = pytest.StashKey[object]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fp8conf", "fp8conf conformance suite")
    group.addoption(
        "--fp8-backend",
        metavar="NAME|MODULE:CLASS",
        help=f"check this backend: an entry point of group {ENTRY_POINT_GROUP!r} or "
        "package.module:Class. Without test paths, runs the suite's own property tests. "
        "Only with it does the plugin do anything (Hypothesis profiles fp8conf-dev/-ci/"
        "-thorough, fp8_gpu/fp8_sm* gating, the report); an empty value is a usage error.",
    )
    group.addoption(
        "--fp8-report",
        metavar="PATH",
        help="write the conformance report as JSON at PATH and as Markdown at PATH with "
        "suffix .md (needs --fp8-backend), each whole or not at all; it says how the run ended. "
        "A run that ends before its first test writes none and removes an earlier one there.",
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
        "--fp8-device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="build, trace and check the drawn models on this device (default cpu): a backend "
        "whose passes look only at CUDA nodes is judged with cuda. Checked before the first test: "
        "cuda without a usable CUDA device is a usage error.",
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
    group.addoption(
        "--fp8-property",
        metavar="ID|AREA",
        action="append",
        default=[],
        help="run only the tests of this spec property (PROV-003) or area (PROV); repeatable. "
        "Unlike -k, it matches the property a test cites, not words in its name.",
    )
    group.addoption(
        "--fp8-shrinks",
        metavar="N",
        type=int,
        default=DEFAULT_SHRINKS,
        help="how many times Hypothesis may shrink the failing example of one test (default "
        f"{DEFAULT_SHRINKS}; 0: show the first failing example). A count, so that the model a "
        "failure shows is the same on a busy machine as on an idle one.",
    )
    group.addoption(
        "--fp8-shrink-seconds",
        metavar="SECONDS",
        type=float,
        default=DEFAULT_SHRINK_SECONDS,
        help="a guard on the time Hypothesis may shrink the failing example of one test (default "
        f"{DEFAULT_SHRINK_SECONDS:g}; 0: show the first failing example). A failure whose "
        "example takes more than a tenth of this is not shrunk; the report says whether the "
        "model it shows was, and whether this guard ended the shrink.",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(
    early_config: pytest.Config, parser: pytest.Parser, args: list[str]
) -> None:
    namespace = early_config.known_args_namespace
    report = getattr(namespace, "fp8_report", None)
    if report and report.strip():
        # First, so that a run ending anywhere after this (a usage error, Ctrl-C while a conftest
        # imports torch) leaves no earlier report to read as its own.
        from conformance.plugin.ending import remove_earlier_report_unless_written

        remove_earlier_report_unless_written(early_config, report)
    # Injecting the path into the command line here, before pytest decides its initial paths,
    # makes it an ordinary argument: the conftest.py of the properties dir loads as an initial
    # conftest, while the rootdir, already decided, stays the user's.
    spec = getattr(namespace, "fp8_backend", None)
    if spec is not None:
        # Before the properties' conftest imports Hypothesis: a missing extra is one line.
        usage.require_suite_dependencies()
    if spec and spec.strip() and not namespace.file_or_dir:
        args.append(str(PROPERTIES_DIR))
        namespace.file_or_dir = [str(PROPERTIES_DIR)]


# tryfirst: the profiles must exist before Hypothesis's own plugin loads --hypothesis-profile.
@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    gating.add_markers(config)
    spec = usage.checked_backend_spec(config)
    if spec is None:
        for option in ("report", "expectations", "spec_version", "property"):
            if config.getoption("fp8_" + option):
                raise pytest.UsageError(f"--fp8-{option.replace('_', '-')} needs --fp8-backend")
        return
    profiles.register_profiles()
    profiles.load_profile(config, accept_legacy_names=True)
    from conformance.plugin.run import ConformanceRun

    run = ConformanceRun(config, spec, load_backend(spec))
    config.stash[_RUN_KEY] = run
    config.pluginmanager.register(run, "fp8conf-run")


@pytest.fixture(scope="session")
def fp8_backend(request: pytest.FixtureRequest) -> Backend:
    """The backend under test, one instance for the whole session."""
    run = request.config.stash.get(_RUN_KEY, None)
    if run is None:
        pytest.skip("no --fp8-backend given")
    return run.backend


@pytest.fixture(scope="session")
def fp8_device(request: pytest.FixtureRequest) -> str:
    """The device the drawn models are built on (``--fp8-device``)."""
    return request.config.getoption("fp8_device")


@pytest.fixture(scope="session")
def warm_inductor() -> None:
    """Inductor's one-time start in a process (its imports, the C++ toolchain probe, the first
    build) paid once, before the first compile property's Hypothesis loop, so that the first
    example is not charged for it. It compiles a plain function, not the backend's graph."""
    import torch

    torch.compile(lambda x: torch.relu(x) * 2, backend="inductor", fullgraph=True)(torch.ones(8))
