"""How long the README's two commands take: the main job and the test command.

Runs each command as a user would, in a subprocess from the repository root, with and without
``-n 2`` (pytest-xdist workers), first with an empty Inductor cache (cold: a fresh
``TORCHINDUCTOR_CACHE_DIR``) and then again with the cache that run left (warm). Prints the wall
time of each run, its pytest summary and, for the main job, the fewest examples any structural
(trace-and-analyse) property ran, read from its report.

    python benchmarks/bench_suite.py                          # everything (about an hour on 2 cores)
    python benchmarks/bench_suite.py --jobs main --workers 2  # a part
    python benchmarks/bench_suite.py --jsonl runs.jsonl       # keep each run as it finishes
    python benchmarks/bench_suite.py --from-jsonl runs.jsonl --write
    python benchmarks/bench_suite.py --jobs reference defect --workers 1 --no-warm --write

Jobs ``reference`` and ``defect`` time the time to a verdict: plain ``pytest --fp8-backend``
(its default profile) against the reference backend and against the same backend with one
planted defect (``tests/mutants``: backward provenance dropped), whose failures must not cost
much more than the passes they replace (goal: at most 1.5 times the reference's wall time).

The runs are measured one after another, never side by side: each would take both cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import results  # benchmarks/results.py, beside this script

ROOT = Path(__file__).resolve().parent.parent
#: Capabilities whose properties trace a model and analyse its graph (no compilation).
STRUCTURAL = ("provenance", "validation", "regions", "emulation", "graphpp")
JOBS = ("main", "tests", "reference", "defect")
#: The backend of each time-to-verdict job; ``defect`` is loaded from tests/ (on PYTHONPATH).
VERDICT_BACKENDS = {
    "reference": "reference",
    "defect": "mutants.backends:NoBackwardProvenance",
}
GOAL_RATIO = 1.5


def command(job: str, workers: int, report: Path) -> list[str]:
    """The README's command for ``job``, with ``-n workers`` when more than one."""
    xdist = ["-n", str(workers)] if workers > 1 else []
    if job == "main":
        return ["fp8conf", "check", "--report", str(report), *xdist]
    if job in VERDICT_BACKENDS:
        return [
            sys.executable, "-m", "pytest", f"--fp8-backend={VERDICT_BACKENDS[job]}",
            f"--fp8-report={report}", "-p", "no:cacheprovider", *xdist,
        ]
    return [sys.executable, "-m", "pytest", *xdist, "--hypothesis-profile=fp8conf-ci"]


def run(job: str, workers: int, cache: str, cache_dir: Path, scratch: Path, logs: Path | None = None) -> dict:
    report = scratch / f"{job}-{workers}-{cache}.json"
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir))
    if job in VERDICT_BACKENDS:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tests"), env.get("PYTHONPATH")]))
    start = time.perf_counter()
    proc = subprocess.run(command(job, workers, report), cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if logs is not None:  # the output as a piped run shows it
        logs.mkdir(parents=True, exist_ok=True)
        (logs / f"{job}-{workers}-{cache}.log").write_text(proc.stdout + proc.stderr, encoding="utf-8")
    summary = re.findall(r"(\d+ (?:passed|failed|errors?)\b[^\n]*?) in [\d.]+s", proc.stdout)
    row = {"job": job, "workers": workers, "cache": cache, "wall_s": wall, "exit": proc.returncode,
           "summary": summary[-1] if summary else proc.stdout.strip().splitlines()[-1:]}
    if job != "tests" and report.exists():
        properties = json.loads(report.read_text())["properties"].values()
        examples = [p["examples"] for p in properties if p["capability"] in STRUCTURAL]
        row["structural_examples"] = min(examples) if examples else None
        row["must"] = sum(p["status"] == "pass" for p in properties if p["level"] == "MUST")
    return row


def table(rows) -> str:
    lines = [
        "| command | workers | Inductor cache | wall s | min | result | examples per structural property (min) |",
        "|---|---:|---|---:|---:|---|---:|",
    ]
    names = {
        "main": "`fp8conf check --report ...`",
        "tests": "`python -m pytest --hypothesis-profile=fp8conf-ci`",
        "reference": "`pytest --fp8-backend=reference`",
        "defect": f"`pytest --fp8-backend={VERDICT_BACKENDS['defect']}` (planted defect)",
    }
    for r in rows:
        result = r["summary"] if r["exit"] == 0 else f"{r['summary']} (exit {r['exit']})"
        lines.append(
            f"| {names[r['job']]} | {r['workers']} | {r['cache']} | {r['wall_s']:.0f} | {r['wall_s'] / 60:.1f} | "
            f"{result} | {r.get('structural_examples', '')} |"
        )
    ratio = verdict_ratio(rows)
    if ratio is not None:
        verdict = "meets" if ratio <= GOAL_RATIO else "misses"
        lines += ["", f"Planted defect / reference wall time: {ratio:.2f}x ({verdict} the goal of at most {GOAL_RATIO}x)."]
    return "\n".join(lines)


def verdict_ratio(rows) -> float | None:
    """Wall time of the planted-defect run over the reference run's (serial, cold), if both ran."""
    wall = {r["job"]: r["wall_s"] for r in rows if r["job"] in VERDICT_BACKENDS and r["workers"] == 1 and r["cache"] == "cold"}
    return wall["defect"] / wall["reference"] if len(wall) == 2 else None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", nargs="+", choices=JOBS, default=list(JOBS))
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="xdist workers (1: no -n)")
    parser.add_argument("--no-warm", action="store_true", help="only the cold run of each")
    parser.add_argument("--logs", type=Path, help="keep each run's output in this folder")
    results.jsonl_arguments(parser, "run")
    parser.add_argument("--write", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()

    rows = []
    if args.from_jsonl:
        rows = results.read_jsonl(args.from_jsonl)
    else:
        with tempfile.TemporaryDirectory(prefix="bench-suite-") as scratch:
            for job in args.jobs:
                for workers in args.workers:
                    cache_dir = Path(scratch) / f"inductor-{job}-{workers}"
                    for cache in ("cold",) if args.no_warm else ("cold", "warm"):
                        print(f"{job}, {workers} worker(s), {cache} cache ...", flush=True)
                        rows.append(run(job, workers, cache, cache_dir, Path(scratch), args.logs))
                        print(f"  {rows[-1]['wall_s']:.0f} s: {rows[-1]['summary']}", flush=True)
                        results.append_jsonl(args.jsonl, rows[-1])
    text = table(rows)
    print(text)
    if args.write:
        import torch
        import torchao

        results.append(
            "bench_suite",
            f"CPU, {os.cpu_count()} cores, torch {torch.__version__}, torchao {torchao.__version__}, Python "
            f"{sys.version.split()[0]}; Hypothesis profile `fp8conf-ci`; each command run in a subprocess from the "
            "repository root, one at a time; cold: an empty Inductor cache, warm: the cache the cold run left. "
            "The machine's 2 cores were shared with other work during the run: re-measure on an idle machine.",
            text,
        )


if __name__ == "__main__":
    main()
