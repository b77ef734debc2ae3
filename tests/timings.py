"""Where the test run's time goes, printed at the end of every run and kept as JSONL on request.

At the end of a run: the 25 slowest tests, and the time per **area**: a test's ``xdist_group``
where it has one (the mutants of one spec area, a whole run of the suite), else its test file.
Times are the tests' own (setup, call and teardown, summed over both workers under ``-n``), so
an area's share says what it costs the machine, not when it ended.

``--fp8conf-timings=PATH`` (or ``FP8CONF_TIMINGS=PATH``) appends one JSON line per run to PATH:
the commit, the wall time, the outcome counts, every area's seconds and the slowest tests, so that
``benchmarks/test_times.py`` can show growth change by change.
"""

from __future__ import annotations

import collections
import datetime
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

_AREA = "fp8conf_area"
#: A test that reads a shared run of the suite (tests/suite_runs.py) may record, under this user
#: property, ``(area, seconds)`` of the sessions inside it that it judges: a shared run's time is
#: all paid by the first test to ask, and this says what its parts cost.
SESSIONS = "fp8conf_sessions"
_SLOWEST = 25


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fp8conf-timings", default=os.environ.get("FP8CONF_TIMINGS"),
                     help="append this run's time per area and slowest tests to this JSONL file")


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config, "workerinput", None) is None:  # the controller (or a run without -n) adds up
        config.pluginmanager.register(_Timings(config), "fp8conf_timings")


def area_of(item: pytest.Item) -> str:
    groups = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")})
    return "_".join(groups) or item.nodeid.split("::")[0]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # Carried in the reports, so that the controller of an -n run knows each test's area.
    item.user_properties.append((_AREA, area_of(item)))


class _Timings:
    def __init__(self, config: pytest.Config):
        self.config = config
        self.start = time.monotonic()
        self.spent: dict[str, float] = collections.defaultdict(float)
        self.areas: dict[str, str] = {}
        self.outcomes: collections.Counter = collections.Counter()
        self.sessions: dict[str, float] = collections.defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.spent[report.nodeid] += report.duration
        if report.when == "call":
            for key, value in report.user_properties:
                if key == SESSIONS:
                    area, seconds = value
                    self.sessions[area] += seconds
        area = dict(report.user_properties).get(_AREA)
        if area is not None:
            self.areas[report.nodeid] = area
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            self.outcomes[report.outcome] += 1

    def summary(self) -> dict:
        per_area: dict[str, float] = collections.defaultdict(float)
        for nodeid, seconds in self.spent.items():
            per_area[self.areas.get(nodeid, nodeid.split("::")[0])] += seconds
        slowest = sorted(self.spent.items(), key=lambda kv: -kv[1])[:_SLOWEST]
        return {
            "wall_s": round(time.monotonic() - self.start, 1),
            "tests_s": round(sum(self.spent.values()), 1),
            "tests": len(self.spent),
            "outcomes": dict(self.outcomes),
            "areas": {a: round(s, 1) for a, s in sorted(per_area.items(), key=lambda kv: -kv[1])},
            "slowest": [[nodeid, round(s, 1)] for nodeid, s in slowest],
            "sessions": {a: round(s, 1) for a, s in sorted(self.sessions.items(), key=lambda kv: -kv[1])},
        }

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.spent:
            return
        data = self.summary()
        write = terminalreporter.write_line
        terminalreporter.section("time per area (tests' own seconds, all workers)")
        for area, seconds in data["areas"].items():
            write(f"{seconds:8.1f} s  {100 * seconds / max(data['tests_s'], 1e-9):5.1f} %  {area}")
        write(f"{data['tests_s']:8.1f} s  in {data['tests']} tests, wall {data['wall_s']:.1f} s")
        if data["sessions"]:
            terminalreporter.section("inside the shared runs of the suite (sessions' seconds)")
            for area, seconds in data["sessions"].items():
                write(f"{seconds:8.1f} s  {area}")
        terminalreporter.section(f"{_SLOWEST} slowest tests")
        for nodeid, seconds in data["slowest"]:
            write(f"{seconds:8.1f} s  {nodeid}")
        path = self.config.getoption("fp8conf_timings")
        if path:
            data = {"at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": _commit(), **data}
            with Path(path).open("a", encoding="utf-8") as out:
                out.write(json.dumps(data, sort_keys=True) + "\n")
            write(f"timings appended to {path}")


def _commit() -> str | None:
    try:
        found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                               cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return found.stdout.strip() or None
