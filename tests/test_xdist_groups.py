"""Under ``-n``, the tests of one ``xdist_group`` run on one worker (tests/xdist_groups.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

GROUPED = """
import os
import pytest

# Consecutive tests of one group: xdist's plain load scheduling deals them out to both workers.
@pytest.mark.parametrize("i", [pytest.param(i, marks=pytest.mark.xdist_group("first" if i < 4 else "second")) for i in range(8)])
def test_grouped(i, tmp_path_factory):
    worker = os.environ["PYTEST_XDIST_WORKER"]
    (tmp_path_factory.getbasetemp().parent / f"grouped-{i}-{worker}").touch()

@pytest.mark.parametrize("i", range(8))
def test_alone(i):
    pass
"""


def test_the_tests_of_a_group_run_on_one_worker(pytester: pytest.Pytester):
    pytester.makepyfile(xdist_groups=(Path(__file__).parent / "xdist_groups.py").read_text(), test_grouped=GROUPED)
    pytester.makeconftest('pytest_plugins = ["xdist_groups"]\n')
    result = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=16)
    result.stdout.fnmatch_lines(["*xdist: 8 tests in 2 xdist_group(s), each group on one worker*"])
    ran = [path.name.split("-") for path in pytester.path.rglob("grouped-*")]
    workers = {group: {w for _, i, w in ran if (int(i) < 4) == (group == "first")} for group in ("first", "second")}
    assert len(ran) == 8 and all(len(w) == 1 for w in workers.values()), sorted(ran)
