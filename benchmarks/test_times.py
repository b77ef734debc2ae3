"""Where the full verdict's time goes, run after run: the test command's time per area.

Every run of the test command prints the time per area (a test's ``xdist_group``: the mutants of
one spec area, a whole run of the suite; else its test file) and the 25 slowest tests
(``tests/timings.py``); with ``FP8CONF_TIMINGS=PATH`` it appends them to PATH as one JSON line.
This script keeps those lines in ``benchmarks/test_times.jsonl`` and prints them side by side,
so that what a change adds to the verdict shows next to the run before it.

    python benchmarks/test_times.py --run            # ./dev test, its line appended, then the table
    python benchmarks/test_times.py                  # the table of the runs recorded
    python benchmarks/test_times.py --areas 12       # more areas per run
    python benchmarks/test_times.py --jsonl other.jsonl

The times are the tests' own seconds summed over both workers (what an area costs the machine);
``wall`` is the run's, set-up of the virtual environment excluded.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ROOT / "benchmarks" / "test_times.jsonl"


def record(path: Path, extra: list[str]) -> int:
    """Run ``./dev test`` with its timings appended to ``path``; its exit status."""
    env = dict(os.environ, FP8CONF_TIMINGS=str(path))
    return subprocess.run([str(ROOT / "dev"), "test", *extra], cwd=ROOT, env=env).returncode


def load(path: Path) -> list[dict]:
    if not path.exists():
        return []
    runs = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                runs.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise SystemExit(f"{path}:{number}: not a JSON line ({exc}); remove or fix that line")
    return runs


def table(runs: list[dict], areas: int) -> str:
    if not runs:
        return "no runs recorded yet: python benchmarks/test_times.py --run"
    lines = ["| run | commit | wall s | tests s | tests | outcomes | largest areas (s) |", "|---|---|---:|---:|---:|---|---|"]
    for run in runs:
        outcomes = ", ".join(f"{n} {k}" for k, n in sorted(run.get("outcomes", {}).items()))
        largest = sorted(run["areas"].items(), key=lambda kv: -kv[1])[:areas]  # JSON keeps them by name
        top = ", ".join(f"{a} {s:.0f}" for a, s in largest)
        lines.append(f"| {run.get('at', '?')} | {run.get('commit') or '?'} | {run['wall_s']:.0f} | {run['tests_s']:.0f} | "
                     f"{run['tests']} | {outcomes} | {top} |")
    if len(runs) > 1:
        before, after = runs[-2], runs[-1]
        lines += ["", f"Change from {before.get('commit')} to {after.get('commit')}, per area (s):"]
        names = sorted(set(before["areas"]) | set(after["areas"]), key=lambda a: -abs(after["areas"].get(a, 0) - before["areas"].get(a, 0)))
        for name in names[:areas]:
            old, new = before["areas"].get(name, 0.0), after["areas"].get(name, 0.0)
            lines.append(f"  {new - old:+8.1f}  {name} ({old:.1f} -> {new:.1f})")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="store_true", help="run ./dev test first and record it")
    parser.add_argument("--jsonl", type=Path, default=DEFAULT, help=f"the runs recorded (default {DEFAULT.relative_to(ROOT)})")
    parser.add_argument("--areas", type=int, default=6, help="areas shown per run (default 6)")
    parser.add_argument("pytest_args", nargs="*", help="passed on to ./dev test with --run")
    args = parser.parse_args(argv)
    status = record(args.jsonl, args.pytest_args) if args.run else 0
    print(table(load(args.jsonl), args.areas))
    return status


if __name__ == "__main__":
    sys.exit(main())
