"""The end of every test run says where its time went (tests/timings.py), and the JSONL it keeps
on request is what benchmarks/test_times.py tabulates."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

TIMED = """
import time
import pytest

@pytest.mark.xdist_group("slow-area")
def test_slow(record_property):
    time.sleep(0.3)
    record_property("fp8conf_sessions", ("mutants-REG", 0.25))

def test_quick():
    pass

def test_fails():
    assert False
"""


@pytest.mark.parametrize("workers", [(), ("-n", "2")], ids=["one process", "two workers"])
def test_a_run_ends_with_its_time_per_area_and_slowest_tests(pytester: pytest.Pytester, workers):
    here = Path(__file__).parent
    pytester.makepyfile(timings=(here / "timings.py").read_text(), xdist_groups=(here / "xdist_groups.py").read_text(), test_timed=TIMED)
    pytester.makeconftest('pytest_plugins = ["xdist_groups", "timings"]\n')
    record = pytester.path / "times.jsonl"
    result = pytester.runpytest_subprocess(*workers, "-p", "no:cacheprovider", f"--fp8conf-timings={record}")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*time per area*", "*s  *% *slow-area", "*s  *% *test_timed.py",
                                 "*inside the shared runs of the suite*", "*0.2 s  mutants-REG",
                                 "*25 slowest tests*", "*s  test_timed.py::test_slow"])
    (line,) = record.read_text().splitlines()
    data = json.loads(line)
    assert data["outcomes"] == {"passed": 2, "failed": 1} and data["tests"] == 3
    assert data["areas"]["slow-area"] >= 0.3 and set(data["areas"]) == {"slow-area", "test_timed.py"}
    assert data["slowest"][0][0] == "test_timed.py::test_slow"
    assert data["sessions"] == {"mutants-REG": 0.2}


def _script():
    spec = importlib.util.spec_from_file_location("test_times", Path(__file__).parent.parent / "benchmarks" / "test_times.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_benchmark_tabulates_runs_and_the_change_per_area(tmp_path):
    runs = [
        {"commit": "aaa", "wall_s": 900, "tests_s": 1700, "tests": 900, "outcomes": {"passed": 900}, "areas": {"a": 100.0, "b": 300.0}},
        {"commit": "bbb", "wall_s": 600, "tests_s": 1100, "tests": 910, "outcomes": {"passed": 910}, "areas": {"a": 120.0, "b": 50.0}},
    ]
    path = tmp_path / "runs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in runs))
    script = _script()
    text = script.table(script.load(path), areas=2)
    assert "| bbb | 600 | 1100 | 910 | 910 passed | a 120, b 50 |" in text
    assert "| aaa | 900 | 1700 | 900 | 900 passed | b 300, a 100 |" in text  # largest first, whatever the JSON order
    assert text.index("-250.0  b") < text.index("+20.0  a")  # the largest change first
    path.write_text("not json\n")
    with pytest.raises(SystemExit, match="runs.jsonl:1: not a JSON line"):
        script.load(path)


def test_the_inductor_settings_of_a_test_run_reach_inductor():
    # tests/conftest.py sets them before torch is imported; an import of Inductor above it would
    # leave them unread, and every process of the run would build the instruction-set probes and
    # the kernels' line tables again (a value set by hand is kept, and must be read as well).
    from torch._inductor import config

    assert {"TORCHINDUCTOR_VEC_ISA_OK", "AOT_INDUCTOR_ENABLE_LINE_TABLES"} <= set(os.environ)
    vec_isa_ok = {"1": True, "0": False}.get(os.environ["TORCHINDUCTOR_VEC_ISA_OK"])
    assert config.cpp.vec_isa_ok is vec_isa_ok, (config.cpp.vec_isa_ok, os.environ["TORCHINDUCTOR_VEC_ISA_OK"])
    line_tables = os.environ["AOT_INDUCTOR_ENABLE_LINE_TABLES"] == "1"
    assert config.aot_inductor.enable_line_tables is line_tables, (config.aot_inductor.enable_line_tables, line_tables)
