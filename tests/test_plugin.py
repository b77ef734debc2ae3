"""Tests of the conformance pytest plugin (conformance/plugin/), run through pytester.

The fake backends below are written into each pytester directory and never import torch, so
these runs stay fast; they are selected with the ``package.module:Class`` form.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch  # imported before any in-process pytester run, which would otherwise unload it

import conformance
from conformance import plugin
from conformance.plugin import hooks
import fake_backends  # tests/fake_backends.py (tests/ is on sys.path)

pytest_plugins = ["pytester"]

FAKE_BACKENDS = fake_backends.BASE + """
    class NotABackend:
        pass

    class Exploding(_Trivial):
        def __init__(self):
            raise RuntimeError("no device\\nfound")
"""

FAKE = "--fp8-backend=fakebackends:Fake"
#: A project's conftest that uses the plugin's profile helpers without a backend, as fp8conf's own does.
PROFILE_CONFTEST = """
import pytest
from conformance import plugin

@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    plugin.register_profiles()
    plugin.load_profile(config)
"""


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    # The outer run (tox, CI) may choose a profile through the environment; these runs choose their own.
    monkeypatch.delenv("FP8CONF_HYPOTHESIS_PROFILE", raising=False)
    pytester.makepyfile(
        fakebackends=FAKE_BACKENDS,
        brokenbackend="import fp8conf_missing_dependency_xyz\n",
    )
    pytester.syspathinsert()
    return pytester


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest("-p", "no:cacheprovider", "-p", "no:randomly", *args)


def test_import_does_not_import_torch():
    code = "import sys, conformance.plugin; assert 'torch' not in sys.modules, 'torch imported'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_unknown_backend_lists_installed_names(suite):
    result = run(suite, "--fp8-backend=no-such-backend", str(suite.path))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["ERROR: unknown fp8conf backend 'no-such-backend'; installed backends: *reference*"]
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "brokenbackend:Backend",
            "could not be imported: ModuleNotFoundError: "
            "No module named 'fp8conf_missing_dependency_xyz'",
        ),
        ("fakebackends:Missing", "could not be imported: AttributeError: *Missing*"),
        ("fakebackends:NotABackend", "is *NotABackend*not a subclass of conformance.Backend."),
        ("fakebackends:Exploding", "could not be constructed: RuntimeError: no device found"),
    ],
)
def test_bad_backend_is_a_clean_usage_error(suite, spec, message):
    result = run(suite, f"--fp8-backend={spec}", str(suite.path))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: fp8conf backend '{spec}' {message}"])
    assert "Traceback" not in result.stdout.str() + result.stderr.str()


@pytest.mark.parametrize("value", ["", "  "], ids=["empty", "blank"])
def test_an_empty_backend_is_a_usage_error_before_any_test(suite, value):
    """``--fp8-backend=$UNSET_VARIABLE`` must not be a green run that checked nothing."""
    suite.makepyfile(test_never="def test_never():\n    raise AssertionError('ran')\n")
    for args in (["--pyargs", "conformance"], ["test_never.py"]):
        result = suite.runpytest_subprocess("-p", "no:cacheprovider", f"--fp8-backend={value}", *args)
        assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()
        result.stderr.fnmatch_lines(
            ["ERROR: --fp8-backend is empty; pass an installed backend name (installed: *reference*) "
             "or package.module:Class, or leave the option out"]
        )
        assert "ran" not in result.stdout.str() and "Traceback" not in result.stderr.str()


def test_fp8conf_check_refuses_an_empty_backend_alike(suite):
    proc = subprocess.run(
        [sys.executable, "-m", "fp8conf.tools.cli", "check", "--backend", "", "--report", "r.json"],
        capture_output=True, text=True, cwd=suite.path,
    )
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, proc.stdout + proc.stderr
    assert "ERROR: --fp8-backend is empty; pass an installed backend name" in proc.stderr
    assert not (suite.path / "r.json").exists()


def test_report_without_backend_is_a_usage_error(suite):
    result = run(suite, "--fp8-report=r.json")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --fp8-report needs --fp8-backend"])


def test_inert_without_backend(suite):
    suite.makepyfile(
        test_inert="""
        import sys
        import pytest

        def test_needs_backend(fp8_backend):
            raise AssertionError("must be skipped")

        @pytest.mark.fp8_property("NOT-A-PROPERTY")
        def test_marked_but_inert():
            assert "torch" not in sys.modules
        """
    )
    result = suite.runpytest_subprocess("-p", "no:cacheprovider", "-rs", "--strict-markers")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED*no --fp8-backend given"])
    result.stdout.no_fnmatch_line("*MUST score*")


def test_backend_without_gpu_tests_does_not_import_torch(suite):
    suite.makepyfile(
        test_light="""
        import sys
        import pytest

        @pytest.mark.fp8_property("PROV-001")
        def test_light(fp8_backend):
            assert "torch" not in sys.modules
        """
    )
    result = suite.runpytest_subprocess("-p", "no:cacheprovider", FAKE, "test_light.py")
    result.assert_outcomes(passed=1)


def test_unclaimed_capability_is_not_supported(suite):
    suite.makepyfile(
        test_gating="""
        import pytest

        @pytest.mark.fp8_property("PROV-001")
        def test_claimed(fp8_backend):
            assert fp8_backend.name == "fake"

        @pytest.mark.fp8_property("VAL-001")
        def test_unclaimed(fp8_backend):
            raise AssertionError("must not run")
        """
    )
    result = run(suite, FAKE, "-rs", "test_gating.py")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(
        [
            "SKIPPED*not_supported: backend 'fake' does not claim "
            "capability 'validation' (property VAL-001)"
        ]
    )


def test_bad_citation_is_a_collection_error(suite):
    suite.makepyfile(
        test_cites="""
        import pytest

        @pytest.mark.fp8_property("PROV-999")
        def test_typo():
            pass

        @pytest.mark.fp8_property()
        def test_no_id():
            pass
        """
    )
    result = run(suite, FAKE, "test_cites.py")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(
        [
            "*test_cites.py::test_typo cites unknown spec property 'PROV-999'*",
            "*test_cites.py::test_no_id: fp8_property takes one property ID*",
        ]
    )


def test_gpu_markers_skip_without_cuda(suite):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    suite.makepyfile(
        test_gpu="""
        import pytest

        @pytest.mark.fp8_gpu
        def test_gpu():
            pass

        @pytest.mark.fp8_sm90
        def test_sm90():
            pass
        """
    )
    result = run(suite, FAKE, "-rs", "test_gpu.py")
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines(
        ["SKIPPED*fp8_gpu: CUDA is not available", "SKIPPED*fp8_sm90: CUDA is not available"]
    )


def test_gpu_markers_are_not_gated_without_a_backend(suite):
    # Without --fp8-backend the plugin skips nothing: a project that wants the gating (fp8conf's
    # own tests do) calls plugin.skip_unavailable_gpu_tests from its conftest.py.
    suite.makepyfile(
        test_plain_gpu="""
        import pytest

        @pytest.mark.fp8_sm100
        def test_sm100():
            pass
        """
    )
    result = suite.runpytest_subprocess("-rs", "-p", "no:cacheprovider", "test_plain_gpu.py")
    result.assert_outcomes(passed=1)


def test_gpu_gating_helper_for_a_project_without_a_backend(suite):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    suite.makeconftest(
        """
        from conformance import plugin

        def pytest_collection_modifyitems(items):
            plugin.skip_unavailable_gpu_tests(items)
        """
    )
    suite.makepyfile(
        test_plain_gpu="""
        import pytest

        @pytest.mark.fp8_sm100
        def test_sm100():
            assert False, "must not run without CUDA"

        def test_cpu():
            pass
        """
    )
    result = suite.runpytest_subprocess("-rs", "-p", "no:cacheprovider", "test_plain_gpu.py")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED*fp8_sm100: CUDA is not available"])


REPORTED_TESTS = """
    import pytest

    @pytest.fixture
    def broken():
        raise RuntimeError("setup broke")

    @pytest.mark.fp8_property("PROV-001")
    @pytest.mark.parametrize("n", [1, 2])
    def test_passes(n):
        pass

    @pytest.mark.fp8_property("PROV-002")
    def test_prov2_passes():
        pass

    @pytest.mark.fp8_property("PROV-002")
    def test_prov2_fails():
        assert False

    @pytest.mark.fp8_property("PROV-003")
    def test_errors(broken):
        pass

    @pytest.mark.fp8_property("PROV-004")
    def test_skips():
        pytest.skip("not today")

    @pytest.mark.fp8_property("VAL-001")
    def test_unclaimed():
        pass

    @pytest.mark.fp8_property("PROV-005")
    def test_should():
        pass

    @pytest.mark.fp8_property("PROV-006")
    class TestCitedByClass:
        def test_a(self):
            pass

        @pytest.mark.fp8_property("PROV-001")
        def test_b(self):
            pass

    def test_uncited():
        pass
"""

EXPECTED = {
    "PROV-001": ("MUST", "pass", 3),
    "PROV-002": ("MUST", "fail", 2),
    "PROV-003": ("MUST", "error", 1),
    "PROV-004": ("MUST", "skipped", 1),
    "PROV-005": ("SHOULD", "pass", 1),
    "PROV-006": ("MUST", "pass", 2),
    "VAL-001": ("MUST", "not_supported", 1),
}


@pytest.mark.parametrize("xdist", [False, True], ids=["serial", "xdist"])
def test_report_files_and_summary(suite, xdist):
    suite.makepyfile(test_reported=REPORTED_TESTS)
    args = [FAKE, "--fp8-report=out/conf.json", "test_reported.py"]
    if xdist:
        result = suite.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2", *args)
        result.stdout.fnmatch_lines(["*2 workers*"])
    else:
        result = run(suite, *args)
    result.assert_outcomes(passed=7, failed=1, errors=1, skipped=2)

    report = json.loads((suite.path / "out" / "conf.json").read_text())
    got = {
        pid: (row["level"], row["status"], row["tests"])
        for pid, row in report["properties"].items()
    }
    assert got == EXPECTED
    assert report["properties"]["VAL-001"]["capability"] == "validation"
    summary = report["summary"]
    assert (summary["must_passed"], summary["must_applicable"]) == (2, 4)
    assert summary["must_score"] == 0.5
    # PROV-004 (MUST) skipped: not checked, so counted against the score, with its reason.
    assert (summary["must_total"], summary["must_skipped"]) == (5, 1)
    assert summary["must_skipped_reasons"] == {"not today": ["PROV-004"]}
    assert report["backend"]["name"] == "fake" and report["backend"]["version"] == "1.2"
    assert {"python", "torch", "torchao", "hypothesis_profile"} <= set(report["environment"])
    assert report["environment"]["hypothesis_profile"] == "fp8conf-ci"
    assert "VAL-002" in report["untested"]

    markdown = (suite.path / "out" / "conf.md").read_text()
    assert "| PROV-002 | MUST | provenance | fail | 2 |" in markdown
    assert "| VAL-001 | | validation | not_supported | 1 |" in markdown
    assert "**MUST score: 2/5 passed, 1 skipped [not today: PROV-004] (backend fake 1.2)**" in markdown

    result.stdout.fnmatch_lines(
        [
            "*fp8conf conformance*",
            "PROV-003 *MUST *provenance *error *1 *0",
            "PROV-001 *MUST *provenance *pass *3",
            "MUST score: 2/5 passed, 1 skipped [not today: PROV-004] (backend fake 1.2)",
        ]
    )


def test_properties_dir_runs_only_without_paths(suite, monkeypatch, tmp_path_factory):
    assert plugin.PROPERTIES_DIR == Path(conformance.__file__).resolve().parent / "properties"
    # Outside the rootdir, like the installed package's directory.
    props = tmp_path_factory.mktemp("properties")
    (props / "conftest.py").write_text(
        "import pytest\n\n@pytest.fixture\ndef from_conftest():\n    return 42\n"
    )
    (props / "test_prop.py").write_text(
        "def test_prop(from_conftest, fp8_backend):\n    assert from_conftest == 42\n"
    )
    monkeypatch.setattr(hooks, "PROPERTIES_DIR", props)
    suite.makeini("[pytest]\ntestpaths = tests\n")
    suite.mkdir("tests")
    (suite.path / "tests" / "test_project.py").write_text("def test_project():\n    pass\n")

    result = run(suite, FAKE, "-v")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*test_prop.py::test_prop PASSED*"])

    result = run(suite, FAKE, "-v", "tests")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*tests/test_project.py::test_project PASSED*"])


PROFILE_PROBE = """
    from hypothesis import HealthCheck, settings

    def test_probe():
        current = settings.default
        assert current.deadline is None
        assert HealthCheck.differing_executors in current.suppress_health_check
        print("PROFILE", settings.get_current_profile_name(), current.max_examples,
              current.derandomize)
"""


@pytest.mark.parametrize(
    ("env", "args", "expected"),
    [
        (None, [], "PROFILE fp8conf-ci 25 True"),
        (None, ["--hypothesis-profile=fp8conf-dev"], "PROFILE fp8conf-dev 10 False"),
        ("fp8conf-ci", [], "PROFILE fp8conf-ci 25 True"),
        ("fp8conf-ci", ["--hypothesis-profile=fp8conf-thorough"], "PROFILE fp8conf-thorough 200 False"),
        # The old names, in a run with a backend: taken for the new ones, with a warning.
        ("ci", [], "PROFILE fp8conf-ci 25 True"),
        (None, ["--hypothesis-profile=thorough"], "PROFILE fp8conf-thorough 200 False"),
    ],
)
def test_hypothesis_profiles(suite, monkeypatch, env, args, expected):
    if env is None:
        monkeypatch.delenv(plugin.PROFILE_ENV, raising=False)
    else:
        monkeypatch.setenv(plugin.PROFILE_ENV, env)
    suite.makepyfile(test_probe=PROFILE_PROBE)
    result = run(suite, FAKE, "-s", *args, "test_probe.py")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"*{expected}*"])
    renamed = env == "ci" or args == ["--hypothesis-profile=thorough"]
    if renamed:
        result.stdout.fnmatch_lines(["*fp8conf's profile * is now 'fp8conf-*'*"])
    else:
        result.stdout.no_fnmatch_line("*is now 'fp8conf-*")


@pytest.mark.parametrize(
    ("env", "args", "message"),
    [
        ("ci", [], "ERROR: FP8CONF_HYPOTHESIS_PROFILE=ci: * profile 'ci' is now called 'fp8conf-ci'"),
        (None, ["--hypothesis-profile=dev"], "ERROR: --hypothesis-profile=dev: * now called 'fp8conf-dev'"),
    ],
)
def test_old_profile_names_are_a_usage_error_for_the_helper(suite, monkeypatch, env, args, message):
    if env is not None:
        monkeypatch.setenv(plugin.PROFILE_ENV, env)
    suite.makeconftest(PROFILE_CONFTEST)
    suite.makepyfile(test_probe=PROFILE_PROBE)
    result = suite.runpytest_subprocess("-p", "no:cacheprovider", *args, "test_probe.py")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_profile_helpers_for_a_project_without_a_backend(suite, monkeypatch):
    monkeypatch.setenv(plugin.PROFILE_ENV, "fp8conf-ci")
    suite.makeconftest(PROFILE_CONFTEST)
    suite.makepyfile(test_probe=PROFILE_PROBE)
    result = suite.runpytest_subprocess("-p", "no:cacheprovider", "-s", "test_probe.py")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*PROFILE fp8conf-ci 25 True*"])


#: Writes, at each xdist worker's exit, how many objects the worker had frozen (gc.freeze) by then.
FREEZE_PROBE_CONFTEST = """
import atexit
import gc
import os

def pytest_configure(config):
    if hasattr(config, "workerinput"):
        path = os.path.join(os.environ["FREEZE_PROBE_DIR"], config.workerinput["workerid"])
        atexit.register(lambda: open(path, "w").write(str(gc.get_freeze_count())))
"""


@pytest.mark.parametrize("backend", [True, False], ids=["suite-run", "no-backend"])
def test_xdist_workers_of_a_suite_run_and_only_those_freeze_their_heap_before_exiting(suite, monkeypatch, backend):
    # The shutdown of a worker holding a large heap outlasted xdist's 10 s exit wait: a worker of a
    # run with --fp8-backend freezes its heap once its reports are sent (worker_end.py); a run
    # without one is left as it is.
    probes = suite.mkdir("probes")
    monkeypatch.setenv("FREEZE_PROBE_DIR", str(probes))
    suite.makeconftest(FREEZE_PROBE_CONFTEST)
    suite.makepyfile(test_reported=REPORTED_TESTS)
    args = [FAKE, "test_reported.py"] if backend else ["test_reported.py"]
    result = suite.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2", *args)
    assert result.ret in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED), result.stdout.str()
    frozen = {path.name: int(path.read_text()) for path in probes.iterdir()}
    assert sorted(frozen) == ["gw0", "gw1"], f"each worker's exit must be seen: {frozen}"
    if backend:
        assert all(count > 0 for count in frozen.values()), f"a suite run's workers froze nothing: {frozen}"
    else:
        assert all(count == 0 for count in frozen.values()), f"a run without --fp8-backend froze a heap: {frozen}"
