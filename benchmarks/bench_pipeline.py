"""Step time and idle share of torch.distributed.pipelining schedules over FP8 GraphPP stages, against the unsplit step.

For each model, recipe, compile mode and schedule, ``python -m fp8conf.pipeline``'s check
(:func:`fp8conf.tools.pipeline_check.launch`) runs ``--repeats`` timed steps and one profiled
step in ``--ranks`` processes and, in the same run, the same microbatches in one process: through
each stage's unsplit joint graph (the check's reference; a joint graph needs its output's
gradient as an input, so each stage's forward runs twice there) and through eager autograd.
Step times are medians over the repeats, the pipeline's taken on its slowest rank. "max |diff|"
is the largest difference of any parameter gradient from the unsplit step's (0 where bitwise).
"idle" is each rank's share of the profiled step in which it computed nothing
(:mod:`fp8conf.tools.pipeline_idle`: 1 - the union of its compute intervals over the step's wall
time; on a GPU its non-NCCL kernels, on CPU its operators outside communication).

Models: ``stack``, FP8 blocks plus a high-precision head (``--dim`` wide, two blocks per rank);
``llama``, the Llama-shaped model of ``benchmarks/llama.py`` in bf16 (``--dim`` wide, 4 heads, a
256-token vocabulary, two layers per rank, the embedding on the first stage and norm and head on
the last), one sequence of ``--tokens`` per microbatch and cross-entropy loss.

On CPU (gloo) the numbers are informational: ranks share the machine's cores, so the pipeline
cannot overlap stages the way it does on separate GPUs, its idle share mixes the bubble with
contention for cores and host overhead, and the widths stay small because CPU ``_scaled_mm`` runs
oneDNN's reference matmul.

    python benchmarks/bench_pipeline.py --microbatches 4 --compile eager regional --write
    python benchmarks/bench_pipeline.py --backend nccl --models stack llama --recipes tensorwise rowwise --dim 1024 --write
"""

from __future__ import annotations

import argparse
import functools
import os

import torch
import torchao
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from fp8conf.pipeline import CHECKED_SCHEDULES
from fp8conf.tools.pipeline_check import launch

import llama  # benchmarks/llama.py, beside this script
import results  # benchmarks/results.py, beside this script


def table(rows) -> str:
    lines = [
        "| model | recipe | schedule | ranks x stages | compile | step ms | unsplit joint step ms | vs unsplit joint | "
        "eager autograd step ms | vs eager autograd | W deferred | bitwise | max abs diff | idle per rank |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for model, recipe, c in rows:
        idle = " / ".join(f"{v:.2f}" for _, v in sorted(c.idle_share.items()))
        lines.append(
            f"| {model} | {recipe} | {c.schedule} | {c.ranks} x {c.stages_per_rank} | {c.compile or 'eager'} | {1e3 * c.step_s:.1f} | "
            f"{1e3 * c.unsplit_step_s:.1f} | {c.step_s / c.unsplit_step_s:.2f}x | {1e3 * c.eager_step_s:.1f} | "
            f"{c.step_s / c.eager_step_s:.2f}x | {c.deferred_weight_steps} | {'yes' if c.bitwise_equal else 'no'} | "
            f"{c.max_abs_diff:.3g} | {idle} |"
        )
    return "\n".join(lines)


def _conditions(args) -> str:
    if args.backend == "nccl":
        where = f"{args.ranks} x {torch.cuda.get_device_name(0)}, NCCL, torch {torch.__version__}, torchao {torchao.__version__}"
        caveat = "Idle share: non-NCCL kernel time over the profiled step's wall time, per rank."
    else:
        where = (f"CPU ({os.cpu_count()} cores shared by the ranks and other jobs), gloo, torch {torch.__version__}, "
                 f"torchao {torchao.__version__}")
        caveat = ("Idle share here counts host overhead and the ranks' contention for the shared cores as well as the "
                  "bubble: it is not what 2 GPUs would show.")
    return (f"{where}; models {', '.join(args.models)} of width {args.dim}, two blocks (layers) per rank, {args.tokens} tokens "
            f"per microbatch, {args.microbatches} microbatches; median of {args.repeats} steps, idle share from one more "
            f"profiled step; one stage per rank, or two for the multi-stage schedules. {caveat}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", nargs="+", default=list(CHECKED_SCHEDULES))
    parser.add_argument("--models", nargs="+", choices=["stack", "llama"], default=["stack"])
    parser.add_argument("--recipes", nargs="+", choices=["tensorwise", "rowwise"], default=["tensorwise"])
    parser.add_argument("--compile", nargs="+", choices=["eager", "regional", "full"], default=["eager"])
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo", help="gloo: CPU; nccl: one GPU per rank")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32, help="tokens per microbatch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    rows = []
    for model in args.models:
        problem = functools.partial(llama.pipeline_problem, heads=4, vocab=256) if model == "llama" else None
        for recipe in args.recipes:
            for mode in args.compile:
                for schedule in args.schedules:
                    # Blocks fixed across schedules (two per rank) so that every row runs the same model.
                    per_rank = 1 if issubclass(get_schedule_class(schedule), PipelineScheduleSingle) else 2
                    check = launch(schedule=schedule, ranks=args.ranks, stages_per_rank=per_rank, microbatches=args.microbatches,
                                   backend=args.backend, dim=args.dim, blocks=2 * args.ranks, tokens=args.tokens, recipe=recipe,
                                   compile=None if mode == "eager" else mode, repeats=args.repeats, problem=problem)
                    print(f"{model} {recipe}: {check.summary()}", flush=True)
                    rows.append((model, recipe, check))
    text = table(rows)
    print(text)
    if args.write:
        results.append("bench_pipeline", _conditions(args), text)


if __name__ == "__main__":
    main()
