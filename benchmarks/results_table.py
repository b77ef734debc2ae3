"""The current figure of each performance goal, in one table, from the benchmarks' JSONL files.

Reads every ``benchmarks/*.jsonl`` it knows how to read and writes, per goal, the latest measured
figure with its date, commit, device, torch version and the command that produced it into
``docs/performance.md``, between the markers ``<!-- results-table:begin -->`` and
``<!-- results-table:end -->``; the rest of that file is left as it is. Running it twice gives the
same file, and ``tests/test_docs.py`` checks that the committed table is what it generates now.

    python benchmarks/results_table.py            # rewrite the table in docs/performance.md
    python benchmarks/results_table.py --check    # exit 1 when the committed table is not current
    python benchmarks/results_table.py --print    # print the table only

Sources:

* ``bench_depth.jsonl`` and ``bench_depth-experts.jsonl`` (``bench_depth.py``, ``--ffn dense`` and
  ``--ffn experts``): first step against depth, fp8conf regional beside ``torch.compile`` +
  ``nested_compile_region`` and ``regional_inductor``;
* ``test_times.jsonl`` (``test_times.py --run``): the wall time of the full verdict, ``./dev test``;
* ``goal_rows.jsonl``: goals whose benchmarks print a table rather than keep rows (the compile
  goals of ``goals.py`` measured on an H200 by ``bench_compile.py`` and ``bench_precompile.py``,
  ``bench_suite.py``, ``bench_passes.py``); each row carries its own figure, bound and provenance.
  Append a row when one of them is measured again.

A row without a ``commit`` field gets the commit that added it to its file (``git blame``), or
``not recorded`` outside a git checkout.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
PERFORMANCE = ROOT / "docs" / "performance.md"
BEGIN = "<!-- results-table:begin -->"
END = "<!-- results-table:end -->"
#: The goals of the first step against depth, from bench_depth's rows: fp8conf regional's first
#: step against nested_compile_region's and regional_inductor's, its growth, and its peak memory.
DEPTH_GOAL_BLOCKS = (32, 64)
REGIONAL = "fp8conf regional"
NESTED = "torch.compile + nested_compile_region"
TORCH_COMPILE = "torch.compile"
REGIONAL_INDUCTOR = "regional_inductor"
#: The full verdict (`./dev test`, what `.ci/run` runs) within ten minutes.
VERDICT_BOUND_S = 600.0
#: What test_times.jsonl rows do not record: the pins of `./dev`, on the machine CI uses.
VERDICT_DEVICE = "2-core CPU"
VERDICT_TORCH = "2.13.0+cpu (./dev's pin)"


def read_rows(path: Path) -> list[tuple[int, dict]]:
    """``(line number, row)`` of each JSON line of ``path``."""
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            rows.append((number, json.loads(line)))
    return rows


def added_by(path: Path) -> dict[int, str]:
    """Line number -> the short commit that added that line (``git blame``); empty without git."""
    try:
        out = subprocess.run(["git", "blame", "--line-porcelain", "--", path.name], cwd=path.parent,
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    commits, line = {}, None
    for entry in out.splitlines():
        parts = entry.split()
        if len(parts) >= 3 and len(parts[0]) == 40 and all(c in "0123456789abcdef" for c in parts[0]):
            line = int(parts[2])
            commits[line] = "uncommitted" if set(parts[0]) == {"0"} else parts[0][:7]
    return commits


def _commit(row: dict, number: int, blame: dict[int, str]) -> str:
    return row.get("commit") or blame.get(number, "not recorded")


def _fit(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of log(first step) against log(blocks)."""
    xs, ys = [math.log(b) for b, _ in points], [math.log(s) for _, s in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def _environment(row: dict) -> tuple[str, str]:
    """(device, torch) from a bench_depth row's ``environment`` ("2-core CPU, torch 2.13.0+cpu, ...")."""
    parts = [p.strip() for p in row.get("environment", "").split(",")]
    device = parts[0] if parts and parts[0] else row.get("device", "?")
    torch = next((p.split(" ", 1)[1] for p in parts if p.startswith("torch ")), "not recorded")
    return device, torch


def depth_goals(path: Path) -> list[dict]:
    """The first-step-against-depth goals of ``path``, for each device and recipe measured apart
    (a CPU row and a GPU row of one path are different models on different machines), from the
    latest row of each (path, blocks) there. Only rows of one machine on one day are compared
    (two hosts of one GPU model differed by 1.4x, this 2-core machine by 1.25x within a day):
    each ``host`` and ``date`` (rows without a host: a host of their own; a host name such as
    ``vm`` may name other machines on other days) has its own goals, the latest first."""
    if not path.exists():
        return []
    blame = added_by(path)
    groups: dict[tuple[str, ...], dict[tuple[str, int], tuple[int, dict]]] = {}
    last_line: dict[tuple[str, ...], int] = {}
    for number, row in read_rows(path):
        key = (row.get("device", "?"), row.get("recipe", "tensorwise"), row.get("ffn", "dense"), row.get("host", ""),
               row.get("date", ""))
        groups.setdefault(key, {})[(row["path"], row["blocks"])] = (number, row)
        last_line[key] = number
    goals = []
    for key in sorted(groups, key=lambda k: (k[:3], -last_line[k])):
        device, recipe, ffn, host, _ = key
        goals += _depth_goals_of(groups[key], blame, device, recipe, ffn, host)
    return goals


def _depth_goals_of(latest: dict[tuple[str, int], tuple[int, dict]], blame: dict[int, str], device_name: str, recipe: str,
                    ffn: str = "dense", host: str = "") -> list[dict]:
    """The depth goals from ``latest`` (path, blocks) -> (line, row), all of one device, recipe,
    feed-forward and host."""
    regional = {b: r for (p, b), (_, r) in latest.items() if p == REGIONAL and "first_step_s" in r}
    if not regional:
        return []

    def step(path_name, blocks):
        found = latest.get((path_name, blocks))
        return found[1] if found else None

    used = [latest[(REGIONAL, b)] for b in regional]
    date = max(r["date"] for _, r in used)
    commits = sorted({_commit(r, n, blame) for n, r in used})
    device, torch = _environment(used[0][1])
    if host:
        device = f"{device} ({host})"
    shape = used[0][1]
    command = (f"python benchmarks/bench_depth.py --device {device_name} --dim {shape['dim']} --heads {shape['heads']} "
               f"--vocab {shape['vocab']} --tokens {shape['tokens']} --blocks {' '.join(str(b) for b in sorted(regional))} "
               f"--recipes {recipe}"
               + (f" --ffn {ffn} --experts {shape.get('experts', 4)} --top-k {shape.get('top_k', 2)}" if ffn != "dense" else ""))
    common = {"date": date, "commit": ", ".join(commits), "device": device, "torch": torch, "command": command}
    where = f" ({recipe}, {device_name})" if ffn == "dense" else f" ({recipe}, {ffn}, {device_name})"
    goals = []

    def versus(other: str, bound: float, what: str, field: str = "first_step_s", timeout_ok: bool = True):
        figures, verdicts = [], []
        for blocks in DEPTH_GOAL_BLOCKS:
            mine, theirs = regional.get(blocks), step(other, blocks)
            if not mine or not theirs:
                continue
            if field in theirs:
                value = mine[field] / theirs[field]
                figures.append(f"{value:.2f} at {blocks} blocks")
                verdicts.append(value <= bound)
            elif theirs.get("timed_out") and timeout_ok:
                limit = float(theirs["error"].split()[-2])
                value = mine[field] / limit
                figures.append(f"< {value:.2f} at {blocks} blocks ({other} timed out after {limit:.0f} s)")
                verdicts.append(value <= bound)
            elif theirs.get("error"):
                figures.append(f"at {blocks} blocks {other} failed: {theirs['error'].splitlines()[0][:120]}")
        if figures:
            goals.append({"goal": what + where, "bound": f"<= {bound}", "figure": "; ".join(figures),
                          "verdict": ("met" if all(verdicts) else "missed") if verdicts else "not measured", **common})

    versus(NESTED, 0.5, "fp8conf regional first step vs torch.compile + nested_compile_region")
    versus(REGIONAL_INDUCTOR, 0.2, "fp8conf regional first step vs regional_inductor")
    if len(regional) >= 2:
        exponent = _fit(sorted((b, r["first_step_s"]) for b, r in regional.items()))
        goals.append({"goal": "fp8conf regional first step against depth: fitted exponent" + where, "bound": "<= 1.1",
                      "figure": f"{exponent:.2f} ({min(regional)} to {max(regional)} blocks)",
                      "verdict": "met" if exponent <= 1.1 else "missed", **common})
    versus(NESTED, 1.0, "fp8conf regional peak memory vs torch.compile + nested_compile_region", field="peak_gib", timeout_ok=False)
    if device_name != "cpu":  # a shared 2-core CPU's steady steps are no throughput figure (docs/performance.md)
        for other in (TORCH_COMPILE, NESTED):
            versus(other, 1.0, f"fp8conf regional steady step time vs {other} (throughput >= 1.0x)", field="step_s", timeout_ok=False)
    return goals


def verdict_goal(path: Path) -> list[dict]:
    """The full verdict's wall time, from the last run of ``test_times.jsonl``."""
    if not path.exists():
        return []
    rows = read_rows(path)
    if not rows:
        return []
    number, run = rows[-1]
    outcomes = ", ".join(f"{n} {k}" for k, n in sorted(run.get("outcomes", {}).items()))
    wall = run["wall_s"]
    return [{
        "goal": "the full verdict (./dev test, what .ci/run runs): wall time", "bound": f"<= {VERDICT_BOUND_S:.0f} s",
        "figure": f"{wall:.0f} s ({outcomes})", "verdict": "met" if wall <= VERDICT_BOUND_S else "missed",
        "date": run.get("at", "?")[:10], "commit": _commit(run, number, added_by(path)),
        "device": run.get("device", VERDICT_DEVICE), "torch": run.get("torch", VERDICT_TORCH),
        "command": "python benchmarks/test_times.py --run",
    }]


def recorded_goals(path: Path) -> list[dict]:
    """Rows that carry their goal, figure and provenance themselves (``goal_rows.jsonl``): the
    latest row of each goal and config."""
    if not path.exists():
        return []
    latest: dict[tuple[str, str], dict] = {}
    for _, row in read_rows(path):
        key = (row["goal"], row.get("config", ""))
        if key not in latest or row["date"] >= latest[key]["date"]:
            latest[key] = row
    goals = []
    for (goal, config), row in latest.items():
        goals.append({"goal": f"{goal} ({config})" if config else goal, "bound": row["bound"], "figure": row["figure"],
                      "verdict": row["verdict"], "date": row["date"], "commit": row["commit"], "device": row["device"],
                      "torch": row["torch"], "command": row["command"]})
    return goals


def goals(benchmarks: Path = BENCHMARKS) -> list[dict]:
    return (verdict_goal(benchmarks / "test_times.jsonl") + depth_goals(benchmarks / "bench_depth.jsonl")
            + depth_goals(benchmarks / "bench_depth-experts.jsonl") + recorded_goals(benchmarks / "goal_rows.jsonl"))


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|")


def table(rows: list[dict]) -> str:
    lines = [
        "| goal | bound | latest figure | verdict | date | commit | device | torch | command |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append("| " + " | ".join(_cell(r[k]) if k != "command" else f"`{r[k]}`" for k in
                                       ("goal", "bound", "figure", "verdict", "date", "commit", "device", "torch", "command")) + " |")
    return "\n".join(lines)


def render(text: str, rows: list[dict]) -> str:
    """``text`` with the part between the markers replaced by the table of ``rows``."""
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{PERFORMANCE}: the markers {BEGIN} and {END} are missing")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    note = ("<!-- generated by `python benchmarks/results_table.py` from benchmarks/*.jsonl; edit the rows, "
            "not this table -->")
    return f"{head}{BEGIN}\n{note}\n\n{table(rows)}\n\n{END}{tail}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when docs/performance.md is not current")
    parser.add_argument("--print", action="store_true", help="print the table only")
    args = parser.parse_args(argv)
    rows = goals()
    if args.print:
        print(table(rows))
        return 0
    text = PERFORMANCE.read_text(encoding="utf-8")
    wanted = render(text, rows)
    if args.check:
        if wanted != text:
            print(f"{PERFORMANCE.relative_to(ROOT)} is not current: run python benchmarks/results_table.py", file=sys.stderr)
            return 1
        return 0
    if wanted != text:
        PERFORMANCE.write_text(wanted, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
