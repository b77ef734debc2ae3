"""Bytes all-gathered and step time of a data-parallel FP8 step, float8 all-gather on versus off.

For each width, :func:`fp8conf.tools.sharded_check.launch` shards a stack of tensorwise FP8 blocks
(two by default, plus a high-precision head) with :func:`fp8conf.parallel.shard_data_parallel`
over ``--ranks`` gloo processes, checks its gradients against the unsharded step and its traced
weight all-gathers against the setting, and measures:

- bytes all-gathered per step (each rank receives this much): the sum of the results of the
  forward all-gathers in the traced step, from their :class:`~fp8conf.graph.collectives.CollectiveRecord`;
  "as FP8" is the part that travels as FP8 bytes, the rest (norms, biases, the head) in float32;
- bytes reduce-scattered per step (the gradients, float32 either way);
- step time, median over ``--repeats``: the eager sharded step (autograd) and the traced joint
  graph run with ``fp8conf.run_joint``, both over gloo on this machine's CPU cores.

On CPU the times are informational: the ranks share the cores, and gloo moves bytes through
memory, so the FP8 gather's saving in bytes shows far less in time than on a network.

    python benchmarks/bench_sharded.py --dims 64 256 --write
"""

from __future__ import annotations

import argparse

import torch
import torchao

from fp8conf.tools.sharded_check import launch

import results  # benchmarks/results.py, beside this script


def table(rows) -> str:
    lines = [
        "| dim | blocks | float8 all-gather | all-gathered bytes/step | as FP8 | vs off | reduce-scattered bytes/step | "
        "eager step ms | traced step ms | whole batch bitwise | split batch rel. error | checks |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    off = {(dim, blocks): c.all_gather_bytes for dim, blocks, c in rows if not c.float8_all_gather}
    for dim, blocks, c in rows:
        ratio = c.all_gather_bytes / off[(dim, blocks)] if off.get((dim, blocks)) else float("nan")
        lines.append(
            f"| {dim} | {blocks} | {'on' if c.float8_all_gather else 'off'} | {c.all_gather_bytes} | {c.all_gather_bytes_float8} | "
            f"{ratio:.2f}x | {c.reduce_scatter_bytes} | {c.eager_step_s * 1e3:.1f} | {c.traced_step_s * 1e3:.1f} | "
            f"{'yes' if c.same_batch_bitwise else 'NO'} | {c.split_batch_error:.3g} | {'pass' if c.ok else 'FAIL'} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dims", nargs="+", type=int, default=[64, 256])
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64, help="the batch, split over the ranks")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--write", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    rows = []
    for dim in args.dims:
        for on in (False, True):
            check = launch(float8_all_gather=on, ranks=args.ranks, dim=dim, blocks=args.blocks, tokens=args.tokens, repeats=args.repeats)
            print(check.summary(), flush=True)
            rows.append((dim, args.blocks, check))
    text = table(rows)
    print(text)
    if args.write:
        conditions = (
            f"CPU, {args.ranks} gloo processes, torch {torch.__version__}, torchao {torchao.__version__}; tensorwise FP8 blocks "
            f"({args.blocks}, plus a float32 head), {args.tokens} tokens per step split over the ranks, medians of "
            f"{args.repeats} steps; `python benchmarks/bench_sharded.py --dims {' '.join(map(str, args.dims))}`."
        )
        results.append("bench_sharded: float8 all-gather on vs off", conditions, text)


if __name__ == "__main__":
    main()
