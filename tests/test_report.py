"""The conformance report, expectations, spec versions, reproducers and hang handling of the
plugin (conformance/plugin/), run through pytester with torch-free fake backends.

In-process runs (``run``) are fast; runs with ``-n 2`` or a hang that must kill a process go
through a subprocess. The failing fake properties mimic :func:`conformance.run.harness.fail`, whose
message ends with the drawn model as Python (the harness itself imports torch).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import shlex

import pytest

from conformance.api import spec as spec_module
from conformance.api.spec import SPEC_VERSION
import fake_backends  # tests/fake_backends.py (tests/ is on sys.path)

pytest_plugins = ["pytester"]

FAKE_BACKENDS = fake_backends.BASE + """
    class Newer(Fake):
        spec_version = "9.1"

    class Sleepy(Fake):
        name = "sleepy"

        def provenance(self, node):
            self.is_backward(node)
            return None

        def is_backward(self, node):
            time.sleep(3600)  # only --fp8-timeout ends it: finishing would take an hour
            return False
"""

FAKE = "--fp8-backend=fakebackends:Fake"

# PROV-001 passes and logs every call; PROV-002 fails from x >= 3 (minimal failing x: 3), with
# a message like conformance.run.harness.fail's; PROV-003 is a plain test.
PROPERTY_TESTS = """
    import os
    import pytest
    from hypothesis import given, strategies as st
    from conformance.report.replay import MODEL_MARKER

    def _log(name, x):
        with open(f"calls_{name}_{os.getpid()}.txt", "a") as f:
            f.write(f"{x}\\n")

    @pytest.mark.fp8_property("PROV-001")
    @given(x=st.integers(0, 100))
    def test_PROV_001_passes(fp8_backend, x):
        _log("PROV_001", x)

    @pytest.mark.fp8_property("PROV-002")
    @given(x=st.integers(0, 100))
    def test_PROV_002_fails(fp8_backend, x):
        _log("PROV_002", x)
        if x >= 3:
            pytest.fail(
                f"[PROV-002] MUST: provenance equals the config\\nexpected x < 3, saw x={x}"
                f"\\n\\n{MODEL_MARKER}\\nx = {x}\\n",
                pytrace=False,
            )

    @pytest.mark.fp8_property("PROV-003")
    def test_PROV_003_plain():
        pass
"""


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(fakebackends=FAKE_BACKENDS)
    pytester.syspathinsert()
    return pytester


def run(pytester: pytest.Pytester, *args: str, subprocess: bool = False) -> pytest.RunResult:
    common = ("-p", "no:cacheprovider", "-p", "no:randomly")
    if subprocess:
        return pytester.runpytest_subprocess(*common, *args)
    return pytester.runpytest(*common, *args)


def calls(pytester: pytest.Pytester, name: str) -> list[int]:
    found = []
    for path in sorted(pytester.path.glob(f"calls_{name}_*.txt")):
        found += [int(line) for line in path.read_text().split()]
    return found


def read_report(pytester: pytest.Pytester, name: str = "out/conf.json") -> dict:
    return json.loads((pytester.path / name).read_text())


def write_json(pytester: pytest.Pytester, name: str, data: dict) -> str:
    (pytester.path / name).write_text(json.dumps(data))
    return name


# -- the report ------------------------------------------------------------------------------
@pytest.mark.parametrize("xdist", [False, True], ids=["serial", "xdist"])
def test_report_header_fields_examples_and_reproducer(suite, xdist):
    suite.makepyfile(test_props=PROPERTY_TESTS)
    args = [FAKE, "--fp8-report=out/conf.json", "--hypothesis-profile=fp8conf-ci", "test_props.py"]
    result = run(suite, "-n", "2", *args, subprocess=True) if xdist else run(suite, *args)
    result.assert_outcomes(passed=2, failed=1)
    report = read_report(suite)

    assert report["schema_version"] == 3
    assert report["suite"] == {"name": "fp8conf", "version": importlib.metadata.version("fp8conf")}
    assert report["spec_version"] == report["checked_spec_version"] == SPEC_VERSION
    assert report["backend"]["spec_version"] == SPEC_VERSION
    env = report["environment"]
    assert env["hypothesis_profile"] == "fp8conf-ci"
    assert env["device"] == "cpu" or env["device"].startswith("cuda:")
    assert (env["compute_capability"] is None) == (env["device"] == "cpu")
    assert report["options"]["timeout_s"] == 300

    rows = report["properties"]
    # Every example Hypothesis ran (no shrinking for a passing test) and nothing else.
    assert rows["PROV-001"]["examples"] == len(calls(suite, "PROV_001")) == 25
    assert rows["PROV-001"]["reproducer"] is None
    assert rows["PROV-003"]["examples"] == 1
    failing = rows["PROV-002"]
    assert failing["status"] == "fail"
    # Shrinking is not counted: the examples are fewer than the calls made.
    assert 1 <= failing["examples"] < len(calls(suite, "PROV_002"))
    found = failing["reproducer"]
    assert found["test"] == "test_props.py::test_PROV_002_fails"
    assert found["message"] == "[PROV-002] MUST: provenance equals the config\nexpected x < 3, saw x=3"
    assert found["model"] == "x = 3\n"
    # Profile fp8conf-ci is derandomized: the seed follows from the test, none in the command.
    assert found["command"] == (
        "pytest --fp8-backend=fakebackends:Fake 'test_props.py::test_PROV_002_fails' "
        "--hypothesis-profile=fp8conf-ci"
    )
    assert found["reproduce_failure"].startswith("@reproduce_failure(")  # fp8conf-ci prints the blob
    assert "x=3" in found["failing_case"]

    result.stdout.fnmatch_lines(
        [
            "*fp8conf reproducer*",
            "Replay:",
            "  pytest --fp8-backend=fakebackends:Fake 'test_props.py::test_PROV_002_fails' "
            "--hypothesis-profile=fp8conf-ci",
            "Or decorate the test with:",
            "  @reproduce_failure(*",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "*fp8conf conformance*",
            "property *level *capability *status *tests *examples",
            "PROV-001 *MUST *provenance *pass *1 *25",
            "MUST score: 2/3 passed (backend fake 1.2)",
            "PROV-002 fail: test_props.py::test_PROV_002_fails",
            "  replay: pytest --fp8-backend=fakebackends:Fake 'test_props.py::test_PROV_002_fails' "
            "--hypothesis-profile=fp8conf-ci",
        ]
    )

    markdown = (suite.path / "out" / "conf.md").read_text()
    assert "| PROV-001 | MUST | provenance | pass | 1 | 25 |" in markdown
    assert "report schema 3" in markdown and "device cpu" in markdown or "device cuda:" in markdown
    assert "## Failures" in markdown and "### PROV-002 (fail)" in markdown
    assert "```python\nx = 3\n```" in markdown
    assert found["command"] in markdown


def test_replay_command_carries_the_seed_and_replays(suite):
    suite.makepyfile(test_props=PROPERTY_TESTS)
    result = run(suite, FAKE, "--fp8-report=out/conf.json", "--hypothesis-profile=fp8conf-dev", "test_props.py")
    result.assert_outcomes(passed=2, failed=1)
    command = read_report(suite)["properties"]["PROV-002"]["reproducer"]["command"]
    words = shlex.split(command)
    assert words[:4] == [
        "pytest", "--fp8-backend=fakebackends:Fake", "test_props.py::test_PROV_002_fails",
        "--hypothesis-profile=fp8conf-dev",
    ]
    assert words[4].startswith("--hypothesis-seed=") and words[4].split("=")[1].isdigit()
    assert len(words) == 5

    replayed = run(suite, *words[1:], "--fp8-report=out/replay.json")
    replayed.assert_outcomes(failed=1)
    again = read_report(suite, "out/replay.json")["properties"]["PROV-002"]["reproducer"]
    assert again["model"] == "x = 3\n"
    assert again["command"] == command


# -- expectations ----------------------------------------------------------------------------
EXPECTATIONS = {
    "PROV-002": {"reason": "known bug", "link": "https://example.org/issues/7"},
    "test_props.py::test_PROV_001_passes": "was flaky",
}


@pytest.mark.parametrize("xdist", [False, True], ids=["serial", "xdist"])
def test_expectations_xfail_xpass_and_no_shrinking(suite, xdist):
    suite.makepyfile(test_props=PROPERTY_TESTS)
    path = write_json(suite, "expected.json", EXPECTATIONS)
    args = [FAKE, "--fp8-report=out/conf.json", f"--fp8-expectations={path}", "-rxX", "test_props.py"]
    result = run(suite, "-n", "2", *args, subprocess=True) if xdist else run(suite, *args)
    result.assert_outcomes(passed=1, xfailed=1, xpassed=1)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(
        [
            "XFAIL test_props.py::test_PROV_002_fails - expected failure (PROV-002): known bug "
            "<https://example.org/issues/7>",
            "XPASS test_props.py::test_PROV_001_passes*expected failure "
            "(test_props.py::test_PROV_001_passes): was flaky",
        ]
    )
    report = read_report(suite)
    rows = report["properties"]
    assert rows["PROV-002"]["status"] == "xfail"
    assert rows["PROV-002"]["expectations"] == {
        "PROV-002": {"reason": "known bug", "link": "https://example.org/issues/7"}
    }
    assert rows["PROV-002"]["reproducer"]["test"] == "test_props.py::test_PROV_002_fails"
    assert rows["PROV-001"]["status"] == "xpass"
    assert rows["PROV-001"]["expectations"] == {
        "test_props.py::test_PROV_001_passes": {"reason": "was flaky", "link": None}
    }
    # xfail is applicable and not passed; xpass passed every test.
    summary = report["summary"]
    assert (summary["must_passed"], summary["must_applicable"]) == (2, 3)
    # No shrinking: the examples until the first failure, then Hypothesis's one final replay.
    assert len(calls(suite, "PROV_002")) == rows["PROV-002"]["examples"] + 1
    result.stdout.fnmatch_lines(["PROV-001 xpass: expected to fail, passed; drop its expectations entry"])
    assert report["options"]["expectations"] == str(suite.path / path)
    markdown = (suite.path / "out" / "conf.md").read_text()
    assert "- PROV-002 xfail: expected to fail (PROV-002): known bug (https://example.org/issues/7)" in markdown


def test_expectations_in_toml(suite):
    suite.makepyfile(test_props=PROPERTY_TESTS)
    (suite.path / "expected.toml").write_text(
        '[PROV-002]\nreason = "known bug"\n\n["test_props.py::test_PROV_003_plain"]\nreason = "x"\n'
    )
    result = run(suite, FAKE, "--fp8-expectations=expected.toml", "test_props.py")
    result.assert_outcomes(passed=1, xfailed=1, xpassed=1)


def test_expectation_matching_no_test_is_a_usage_error(suite):
    suite.makepyfile(test_props=PROPERTY_TESTS)
    path = write_json(suite, "expected.json", {"PROV-004": "nothing cites it", "PROV-002": "bug"})
    result = run(suite, FAKE, f"--fp8-expectations={path}", "test_props.py")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["ERROR: --fp8-expectations: entry 'PROV-004' matches no collected test"]
    )


def test_expectation_matching_no_test_under_xdist_runs_nothing(suite):
    suite.makepyfile(test_props=PROPERTY_TESTS)
    path = write_json(suite, "expected.json", {"test_props.py::test_gone": "renamed"})
    result = run(suite, "-n", "2", FAKE, f"--fp8-expectations={path}", "test_props.py", subprocess=True)
    assert result.ret != pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["*entry 'test_props.py::test_gone' matches no collected test*"])
    assert not calls(suite, "PROV_001")


def test_expectation_of_a_deselected_test_is_fine(suite):
    suite.makepyfile(test_props=PROPERTY_TESTS)
    path = write_json(suite, "expected.json", {"PROV-002": "bug"})
    result = run(suite, FAKE, f"--fp8-expectations={path}", "-k", "PROV_003", "test_props.py")
    result.assert_outcomes(passed=1)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"PROV-999": "typo"}', "entry 'PROV-999' is not a property of the spec"),
        ('{"PROV-001": {"reason": ""}}', "entry 'PROV-001' needs a non-empty reason"),
        ('{"PROV-001": {"reason": "r", "url": "u"}}', "entry 'PROV-001' has unknown fields *'url'*"),
        ('["PROV-001"]', "*expected an object mapping property or test IDs to reasons"),
        ("{not json", "*not valid JSON*"),
    ],
)
def test_bad_expectations_file_is_a_usage_error(suite, content, message):
    (suite.path / "expected.json").write_text(content)
    result = run(suite, FAKE, "--fp8-expectations=expected.json", str(suite.path))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: --fp8-expectations: *{message}"])


@pytest.mark.parametrize("option", ["--fp8-expectations=x.json", "--fp8-spec-version=1.0"])
def test_options_need_a_backend(suite, option):
    result = run(suite, option)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: {option.split('=')[0]} needs --fp8-backend"])


# -- spec versions ---------------------------------------------------------------------------
# A spec version after every real one, so that the cases hold whatever SPEC_VERSION is.
@pytest.fixture
def prov_002_since_9_1(monkeypatch):
    prop = spec_module.PROPERTIES["PROV-002"]
    monkeypatch.setitem(spec_module.PROPERTIES, "PROV-002", dataclasses.replace(prop, since="9.1"))


SPEC_TESTS = """
    import pytest

    @pytest.mark.fp8_property("PROV-001")
    def test_old():
        pass

    @pytest.mark.fp8_property("PROV-002")
    def test_new():
        pass
"""


@pytest.mark.parametrize(
    ("args", "checked", "new_status"),
    [
        ([FAKE], spec_module.SPEC_VERSION, "not_supported"),
        ([FAKE, "--fp8-spec-version=9.1"], "9.1", "pass"),
        (["--fp8-backend=fakebackends:Newer"], "9.1", "pass"),
        (["--fp8-backend=fakebackends:Newer", "--fp8-spec-version=1.0"], "1.0", "not_supported"),
    ],
)
def test_properties_newer_than_the_spec_version_are_skipped(
    suite, prov_002_since_9_1, args, checked, new_status
):
    suite.makepyfile(test_spec=SPEC_TESTS)
    result = run(suite, *args, "--fp8-report=out/conf.json", "-rs", "test_spec.py")
    report = read_report(suite)
    assert report["checked_spec_version"] == checked
    rows = report["properties"]
    assert rows["PROV-001"]["status"] == "pass"
    assert rows["PROV-002"]["status"] == new_status
    assert rows["PROV-002"]["since"] == "9.1"
    if new_status == "not_supported":
        reason = (
            f"not_in_spec_version: backend 'fake' is checked against spec {checked}; "
            "property PROV-002 is since spec 9.1"
        )
        assert rows["PROV-002"]["reason"] == reason
        result.stdout.fnmatch_lines([f"SKIPPED*{reason}"])
        assert report["summary"]["must_applicable"] == 1


def test_bad_spec_version_is_a_usage_error(suite):
    result = run(suite, FAKE, "--fp8-spec-version=latest", str(suite.path))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: --fp8-spec-version 'latest' is not a version like '{spec_module.SPEC_VERSION}'"])


# -- hangs -----------------------------------------------------------------------------------
HANGING_TESTS = """
    import pytest
    from hypothesis import given, strategies as st

    @pytest.mark.fp8_property("PROV-001")
    def test_hangs(fp8_backend):
        fp8_backend.provenance(object())

    seen = []

    @pytest.mark.fp8_property("PROV-002")
    @given(x=st.integers())
    def test_hangs_at_third_example(fp8_backend, x):
        seen.append(x)
        if len(seen) == 3:
            fp8_backend.is_backward(object())

    @pytest.mark.fp8_property("PROV-003")
    def test_after(fp8_backend):
        pass
"""


@pytest.mark.parametrize("xdist", [False, True], ids=["serial", "xdist"])
def test_a_hanging_backend_method_is_an_error_naming_it(suite, xdist):
    suite.makepyfile(test_hang=HANGING_TESTS)
    args = ["--fp8-backend=fakebackends:Sleepy", "--fp8-timeout=1", "--fp8-report=out/conf.json", "test_hang.py"]
    if xdist:
        args = ["-n", "2", *args]
    result = run(suite, *args, subprocess=True)
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(
        [
            "*BackendTimeout: test_hang.py::test_hangs: an example ran longer than 1 s "
            "(--fp8-timeout) while in backend method is_backward() of backend 'sleepy'",
        ]
    )
    rows = read_report(suite)["properties"]
    assert rows["PROV-001"]["status"] == "error"
    assert "while in backend method is_backward()" in rows["PROV-001"]["reproducer"]["message"]
    # The Hypothesis test stops at the hanging example: no shrinking, no replay.
    assert rows["PROV-002"]["status"] == "error"
    assert rows["PROV-002"]["examples"] == 3
    assert rows["PROV-003"]["status"] == "pass"


def test_a_hang_under_the_thread_method_is_an_error_under_xdist(suite):
    # pytest-timeout's thread method ends the worker; before that the worker reports the
    # timeout naming the method, and xdist reports the crash.
    suite.makepyfile(test_hang=HANGING_TESTS)
    result = run(
        suite, "-n", "2", "--fp8-backend=fakebackends:Sleepy", "--fp8-timeout=1",
        "-o", "timeout_method=thread", "--fp8-report=out/conf.json",
        "-k", "test_hangs and not third or test_after", "test_hang.py", subprocess=True,
    )
    result.stdout.fnmatch_lines(["*worker 'gw*' crashed while running 'test_hang.py::test_hangs'*"])
    rows = read_report(suite)["properties"]
    assert rows["PROV-001"]["status"] == "error"
    message = rows["PROV-001"]["reproducer"]["message"]
    assert message == (
        "test_hang.py::test_hangs: an example ran longer than 1 s (--fp8-timeout) "
        "while in backend method is_backward() of backend 'sleepy'"
    )
    assert rows["PROV-003"]["status"] == "pass"


TIMEOUT_PROBE = """
    import pytest

    @pytest.mark.fp8_property("PROV-001")
    def test_probe(request):
        marker = request.node.get_closest_marker("timeout")
        print("TIMEOUT", marker.args[0] if marker else None)
"""


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--hypothesis-profile=fp8conf-ci"], "300.0"),
        (["--hypothesis-profile=fp8conf-thorough"], "300.0"),  # per example: not scaled
        (["--fp8-timeout=2.5"], "2.5"),
        (["--fp8-timeout=0"], "None"),
        (["--fp8-timeout=5", "-p", "no:timeout"], "None"),
    ],
)
def test_timeout_option(suite, args, expected):
    suite.makepyfile(test_probe=TIMEOUT_PROBE)
    result = run(suite, FAKE, "-s", "--fp8-report=out/conf.json", *args, "test_probe.py")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"*TIMEOUT {expected}"])
    assert str(read_report(suite)["options"]["timeout_s"]) == expected


SLOW_BUT_PROGRESSING = """
    import time
    import pytest
    from hypothesis import given, settings, strategies as st

    @pytest.mark.fp8_property("PROV-001")
    @settings(max_examples=8, database=None)
    @given(x=st.integers())
    def test_slow(fp8_backend, x):
        time.sleep(0.3)
"""


def test_the_timeout_bounds_one_example_not_the_whole_test(suite):
    suite.makepyfile(test_slow=SLOW_BUT_PROGRESSING)
    result = run(suite, FAKE, "--fp8-timeout=1", "--durations=1", "test_slow.py", subprocess=True)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["[2-9].*s call *test_slow.py::test_slow"])  # more than 1 s in all


def test_negative_timeout_is_a_usage_error(suite):
    result = run(suite, FAKE, "--fp8-timeout=-1", str(suite.path))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --fp8-timeout must be 0 or more seconds, got -1"])


def test_fp8conf_check_passes_the_new_options(monkeypatch):
    from fp8conf.tools import cli

    seen = []
    monkeypatch.setattr(pytest, "main", lambda args: seen.append(args) or 0)
    assert cli.main(
        ["check", "--backend", "mine", "--expectations", "x.json", "--spec-version", "1.0", "--timeout", "60"]
    ) == 0
    assert {"--fp8-expectations=x.json", "--fp8-spec-version=1.0", "--fp8-timeout=60"} <= set(seen[0])
    assert cli.main(["check"]) == 0
    assert not [a for a in seen[1] if a.startswith(("--fp8-expectations", "--fp8-spec-version", "--fp8-timeout"))]


BUILT_TESTS = """
    import pytest
    from conformance.observe import evidence

    @pytest.mark.fp8_property("PROV-001")
    def test_PROV_001_builds(fp8_backend):
        evidence.built([("stacks", "float8_linear", "mytrainer.Float8Linear", "rowwise", "convert_float8")])

    @pytest.mark.fp8_property("PROV-002")
    def test_PROV_002_builds(fp8_backend):
        evidence.built([("stacks", "float8_linear", "mytrainer.Float8Linear", "rowwise_with_gw_hp", "convert_float8"),
                        ("llama", "float8_linear", "torchao.Float8Linear", "tensorwise", "TorchAO")])
"""


@pytest.mark.parametrize("xdist", [False, True], ids=["serial", "xdist"])
def test_the_report_names_the_modules_each_family_was_built_with(suite, xdist):
    suite.makepyfile(test_props=BUILT_TESTS)
    args = [FAKE, "--fp8-report=out/conf.json", "test_props.py"]
    result = run(suite, "-n", "2", *args, subprocess=True) if xdist else run(suite, *args)
    result.assert_outcomes(passed=2)
    assert read_report(suite)["built_with"] == [
        {"family": "llama", "kind": "float8_linear", "module": "torchao.Float8Linear", "built_by": "TorchAO",
         "recipes": ["tensorwise"], "properties": ["PROV-002"]},
        {"family": "stacks", "kind": "float8_linear", "module": "mytrainer.Float8Linear", "built_by": "convert_float8",
         "recipes": ["rowwise", "rowwise_with_gw_hp"], "properties": ["PROV-001", "PROV-002"]},
    ]
    result.stdout.fnmatch_lines(["built  stacks: float8_linear as mytrainer.Float8Linear (built by convert_float8; recipes rowwise, rowwise_with_gw_hp)"])
    assert "| stacks | float8_linear | `mytrainer.Float8Linear` | convert_float8 | rowwise, rowwise_with_gw_hp |" in (suite.path / "out/conf.md").read_text()
