import os
import sys
from pathlib import Path

# Two Inductor settings for fp8conf's own test runs, made before torch is imported here and seen
# by every process a test starts (they inherit this environment); a value of your own is kept.
# Neither changes which kernels Inductor generates nor what they compute; each saves C++ compiler
# time that a test run, 500 kernel builds in some 30 processes, paid over and over:
# * TORCHINDUCTOR_VEC_ISA_OK=1: the CPU's vector instruction set is the one the CPU reports, not
#   proven again in every process by building and loading a test library per instruction set
#   (1.2 s of CPU a process, 8 s with an empty Inductor cache). Where the C++ compiler could not
#   build an instruction set the CPU has, Inductor would have left it out; here its kernels fail
#   to build, and the failure says which flags: set TORCHINDUCTOR_VEC_ISA_OK=0 there.
# * AOT_INDUCTOR_ENABLE_LINE_TABLES=0: kernels are built without line tables for profilers (-g1),
#   a seventh of each kernel's build.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
os.environ.setdefault("AOT_INDUCTOR_ENABLE_LINE_TABLES", "0")

import pytest  # noqa: E402

from conformance import plugin  # noqa: E402
from conformance.plugin import worker_end  # noqa: E402
from fp8conf.log import library_notices_quieted  # noqa: E402

# TorchAO is imported here, before any test: pytester's in-process runs restore sys.modules when
# they end, so a TorchAO first imported inside one would be dropped while its ops stay registered
# with torch, and the next import of it in this worker fails ("registered ... multiple times").
with library_notices_quieted():
    import torchao  # noqa: F401

# For the same reason the suite's modules whose state a run's plugin and its tests share (what an
# example showed, the notes for a report row, the watchdog) and the plugin's run are imported here:
# one first imported inside an in-process run is dropped from sys.modules when the run ends while
# its package keeps the attribute, so a later run's plugin (re-imported) and its tests could hold
# two different copies, and what a test recorded would not reach the report.
import conformance.observe.evidence  # noqa: E402,F401
import conformance.plugin.run  # noqa: E402,F401
import conformance.report.notes  # noqa: E402,F401
import conformance.run.watchdog  # noqa: E402,F401

# The mutant backends live in tests/mutants and are loaded by name (mutants.backends:Class); the
# worked example backend and the trainer module it converts with live in docs/examples.
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "docs" / "examples"))

# Under -n, the tests of one xdist_group run on one worker (tests/xdist_groups.py says why here).
pytest_plugins = ["xdist_groups", "timings"]


# The plugin stays out of runs without --fp8-backend, like this one: fp8conf's own tests ask it
# for its profiles and its GPU gating. tryfirst: before Hypothesis loads --hypothesis-profile.
@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("fp8_backend"):
        return  # the plugin does all of it
    plugin.register_profiles()
    plugin.load_profile(config)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    # An xdist worker of these tests ends holding a large heap: frozen, the interpreter's shutdown
    # does not walk it (conformance/plugin/worker_end.py says why). A run with --fp8-backend: the
    # plugin does it.
    if not config.getoption("fp8_backend"):
        worker_end.freeze_heap(config)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("fp8_backend"):
        plugin.skip_unavailable_gpu_tests(items)


@pytest.fixture(autouse=True)
def _keep_hypothesis_profile():
    # In-process pytester runs load profiles into this process's global Hypothesis settings.
    from hypothesis import settings

    name = settings.get_current_profile_name()
    yield
    settings.load_profile(name)


@pytest.fixture(scope="session")
def other_backend_runs(request, tmp_path_factory):
    """The whole-suite runs of the backends other than the reference, one plan in one process
    (tests/suite_runs.py: :func:`other_backend_runs`), for the tests of every module that reads them."""
    import suite_runs

    return suite_runs.other_backend_runs(request, tmp_path_factory)


@pytest.fixture
def inductor_calls(monkeypatch):
    """The graphs given to the real ``standalone_compile`` or ``compile_fx_inner`` (full mode's
    two halves), each one an Inductor compilation; for a regional unit compiled by the inner
    compiler, the unit as it was cut (with its nodes' meta), not the decomposed copy Inductor gets."""
    import functools

    import torch
    import torch._inductor.compile_fx

    from fp8conf.compile import region_compile

    calls, inside_unit = [], []
    for owner, name in ((torch._inductor, "standalone_compile"), (torch._inductor.compile_fx, "compile_fx_inner"),
                        (region_compile, "_inner_compile_unit")):
        real = getattr(owner, name)

        @functools.wraps(real)  # keeps its signature, which compile_joint inspects
        def counting(*args, _real=real, _unit=name == "_inner_compile_unit", **kwargs):
            if not inside_unit:
                calls.append(args[0])
            if not _unit:
                return _real(*args, **kwargs)
            inside_unit.append(True)  # the compile_fx_inner call inside is this same compilation
            try:
                return _real(*args, **kwargs)
            finally:
                inside_unit.pop()

        monkeypatch.setattr(owner, name, counting)
    return calls


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    # The suite's own power: per area, mutants caught out of those run (tests/test_mutants.py
    # records one outcome per mutant; with xdist the records arrive on the reports).
    from mutants import POWER_KEY, power_table

    outcomes = [
        value
        for report in terminalreporter.getreports("passed") + terminalreporter.getreports("failed")
        if report.when == "call"
        for key, value in report.user_properties
        if key == POWER_KEY
    ]
    if outcomes:
        terminalreporter.write_sep("=", "conformance suite power (mutants caught by their property)")
        terminalreporter.write_line(power_table(outcomes))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    # pytest-timeout guards against hangs (pyproject.toml); when it fires, say so, so that nobody
    # reads it as the test's rule failing.
    report = (yield).get_result()
    if report.failed and "from pytest-timeout" in str(report.longrepr):
        marker = item.get_closest_marker("timeout")
        limit = marker.args[0] if marker and marker.args else item.config.getini("timeout")
        report.longrepr = (
            f"HANG GUARD: {item.nodeid} ran longer than {limit} s and was stopped. This is taken for a hang "
            f"(the limit is sized for a busy machine), not for a failure of what the test checks.\n\n{report.longrepr}"
        )
