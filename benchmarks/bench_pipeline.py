"""Step time of torch.distributed.pipelining schedules over FP8 GraphPP stages, against the unsplit step.

For each schedule, ``python -m fp8conf.pipeline``'s check (:func:`fp8conf.tools.pipeline_check.launch`)
runs ``--repeats`` steps in ``--ranks`` processes and, in the same run, the same microbatches in
one process: through each stage's unsplit joint graph (the check's reference; a joint graph
needs its output's gradient as an input, so each stage's forward runs twice there) and through
eager autograd. Step times are medians over the repeats, the pipeline's taken on its slowest
rank. Informational on CPU: ranks share the machine's cores, so the pipeline cannot overlap
stages the way it does on separate GPUs, and the widths stay small because CPU ``_scaled_mm``
runs oneDNN's reference matmul.

    python benchmarks/bench_pipeline.py
    python benchmarks/bench_pipeline.py --schedules ZBVZeroBubble 1F1B --repeats 5 --write
"""

from __future__ import annotations

import argparse
import os

import torch
import torchao
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from fp8conf.pipeline import CHECKED_SCHEDULES
from fp8conf.tools.pipeline_check import launch

import results  # benchmarks/results.py, beside this script


def table(checks) -> str:
    lines = [
        "| schedule | ranks x stages | compile | step ms | unsplit joint step ms | vs unsplit joint | eager autograd step ms | vs eager autograd | W deferred | bitwise |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in checks:
        lines.append(
            f"| {c.schedule} | {c.ranks} x {c.stages_per_rank} | {c.compile or 'eager'} | {1e3 * c.step_s:.1f} | "
            f"{1e3 * c.unsplit_step_s:.1f} | {c.step_s / c.unsplit_step_s:.2f}x | {1e3 * c.eager_step_s:.1f} | "
            f"{c.step_s / c.eager_step_s:.2f}x | {c.deferred_weight_steps} | {'yes' if c.bitwise_equal else 'no'} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", nargs="+", default=list(CHECKED_SCHEDULES))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32, help="tokens per microbatch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", choices=["regional", "full"], default=None)
    parser.add_argument("--write", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    checks = []
    for schedule in args.schedules:
        # Blocks fixed across schedules (two per rank) so that every row runs the same model.
        cls = get_schedule_class(schedule)
        per_rank = 1 if issubclass(cls, PipelineScheduleSingle) else 2
        check = launch(schedule=schedule, ranks=args.ranks, stages_per_rank=per_rank, microbatches=args.microbatches,
                       dim=args.dim, blocks=2 * args.ranks,
                       tokens=args.tokens, compile=args.compile, repeats=args.repeats)
        print(check.summary(), flush=True)
        checks.append(check)
    text = table(checks)
    print(text)
    if args.write:
        results.append(
            "bench_pipeline",
            f"CPU ({os.cpu_count()} cores shared by the ranks), torch {torch.__version__}, torchao {torchao.__version__}, gloo; "
            f"{2 * args.ranks} tensorwise FP8 blocks of width {args.dim} plus a high-precision head, {args.tokens} tokens per "
            f"microbatch, {args.microbatches} microbatches; median of {args.repeats} steps; one stage per rank, or two for the "
            "multi-stage schedules (each stage then holds one block).",
            text,
        )


if __name__ == "__main__":
    main()
