"""Tables of ``bench_compile.py``'s rows: throughput and memory per configuration, cold start
versus depth, and the compile goals with a verdict each."""

from __future__ import annotations

import re
import statistics

CONDITIONS = (
    "Throughput: median of interleaved rounds (min-max in brackets), ratios between medians of the same run. "
    "Peak: what the variant allocates itself, compilation included; step peak: the same over two steps after the first. First step: build, trace, compile and one step, with one empty "
    "Inductor cache per configuration shared by its variants in table order (each depth row: an empty cache of its own). "
    "Kernels/step and GPU busy from torch.profiler over 3 steps."
)
#: The depths the cold-start goals compare (the issue's 2 and 32 blocks).
GOAL_DEPTHS = (2, 32)
#: The debug model's depth: its first-step goal is read from a depth row of this many blocks
#: (a fresh process and an empty cache of its own). The configurations' first steps share one
#: cache in table order, so a later variant finds kernels an earlier one compiled.
DEBUG_DEPTH = 6
#: Dense FP8 matrix rate of an H200 (SXM) by its datasheet, FLOP/s.
H200_DENSE_FP8 = 1979e12


def _median(row):
    return statistics.median(row["seconds"])


def _rate(row):
    return row["tokens"] / _median(row)


def _key(row):
    return row["model"], row["recipe"]


def throughput_table(rows) -> str:
    lines = [
        "| model | recipe | variant | Mtok/s (min-max) | vs eager Float8Linear | vs torch.compile | peak GiB | peak vs torch.compile "
        "| step peak GiB | first step s | kernels/step | GPU busy % |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    by = {(*_key(r), r["variant"]): r for r in rows if r.get("seconds")}
    for r in rows:
        if r.get("depth"):
            continue
        if "error" in r:
            lines.append(f"| {r['model']} | {r['recipe']} | {r['variant']} | failed: {r['error'][:120]} | | | | | | | | |")
            continue
        base, peer = by.get((*_key(r), "eager Float8Linear")), by.get((*_key(r), "torch.compile"))
        low, high = (r["tokens"] / max(r["seconds"]) / 1e6, r["tokens"] / min(r["seconds"]) / 1e6)
        speed = lambda other: f"{_rate(r) / _rate(other):.2f}x" if other else "n/a"  # noqa: E731
        peak = f"{r['peak_gib'] / peer['peak_gib']:.2f}x" if peer and peer["peak_gib"] == peer["peak_gib"] else "n/a"
        busy = f"{100 * r['gpu_busy_ms'] / (_median(r) * 1e3):.0f}" if r["gpu_busy_ms"] == r["gpu_busy_ms"] else "n/a"
        kernels = f"{r['kernels']:.0f}" if r["kernels"] == r["kernels"] else "n/a"
        step_peak = f"{r['step_peak_gib']:.2f}" if "step_peak_gib" in r else "n/a"
        lines.append(
            f"| {r['model']} | {r['recipe']} | {r['variant']} | {_rate(r) / 1e6:.3f} ({low:.3f}-{high:.3f}) | {speed(base)} | "
            f"{speed(peer)} | {r['peak_gib']:.2f} | {peak} | {step_peak} | {r['first_step_s']:.1f} | {kernels} | {busy} |"
        )
    return "\n".join(lines)


def _depth_runs(rows) -> dict:
    """``(variant, blocks)``: its depth rows, one per round of ``--depth-repeats``."""
    runs: dict = {}
    for r in rows:
        if r.get("depth"):
            runs.setdefault((r["variant"], r["blocks"]), []).append(r)
    return runs


def first_steps(rows) -> dict:
    """``(variant, blocks)``: the median first step of its depth rows that finished."""
    times = {key: [r["first_step_s"] for r in runs if r.get("first_step_s")] for key, runs in _depth_runs(rows).items()}
    return {key: statistics.median(values) for key, values in times.items() if values}


def depth_table(rows) -> str:
    depth = [r for r in rows if r.get("depth")]
    if not depth:
        return ""
    blocks = sorted({r["blocks"] for r in depth})
    by_key = _depth_runs(depth)
    # The worker variants measured, by their number of helpers: a column each.
    pooled = sorted({r["variant"] for r in depth if re.search(r", \d+ workers?$", r["variant"])},
                    key=lambda v: int(re.search(r"(\d+) workers?$", v).group(1)))
    lines = [
        "| blocks | torch.compile s | fp8conf full s | fp8conf regional s | regional vs torch.compile | regional vs its own at "
        f"{blocks[0]} blocks | regions / Inductor compiles (regional) |" + "".join(f" regional{v[len('fp8conf regional'):]} s |" for v in pooled),
        "|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(pooled),
    ]

    def seconds(variant, n):
        runs = by_key.get((variant, n))
        if not runs:
            return None, "not run"
        times = sorted(r["first_step_s"] for r in runs if "error" not in r)
        if not times:
            r = runs[-1]
            return None, "timed out" if r.get("timed_out") else "not run" if r.get("skipped") else "failed"
        median = statistics.median(times)
        spread = f" ({times[0]:.1f}-{times[-1]:.1f})" if len(times) > 1 else ""
        failed = f", {len(runs) - len(times)} failed" if len(times) < len(runs) else ""
        return median, f"{median:.1f}{spread}{failed}"

    for n in blocks:
        tc, tc_text = seconds("torch.compile", n)
        _, full_text = seconds("fp8conf full", n)
        reg, reg_text = seconds("fp8conf regional", n)
        first, _ = seconds("fp8conf regional", blocks[0])
        ratio = f"{reg / tc:.2f}x" if reg and tc else "n/a"
        own = f"{reg / first:.2f}x" if reg and first else "n/a"
        r = next((r for r in by_key.get(("fp8conf regional", n), []) if "inductor_compiles" in r), {})
        compiles = f"{r['regions']} / {r['inductor_compiles']}" if "inductor_compiles" in r else "n/a"
        extra = "".join(f" {seconds(v, n)[1]} |" for v in pooled)
        lines.append(f"| {n} | {tc_text} | {full_text} | {reg_text} | {ratio} | {own} | {compiles} |{extra}")
    return "\n".join(lines)


def _verdict(value, bound, above: bool) -> tuple[str, str]:
    if value is None or value != value:  # absent, or NaN (no CUDA memory statistics on CPU)
        return "n/a", "not measured"
    met = value >= bound if above else value <= bound
    return f"{value:.2f}", "met" if met else "missed"


def goal_table(rows) -> str:
    by = {(*_key(r), r["variant"]): r for r in rows if r.get("seconds")}
    cold = first_steps(rows)
    configs = sorted({_key(r) for r in rows if r.get("seconds") and r["model"].startswith("llama")})
    lines = ["| goal | config | measured | bound | verdict |", "|---|---|---:|---:|---|"]

    def ratio(config, variant, field):
        a, b = by.get((*config, variant)), by.get((*config, "torch.compile"))
        if not a or not b:
            return None
        return _rate(a) / _rate(b) if field == "speed" else a[field] / b[field]

    def add(goal, config, value, bound, above):
        measured, verdict = _verdict(value, bound, above)
        lines.append(f"| {goal} | {config} | {measured} | {'>=' if above else '<='} {bound} | {verdict} |")

    if cold:
        low, high = GOAL_DEPTHS
        reg_low, reg_high, tc_high = cold.get(("fp8conf regional", low)), cold.get(("fp8conf regional", high)), cold.get(("torch.compile", high))
        add(f"regional cold start at {high} blocks vs its own at {low}", "llama dim256", reg_high / reg_low if reg_low and reg_high else None, 1.5, False)
        tc_row = next((r for r in rows if r.get("depth") and r["variant"] == "torch.compile" and r["blocks"] == high), {})
        if reg_high and not tc_high and tc_row.get("timeout_s"):
            # torch.compile ran out of time: the ratio is at most what it would be had it just finished.
            value = reg_high / tc_row["timeout_s"]
            lines.append(f"| regional cold start vs torch.compile at {high} blocks | llama dim256 | < {value:.2f} (torch.compile "
                         f"timed out at {tc_row['timeout_s']:.0f} s) | <= 0.4 | {'met' if value <= 0.4 else 'not measured'} |")
        else:
            add(f"regional cold start vs torch.compile at {high} blocks", "llama dim256", reg_high / tc_high if reg_high and tc_high else None, 0.4, False)
        reg_debug, tc_debug = cold.get(("fp8conf regional", DEBUG_DEPTH)), cold.get(("torch.compile", DEBUG_DEPTH))
        add(f"regional first step vs torch.compile ({DEBUG_DEPTH} blocks, own process and cache)", "llama dim256",
            reg_debug / tc_debug if reg_debug and tc_debug else None, 0.5, False)
    for config in configs:
        name = f"{config[0]} {config[1]}"
        debug = "dim256" in config[0]
        if debug and not cold:
            lines.append(f"| regional first step vs torch.compile | {name} | n/a | <= 0.5 | not measured: first steps of one "
                         f"configuration share a cache; run --depth {DEBUG_DEPTH} |")
        add("regional peak vs torch.compile", name, ratio(config, "fp8conf regional", "peak_gib"), 1.1, False)
        add("full throughput vs torch.compile", name, ratio(config, "fp8conf full", "speed"), 1.0, True)
        add("full peak vs torch.compile", name, ratio(config, "fp8conf full", "peak_gib"), 1.05, False)
        add("regional throughput vs torch.compile", name, ratio(config, "fp8conf regional", "speed"), 0.9 if debug else 1.0, True)
        if debug:
            add("regional + CUDA graphs throughput vs torch.compile", name, ratio(config, "fp8conf regional + CUDA graphs", "speed"), 1.5, True)
    lines.append("| warm start from a regional artifact vs regional cold start | | n/a | <= 0.15 | measured by bench_precompile.py (its own table) |")
    return "\n".join(lines)


def fp8_share(rows) -> str:
    """FP8 matmul FLOP rate of the best variant at the largest Llama configuration, as a share of the H200's dense FP8 rate."""
    llama = [r for r in rows if r.get("seconds") and r["model"].startswith("llama") and r.get("fp8_flops")]
    if not llama:
        return ""
    largest = max(r["fp8_flops"] for r in llama)
    lines = []
    for r in (r for r in llama if r["fp8_flops"] == largest):
        rate = r["fp8_flops"] / _median(r)
        lines.append(f"- {r['model']} {r['variant']}: {rate / 1e12:.0f} TFLOP/s of FP8 matmul, {100 * rate / H200_DENSE_FP8:.1f} % of the H200's dense FP8 peak ({H200_DENSE_FP8 / 1e12:.0f} TFLOP/s)")
    return "\n".join(lines)


def report(rows) -> str:
    parts = [throughput_table(rows) if any(not r.get("depth") for r in rows) else ""]
    parts += [depth_table(rows), fp8_share(rows)]
    if any(r.get("seconds") for r in rows) or any(r.get("depth") for r in rows):
        parts.append(goal_table(rows))
    return "\n\n".join(p for p in parts if p)
