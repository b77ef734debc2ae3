"""How fast and how clearly a conformance run gives its verdict, through pytester: bounded
shrinking, root causes first, a line per test also when piped, quiet captured logs, selection
by property, and the usage errors found before any test runs."""

from __future__ import annotations

import json
import logging
import os
import stat

import pytest
import torch  # noqa: F401  (imported before any in-process pytester run, which would otherwise unload it)

import fake_backends  # tests/fake_backends.py (tests/ is on sys.path)
from conformance.plugin import quiet

pytest_plugins = ["pytester"]

FAKE = "--fp8-backend=fakebackends:Fake"
FAKE_BACKENDS = fake_backends.BASE + """
    class Wide(_Trivial):
        name = "wide"
        capabilities = frozenset({"provenance", "validation", "fingerprint"})
"""
WIDE = "--fp8-backend=fakebackends:Wide"
FAKE_BACKENDS += """
    class Dying(Fake):
        def trace_joint(self, model, args):
            import os
            os._exit(3)
"""

# One provenance defect, seen by a validation property that relies on it, and an unrelated
# fingerprint failure.
DEFECT_TESTS = """
    import pytest

    @pytest.mark.fp8_property("PROV-003")
    def test_PROV_003_backward():
        pytest.fail("[PROV-003] backward node carries no provenance", pytrace=False)

    @pytest.mark.fp8_property("VAL-003")
    def test_VAL_003_missing():
        pytest.fail("[VAL-003] no FP8 compute found", pytrace=False)

    @pytest.mark.fp8_property("FPR-001")
    def test_FPR_001_changes():
        pytest.fail("[FPR-001] same fingerprint", pytrace=False)

    @pytest.mark.fp8_property("PROV-002")
    def test_PROV_002_ok():
        pass
"""

# The same, drawn: PROV-003 and VAL-003 fail on the same models (a model that prints itself as
# code, as the suite's do, keys each example), FPR-001 fails on its own.
RELYING_TESTS = """
    import dataclasses
    import pytest
    from hypothesis import given, strategies as st

    @dataclasses.dataclass(frozen=True)
    class Model:
        layers: int

        def to_python(self, backend=None):
            return f"model = Model({self.layers})\\n"

    models = st.builds(Model, st.integers(1, 3))

    @pytest.mark.fp8_property("PROV-003")
    @given(model=models)
    def test_PROV_003_backward(model):
        if model.layers > 1:
            pytest.fail("[PROV-003] backward node carries no provenance", pytrace=False)

    @pytest.mark.fp8_property("VAL-003")
    @given(model=models)
    def test_VAL_003_missing(model):
        if model.layers > 1:
            pytest.fail("[VAL-003] no FP8 compute found", pytrace=False)

    @pytest.mark.fp8_property("FPR-001")
    def test_FPR_001_changes():
        pytest.fail("[FPR-001] same fingerprint", pytrace=False)

    @pytest.mark.fp8_property("PROV-002")
    def test_PROV_002_ok():
        pass
"""

SLOW_FAILURE = """
    import time
    import pytest
    from hypothesis import given, strategies as st
    from conformance.report.replay import MODEL_MARKER

    @pytest.mark.fp8_property("PROV-002")
    @given(x=st.integers(0, 10**9))
    def test_PROV_002_slow(fp8_backend, x):
        time.sleep(0.3)
        with open("calls.txt", "a") as f:
            f.write(f"{x}\\n")
        if x >= 1000:
            pytest.fail(f"[PROV-002] too big\\n\\n{MODEL_MARKER}\\nx = {x}", pytrace=False)
"""


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.delenv("FP8CONF_HYPOTHESIS_PROFILE", raising=False)
    pytester.makepyfile(fakebackends=FAKE_BACKENDS)
    pytester.syspathinsert()
    return pytester


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest("-p", "no:cacheprovider", "-p", "no:randomly", *args)


@pytest.mark.parametrize("xdist", [False, True], ids=["serial", "xdist"])
def test_a_failure_relying_on_a_failing_property_is_shown_as_its_consequence(suite, xdist):
    suite.makepyfile(test_defect=RELYING_TESTS)
    args = (WIDE, "--fp8-report=out/r.json", "--hypothesis-profile=fp8conf-ci", "test_defect.py")
    # Under xdist the examples' outcomes travel from the workers with each test's report.
    result = suite.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2", *args) if xdist else run(suite, *args)
    result.assert_outcomes(passed=1, failed=3)
    result.stdout.fnmatch_lines(
        [
            "*fp8conf conformance*",
            # Root causes and failures of their own first, then consequences.
            "PROV-003 *fail *root cause: fix first",
            "FPR-001 *fail *1 *1",
            "VAL-003 *fail *consequence of PROV-003 (both fail on models *, *)",
            "PROV-002 *pass*",
            "fix PROV-003 first: VAL-003 relies on it and fails on no model it passes",
        ]
    )
    report = json.loads((suite.path / "out" / "r.json").read_text())
    assert report["summary"]["root_causes"] == {"PROV-003": ["VAL-003"]}
    assert report["properties"]["VAL-003"]["caused_by"] == ["PROV-003"]
    evidence = report["properties"]["VAL-003"]["evidence"]
    assert report["properties"]["VAL-003"]["caused_on"] == sorted(evidence["failed"])
    assert len(evidence["failed"]) == 2 and len(evidence["passed"]) == 1  # Model(2), Model(3); Model(1)
    assert "caused_by" not in report["properties"]["FPR-001"]


def test_a_failure_relying_on_a_failing_property_without_shared_evidence_is_its_own(suite):
    """Plain tests run no drawn model: nothing shows that VAL-003 fails where PROV-003 does."""
    suite.makepyfile(test_defect=DEFECT_TESTS)
    result = run(suite, WIDE, "--fp8-report=out/r.json", "test_defect.py")
    result.assert_outcomes(passed=1, failed=3)
    result.stdout.fnmatch_lines(
        [
            "VAL-003 *fail *root cause of its own; see below",
            "VAL-003 is a root cause of its own: it relies on PROV-003, which fails too, but no model "
            "failed both it and PROV-003",
        ]
    )
    report = json.loads((suite.path / "out" / "r.json").read_text())
    assert report["summary"]["root_causes"] == {}
    assert "caused_by" not in report["properties"]["VAL-003"]


def test_a_slow_failing_example_is_not_shrunk(suite):
    suite.makepyfile(test_slow=SLOW_FAILURE)
    result = run(suite, FAKE, "--fp8-shrink-seconds=2", "--fp8-report=out/r.json", "test_slow.py")
    result.assert_outcomes(failed=1)
    found = json.loads((suite.path / "out" / "r.json").read_text())["properties"]["PROV-002"]
    assert found["reproducer"]["shrink"] == "none"
    # The failing example, its replay and Hypothesis's final run: no shrinking in between.
    assert len((suite.path / "calls.txt").read_text().split()) <= found["examples"] + 3
    result.stdout.fnmatch_lines(["Failing model, not shrunk (runnable):", "x = *"])
    result.stdout.no_fnmatch_line("Minimal model*")


def test_a_cheap_failing_example_is_shrunk(suite):
    suite.makepyfile(test_fast=SLOW_FAILURE.replace("time.sleep(0.3)", "pass"))
    result = run(suite, FAKE, "--fp8-report=out/r.json", "test_fast.py")
    result.assert_outcomes(failed=1)
    found = json.loads((suite.path / "out" / "r.json").read_text())["properties"]["PROV-002"]
    assert found["reproducer"]["shrink"] == "minimal"
    assert "x=1000" in found["reproducer"]["failing_case"]
    result.stdout.fnmatch_lines(["Minimal model (runnable):", "x = 1000"])


def test_shrinking_is_bounded_by_a_count_not_by_the_time_the_machine_takes(suite):
    # One failing test shrunk twice, the second time with every example slowed down (the test's
    # source, which seeds a derandomized run, is the same): a count of shrinks ends both, so both
    # show the same model, where a time bound would show a larger one for the slow run.
    suite.makepyfile(test_counted=SLOW_FAILURE.replace("time.sleep(0.3)", "time.sleep(float(open('delay.txt').read()))"))
    shown = []
    for delay in ("0", "0.05"):
        (suite.path / "delay.txt").write_text(delay)
        result = run(suite, FAKE, "--fp8-shrinks=2", "--fp8-report=out/r.json", "test_counted.py")
        result.assert_outcomes(failed=1)
        found = json.loads((suite.path / "out" / "r.json").read_text())["properties"]["PROV-002"]
        assert found["reproducer"]["shrink"] == "shrunk"
        shown.append(found["reproducer"]["failing_case"])
    assert shown[0] == shown[1] and "x=1000," not in shown[0]
    result.stdout.fnmatch_lines(["Failing model, shrunk as many times as --fp8-shrinks allows (runnable):"])


def test_piped_run_prints_a_line_per_property(suite):
    suite.makepyfile(test_defect=DEFECT_TESTS)
    # A subprocess writes to a pipe, as in CI or under tee.
    result = suite.runpytest_subprocess("-p", "no:cacheprovider", WIDE, "test_defect.py")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "PROV-003 * test_PROV_003_backward  fail  1 example  *s",
            "VAL-003 * test_VAL_003_missing  fail  1 example  *s",
            "FPR-001 * test_FPR_001_changes  fail  1 example  *s",
            "PROV-002 * test_PROV_002_ok  pass  1 example  *s",
        ]
    )


def test_xdist_controller_prints_the_lines(suite):
    suite.makepyfile(test_defect=DEFECT_TESTS)
    result = suite.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2", WIDE, "test_defect.py")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["PROV-002 * test_PROV_002_ok  pass  1 example  *s"])


def test_chatter_filter_drops_trace_records_and_torchao_notices():
    chatter = quiet.LibraryChatterFilter()

    def record(name, message, level=logging.WARNING):
        return logging.LogRecord(name, level, __file__, 1, message, None, None)

    assert not chatter.filter(record("torch.__trace", "", logging.DEBUG))
    assert not chatter.filter(record("torchao", "Failed to load /x/_C_mxfp8.so: nope"))
    assert not chatter.filter(
        record("torch.utils._pytree", "<enum 'KernelPreference'> is an Enum subclass and is now natively supported")
    )
    assert chatter.filter(record("torchao", "something else"))
    assert chatter.filter(record("torch._dynamo", "Failed to load"))
    assert chatter.filter(record("mybackend", "rewrote 3 nodes", logging.DEBUG))


def test_captured_logs_carry_no_library_chatter(suite):
    suite.makepyfile(
        test_logs="""
        import logging
        import pytest

        @pytest.mark.fp8_property("PROV-001")
        def test_PROV_001_logs():
            logging.getLogger("torch.__trace").setLevel(logging.DEBUG)
            logging.getLogger("torch.__trace").debug("")
            logging.getLogger("torchao").warning("Failed to load /x/_C.so: no")
            logging.getLogger("mybackend").warning("the backend's own record")
            assert False
        """
    )
    result = run(suite, FAKE, "test_logs.py")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*Captured log call*", "*the backend's own record*"])
    result.stdout.no_fnmatch_line("DEBUG *torch.__trace*")
    result.stdout.no_fnmatch_line("WARNING *torchao:*Failed to load*")
    # The loggers' filter goes with the run that installed it.
    assert not logging.getLogger("torchao").filters


def test_fp8_property_selects_by_citation_not_by_name(suite):
    suite.makepyfile(
        test_select="""
        import pytest

        @pytest.mark.fp8_property("PROV-001")
        def test_PROV_001():
            pass

        @pytest.mark.fp8_property("PROV-003")
        def test_PROV_003():
            pass

        @pytest.mark.fp8_property("VAL-001")
        def test_VAL_001_mentions_PROV():
            pass

        def test_plain_PROV():
            pass
        """
    )
    result = run(suite, WIDE, "-v", "--fp8-property", "PROV-003", "test_select.py")
    result.assert_outcomes(passed=1, deselected=3)
    result.stdout.fnmatch_lines(["*test_PROV_003 PASSED*"])
    result = run(suite, WIDE, "--fp8-property=PROV", "--fp8-property=VAL-001", "test_select.py")
    result.assert_outcomes(passed=3, deselected=1)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--fp8-property=PROV-999"], "ERROR: --fp8-property PROV-999: not a property or area*"),
        (["--fp8-property=prov"], "ERROR: --fp8-property prov: not a property or area*"),
        (["--fp8-report=out"], "ERROR: --fp8-report=out: */out is a directory; give a file path*"),
        (["--fp8-report=afile/r.json"], "ERROR: --fp8-report=afile/r.json: * cannot be created: */afile is not a directory*"),
        # os.access says yes to root for any path; only creating the file tells.
        (["--fp8-report=/proc/r.json"], "ERROR: --fp8-report=/proc/r.json: /proc/r.json cannot be created: No such file or directory; give a file path in a writable folder"),
        (["--fp8-report="], "ERROR: --fp8-report is empty; give a file path, or leave the option out"),
        # Opening a FIFO to see whether it is writable waits for a reader: it was a hang.
        (["--fp8-report=fifo.json"], "ERROR: --fp8-report=fifo.json: */fifo.json is a FIFO, not a regular file (left as it is); give a file path*"),
        (["--fp8-expectations=latin1.json"], "ERROR: --fp8-expectations: */latin1.json: not UTF-8 text (byte 0xe9 at offset 17); save it as UTF-8"),
        (["--fp8-expectations=bad.json"], "ERROR: --fp8-expectations: */bad.json: not valid JSON*"),
        (["--fp8-shrink-seconds=-1"], "ERROR: --fp8-shrink-seconds must be 0 or more seconds, got -1"),
        (["--fp8-shrinks=-1"], "ERROR: --fp8-shrinks must be 0 or more, got -1"),
    ],
)
def test_usage_errors_come_before_any_test(suite, args, message):
    suite.mkdir("out")
    (suite.path / "afile").write_text("")
    (suite.path / "latin1.json").write_bytes('{"PROV-001": "caf\xe9"}'.encode("latin-1"))
    (suite.path / "bad.json").write_text('{"PROV-001": ')
    os.mkfifo(suite.path / "fifo.json")
    suite.makepyfile(test_never="def test_never():\n    raise AssertionError('ran')\n")
    result = suite.runpytest_subprocess("-p", "no:cacheprovider", FAKE, *args, "test_never.py", timeout=120)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])
    assert "ran" not in result.stdout.str() and "Traceback" not in result.stderr.str()
    assert stat.S_ISFIFO((suite.path / "fifo.json").stat().st_mode)


def test_checking_the_report_path_leaves_no_trace(suite):
    """The check creates the report file to prove it can; a file that was there keeps its
    bytes, and a file or folder the check made is gone again when the run ends early."""
    suite.mkdir("kept")
    (suite.path / "kept" / "r.json").write_text("earlier report")
    for report in ("kept/r.json", "new/sub/r.json"):
        result = suite.runpytest_subprocess(
            "-p", "no:cacheprovider", FAKE, f"--fp8-report={report}", "--fp8-property=PROV-999"
        )
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        result.stderr.fnmatch_lines(["ERROR: --fp8-property PROV-999: *"])
    assert (suite.path / "kept" / "r.json").read_text() == "earlier report"
    assert not (suite.path / "kept" / "r.md").exists() and not (suite.path / "new").exists()


def test_fp8_property_needs_a_backend(suite):
    result = suite.runpytest_subprocess("-p", "no:cacheprovider", "--fp8-property=PROV")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --fp8-property needs --fp8-backend"])


def test_a_crashed_worker_names_the_backend_method_and_the_replay(suite):
    suite.makepyfile(
        test_die="""
        import pytest

        @pytest.mark.fp8_property("PROV-001")
        def test_dies(fp8_backend):
            fp8_backend.trace_joint(None, ())
        """
    )
    result = suite.runpytest_subprocess(
        "-p", "no:cacheprovider", "-n", "2", "--fp8-backend=fakebackends:Dying",
        "--fp8-report=out/r.json", "test_die.py",
    )
    result.stdout.fnmatch_lines(
        ["*worker 'gw*' crashed while running 'test_die.py::test_dies' while in backend method "
         "trace_joint()"]
    )
    row = json.loads((suite.path / "out" / "r.json").read_text())["properties"]["PROV-001"]
    assert row["status"] == "error"
    assert row["reproducer"]["command"] == (
        "pytest --fp8-backend=fakebackends:Dying 'test_die.py::test_dies' --hypothesis-profile=fp8conf-ci"
    )


@pytest.mark.slow
def test_a_compiled_property_under_xdist_is_not_broken_by_the_crash_notes(pytester):
    # Under -n a worker notes the backend method in progress (for a crash report); a property
    # that compiles a step calling the backend (E8M0-004) must not have Dynamo trace that note.
    result = pytester.runpytest_subprocess(
        "--fp8-backend=reference", "--fp8-property", "E8M0-004", "-n", "2", "-p", "no:cacheprovider"
    )
    result.assert_outcomes(passed=1)


def test_a_crash_note_longer_than_its_mapping_is_read_back_whole(tmp_path):
    # The note of a worker (conformance/plugin/crashes.py) lives in a memory-mapped file of
    # 64 KiB to begin with: a longer one (a replay command of many options) grows the file.
    from conformance.plugin.crashes import _MappedNote

    path = tmp_path / "gw0.json"
    note = _MappedNote(path)
    assert _MappedNote.read(path) is None, "a note never written must read as none"
    short, long = {"test": "t", "method": "trace_joint"}, {"test": "t", "command": "x" * 100_000, "method": None}
    for written in (short, long, short):
        note.write(json.dumps(written).encode())
        assert _MappedNote.read(path) == written
    note.close()
    assert _MappedNote.read(path) == short
