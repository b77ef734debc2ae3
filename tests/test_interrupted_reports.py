"""Reports of runs that did not end complete, and reports written whole or not at all.

A run cut short by Ctrl-C (serial, under ``-n 2``, or in one xdist worker) or by ``-x`` says so in
its report (``run.ended``), has no MUST score, lists what it did not reach and counts the test it
cut off as ``not_run``; ``fp8conf check`` exits 6 for it. A run that ends before its first test
leaves no earlier report behind, and a report that cannot be written leaves no temporary file.

The runs are subprocesses in a pytester directory with the torch-free fake backends of
``tests/fake_backends.py``. The property test that waits writes a file as it starts; the run is
then sent SIGINT, to its whole process group as Ctrl-C in a terminal does, or to one worker.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conformance.api import PROPERTIES
from conformance.plugin import render
from conformance.plugin import report as report_model
from conformance.plugin.report_files import ReportWriteError
from fp8conf.tools.cli import EXIT_INCOMPLETE
import fake_backends  # tests/fake_backends.py (tests/ is on sys.path)

pytest_plugins = ["pytester"]

FAKE = "--fp8-backend=fakebackends:Fake"
REPORT = "--fp8-report=out/r.json"
WAITING = "test_props.py::test_PROV_002_waits"

# PROV-001 passes; PROV-002 writes started-<pid> in its first example and waits for the signal;
# PROV-003 passes, and in a serial run never starts.
PROPERTY_TESTS = """
    import gc
    import os
    import time

    import pytest
    from hypothesis import given, strategies as st

    @pytest.mark.fp8_property("PROV-001")
    def test_PROV_001_passes(fp8_backend):
        pass

    @pytest.mark.fp8_property("PROV-002")
    @given(x=st.integers(0, 100))
    def test_PROV_002_waits(fp8_backend, x):
        # Nothing between the file and the sleep may run a finalizer: a KeyboardInterrupt raised
        # inside one is printed and dropped, and the run would sleep on.
        gc.disable()
        os.close(os.open(f"started-{os.getpid()}", os.O_CREAT | os.O_WRONLY))
        time.sleep(300)

    @pytest.mark.fp8_property("PROV-003")
    def test_PROV_003_passes(fp8_backend):
        pass
"""

FAILING_FIRST = """
    import pytest

    @pytest.mark.fp8_property("PROV-001")
    def test_PROV_001_fails(fp8_backend):
        assert False

    @pytest.mark.fp8_property("PROV-003")
    def test_PROV_003_passes(fp8_backend):
        pass
"""

# Imported by pytest in its start-up, before the plugin has a session (as torch is, in a real
# run): a conftest that waits there when asked to.
WAITING_CONFTEST = """
    import os
    import time

    if os.environ.get("WAIT_IN_START_UP"):
        os.close(os.open(f"started-{os.getpid()}", os.O_CREAT | os.O_WRONLY))
        time.sleep(300)
"""

# Imported while pytest collects: the plugin has its session, no test has started.
WAITING_MODULE = """
    import os
    import time

    os.close(os.open(f"started-{os.getpid()}", os.O_CREAT | os.O_WRONLY))
    time.sleep(300)
"""


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    # The outer run may choose a profile through the environment; these runs choose their own.
    monkeypatch.delenv("FP8CONF_HYPOTHESIS_PROFILE", raising=False)
    pytester.makepyfile(fakebackends=fake_backends.BASE, test_props=PROPERTY_TESTS)
    pytester.syspathinsert()
    return pytester


def _with_default_sigint() -> None:
    # A process started with SIGINT ignored (a background job) passes that on, and Python then
    # installs no KeyboardInterrupt handler: the run under test must get one.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupted(
    pytester: pytest.Pytester, *args: str, command: tuple[str, ...] = ("-m", "pytest"),
    only_the_worker: bool = False, env: dict[str, str] | None = None, terminate: bool = False,
) -> subprocess.CompletedProcess:
    """Run ``python <command> <args>`` in ``pytester``'s directory and send it SIGINT once a
    ``started-<pid>`` file appears: to its process group, or with ``only_the_worker`` to the
    process that wrote the file; with ``terminate``, SIGTERM to the command's process alone (as
    a CI runner or ``kill`` stops a job)."""
    if command == ("-m", "pytest"):
        args = ("-p", "no:cacheprovider", "-p", "no:randomly", *args)
    proc = subprocess.Popen(
        [sys.executable, *command, *args], cwd=pytester.path, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        preexec_fn=_with_default_sigint, env={**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {})},
    )
    deadline = time.monotonic() + 120
    try:
        while not (started := list(pytester.path.glob("started-*"))):
            if proc.poll() is not None or time.monotonic() > deadline:
                out, err = proc.communicate()
                pytest.fail(f"nothing started (exit status {proc.returncode}):\n{out}\n{err}")
            time.sleep(0.05)
        time.sleep(0.2)  # past the file's writing, into the sleep
        if only_the_worker:
            os.kill(int(started[0].name.removeprefix("started-")), signal.SIGINT)
        elif terminate:
            os.kill(proc.pid, signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            # Where it waits: faulthandler (on through the environment) prints every thread's stack.
            os.killpg(proc.pid, signal.SIGABRT)
            out, err = proc.communicate()
            pytest.fail(f"still running 120 s after the signal (stacks on SIGABRT follow):\n{out}\n{err}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    done.pid = proc.pid  # also its process group: a session of its own
    return done


def read_report(pytester: pytest.Pytester) -> dict:
    return json.loads((pytester.path / "out" / "r.json").read_text())


def assert_cut_off_and_unscored(report: dict, why: str) -> None:
    """``report`` says the run was interrupted (``why`` in its reason) with PROV-002 cut off."""
    run = report["run"]
    assert run["ended"] == "interrupted" and why in run["reason"], run
    assert report["summary"]["must_score"] is None
    assert run["cut_off"] == [WAITING] and WAITING in run["tests_not_run"]
    assert "PROV-002" in run["not_reached"]
    waited = report["properties"]["PROV-002"]
    assert waited["status"] == "not_run" and waited["outcomes"] == {"not_run": 1}
    assert report["summary"]["must_skipped"] == 0  # cut off is not skipped


def earlier_report(pytester: pytest.Pytester) -> None:
    """A complete, passing report at out/r.json (and out/r.md), as an earlier run leaves it."""
    result = pytester.runpytest(
        "-p", "no:cacheprovider", FAKE, REPORT, "--fp8-property=PROV-001", "test_props.py"
    )
    assert result.ret == 0 and read_report(pytester)["summary"]["must_score"] == 1.0


# -- a run cut short -----------------------------------------------------------------------
@pytest.mark.parametrize("workers", [(), ("-n", "2")], ids=["serial", "xdist"])
def test_ctrl_c_mid_run_writes_an_interrupted_report_without_a_score(suite, workers):
    done = interrupted(suite, *workers, FAKE, REPORT, "test_props.py")
    assert done.returncode == pytest.ExitCode.INTERRUPTED, done.stdout + done.stderr
    report = read_report(suite)
    assert_cut_off_and_unscored(report, "KeyboardInterrupt")
    if not workers:  # in file order: PROV-003 never started
        assert report["run"]["not_reached"] == ["PROV-002", "PROV-003"]
        assert report["properties"]["PROV-003"]["status"] == "not_run"
        assert report["properties"]["PROV-001"]["status"] == "pass"
    markdown = (suite.path / "out" / "r.md").read_text().splitlines()
    assert markdown[0] == "# fp8conf conformance report"
    assert markdown[2].startswith(
        "**INTERRUPTED (KeyboardInterrupt: Ctrl-C or SIGINT): no conformance verdict"
    )
    assert "MUST score: none, the run is INTERRUPTED, no conformance verdict" in done.stdout


def test_an_interrupted_xdist_worker_makes_the_controller_report_interrupted(suite):
    done = interrupted(suite, "-n", "2", FAKE, REPORT, "test_props.py", only_the_worker=True)
    assert done.returncode == pytest.ExitCode.INTERRUPTED, done.stdout + done.stderr
    report = read_report(suite)
    # Its test is cut off, not an error: xdist reports the worker as crashed while running it.
    assert_cut_off_and_unscored(report, "xdist worker gw")
    assert report["properties"]["PROV-002"]["reproducer"] is None


@pytest.mark.parametrize("workers", [(), ("-n", "2")], ids=["serial", "xdist"])
def test_fp8conf_check_exits_6_for_an_interrupted_run(suite, workers):
    done = interrupted(
        suite, "check", "--backend", "fakebackends:Fake", "--report", "out/r.json", *workers,
        "--", "test_props.py", command=("-m", "fp8conf.tools.cli"),
    )
    assert done.returncode == EXIT_INCOMPLETE == 6, done.stdout + done.stderr
    assert_cut_off_and_unscored(read_report(suite), "KeyboardInterrupt")


def test_fp8conf_check_terminated_ends_as_interrupted_and_leaves_no_worker_behind(suite):
    # SIGTERM to fp8conf check alone: before, the process died at once, wrote no report and its
    # two xdist workers ran on without a parent.
    done = interrupted(
        suite, "check", "--backend", "fakebackends:Fake", "--report", "out/r.json", "-n", "2",
        "--", "test_props.py", command=("-m", "fp8conf.tools.cli"), terminate=True,
    )
    assert done.returncode == EXIT_INCOMPLETE == 6, done.stdout + done.stderr
    assert_cut_off_and_unscored(read_report(suite), "SIGTERM")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(done.pid, 0)  # anything left of its session: the workers
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        os.killpg(done.pid, signal.SIGKILL)
        pytest.fail("processes of fp8conf check's session still ran 30 s after it ended (killed now)")


def test_a_run_stopped_by_x_is_incomplete(suite):
    suite.makepyfile(test_failing=FAILING_FIRST)
    result = suite.runpytest(
        "-p", "no:cacheprovider", "-p", "no:randomly", "-x", FAKE, REPORT, "test_failing.py"
    )
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    report = read_report(suite)
    assert report["run"] == {
        "ended": "incomplete", "reason": "stopping after 1 failures", "not_reached": ["PROV-003"],
        "tests_not_run": ["test_failing.py::test_PROV_003_passes"], "cut_off": [],
    }
    assert report["summary"]["must_score"] is None
    assert report["properties"]["PROV-003"]["status"] == "not_run"
    result.stdout.fnmatch_lines(
        ["INCOMPLETE (stopping after 1 failures): no conformance verdict; not reached: PROV-003"]
    )
    done = subprocess.run(
        [sys.executable, "-m", "fp8conf.tools.cli", "check", "--backend", "fakebackends:Fake", "--report",
         "out/r.json", "--", "-x", "test_failing.py"], cwd=suite.path, capture_output=True, text=True,
    )
    assert done.returncode == EXIT_INCOMPLETE, done.stdout + done.stderr


@pytest.mark.parametrize("workers", [(), ("-n", "2")], ids=["serial", "xdist"])
def test_a_complete_run_says_so_and_keeps_its_score(suite, workers):
    args = [*workers, FAKE, REPORT, "-k", "not waits", "test_props.py"]
    if workers:
        result = suite.runpytest_subprocess("-p", "no:cacheprovider", *args)
    else:
        result = suite.runpytest("-p", "no:cacheprovider", *args)
    assert result.ret == 0
    report = read_report(suite)
    assert report["run"] == {
        "ended": "complete", "reason": None, "not_reached": [], "tests_not_run": [], "cut_off": [],
    }
    assert report["schema_version"] == report_model.REPORT_SCHEMA_VERSION == 3
    assert report["summary"]["must_score"] == 1.0
    assert (suite.path / "out" / "r.md").read_text().splitlines()[2].startswith("- Backend:")


# -- a run that ends before its first test -------------------------------------------------
def test_ctrl_c_in_start_up_removes_the_earlier_report(suite):
    earlier_report(suite)
    suite.makepyfile(conftest=WAITING_CONFTEST)
    done = interrupted(
        suite, "check", "--backend", "fakebackends:Fake", "--report", "out/r.json",
        "--", "test_props.py", command=("-m", "fp8conf.tools.cli"), env={"WAIT_IN_START_UP": "1"},
    )
    assert done.returncode == EXIT_INCOMPLETE, done.stdout + done.stderr
    assert not (suite.path / "out" / "r.json").exists() and not (suite.path / "out" / "r.md").exists()
    assert (
        f"fp8conf: removed {suite.path / 'out' / 'r.json'} and {suite.path / 'out' / 'r.md'}, an earlier "
        "run's report: this run wrote none (it ended before its first test)"
    ) in done.stderr
    assert "fp8conf check: interrupted in start-up, before any test ran; no report written" in done.stderr


def test_ctrl_c_in_collection_removes_the_earlier_report(suite):
    earlier_report(suite)
    suite.makepyfile(test_waits_in_import=WAITING_MODULE)
    done = interrupted(suite, FAKE, REPORT, "test_props.py", "test_waits_in_import.py")
    assert done.returncode == pytest.ExitCode.INTERRUPTED, done.stdout + done.stderr
    assert not (suite.path / "out" / "r.json").exists() and not (suite.path / "out" / "r.md").exists()
    assert "an earlier run's report: this run wrote none (it ended before its first test)" in done.stderr


def test_a_usage_error_removes_the_earlier_report(suite):
    earlier_report(suite)
    result = suite.runpytest(
        "-p", "no:cacheprovider", FAKE, REPORT, "--fp8-property=PROV-999", "test_props.py"
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert not (suite.path / "out" / "r.json").exists() and not (suite.path / "out" / "r.md").exists()
    result.stderr.fnmatch_lines(["fp8conf: removed */out/r.json and */out/r.md, an earlier run's report: *"])


# -- writing the files ---------------------------------------------------------------------
def _report() -> dict:
    record = report_model.TestRecord(("PROV-001",), "pass", 3)
    return report_model.build_report(
        {"t.py::test_a": record}, PROPERTIES, suite={"name": "fp8conf", "version": "0"},
        spec_version="1.0", checked_spec_version="1.0",
        backend={"name": "fake", "version": "1.2", "spec": "m:Fake", "capabilities": ["provenance"]},
        environment={"python": "3", "torch": "2", "torchao": "0", "hypothesis_profile": "fp8conf-ci",
                     "device": "cpu", "compute_capability": None},
        options={},
    )


def test_a_report_that_cannot_be_written_is_a_usage_error_and_leaves_no_temporary_file(suite):
    # The path is checked before the run; a folder appears there while it runs.
    suite.makepyfile(test_takes_the_path="""
        import os
        import pytest

        @pytest.mark.fp8_property("PROV-001")
        def test_PROV_001_takes_the_report_path(fp8_backend):
            os.mkdir("out/r.json")
    """)
    suite.mkdir("out")
    result = suite.runpytest_subprocess("-p", "no:cacheprovider", FAKE, REPORT, "test_takes_the_path.py")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["ERROR: --fp8-report: cannot write the report */out/r.json: Is a directory"]
    )
    assert "Traceback" not in result.stdout.str() + result.stderr.str()
    assert sorted(path.name for path in (suite.path / "out").iterdir()) == ["r.json"]


def test_write_report_in_the_way_of_a_folder_raises_the_typed_error(tmp_path):
    (tmp_path / "r.json").mkdir()
    with pytest.raises(ReportWriteError) as raised:
        render.write_report(_report(), tmp_path / "r.json")
    assert (raised.value.path, raised.value.reason) == (tmp_path / "r.json", "Is a directory")
    assert str(raised.value) == f"cannot write the report {tmp_path / 'r.json'}: Is a directory"
    assert isinstance(raised.value, OSError)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["r.json"]  # no temporary file


def test_a_full_disk_keeps_the_earlier_report_whole_and_leaves_no_temporary_file(tmp_path):
    # RLIMIT_FSIZE makes a write past 1,000 bytes fail as a full disk does, for root too.
    (tmp_path / "report.json").write_text(json.dumps(_report()))
    out = tmp_path / "out"
    out.mkdir()
    (out / "r.json").write_text("earlier report")
    code = (
        "import json, resource, sys\n"
        "from pathlib import Path\n"
        "from conformance.plugin import render\n"
        "from conformance.plugin.report_files import ReportWriteError\n"
        "report = json.loads(Path(sys.argv[1]).read_text())\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n"
        "try:\n"
        "    render.write_report(report, Path(sys.argv[2]))\n"
        "except ReportWriteError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "report.json"), str(out / "r.json")],
        capture_output=True, text=True,
    )
    assert done.stdout == f"cannot write the report {out / 'r.json'}: File too large\n", done.stderr
    assert (out / "r.json").read_text() == "earlier report"
    assert sorted(path.name for path in out.iterdir()) == ["r.json"]


@pytest.mark.skipif(
    hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only folders"
)
def test_write_report_into_a_read_only_folder_raises_the_typed_error(tmp_path):
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        with pytest.raises(ReportWriteError) as raised:
            render.write_report(_report(), folder / "r.json")
        assert (raised.value.path, raised.value.reason) == (folder / "r.json", "Permission denied")
        assert list(folder.iterdir()) == []
    finally:
        folder.chmod(0o755)
