"""How fp8conf's analysis passes scale with graph size, against the cost of tracing the graph.

Traces block stacks (``fp8conf.tools.example_models``, tensorwise ``Float8Linear``, tiny widths so that the
graph, not the arithmetic, is what grows) of 1 to 512 blocks into joint graphs of up to about
100k nodes, then times on each: provenance propagation, strict validation, FP8 region
identification and the GraphPP split. Prints time per node (microseconds) per pass, the ratio
of the largest to the smallest per-node time (linear passes stay within 2x), and all passes
together as a share of trace time.

    python benchmarks/bench_passes.py                      # 1 .. 512 blocks
    python benchmarks/bench_passes.py --blocks 1 4 16 --write
"""

from __future__ import annotations

import argparse
import gc
import time
from unittest import mock

import torch

import fp8conf
import fp8conf.graph.trace
from fp8conf.tools.example_models import build_stack
from fp8conf.graph.split import split_stage
from fp8conf.graph.provenance import propagate_provenance
from fp8conf.graph.regions import identify_fp8_regions
from fp8conf.graph.validate import validate_fp8_graph

import results  # benchmarks/results.py, beside this script

PASSES = ("provenance", "validate", "regions", "split")  # split includes its validation


def _best_of(fn, repeat):
    best = float("inf")
    for _ in range(repeat):
        # The graphs of earlier sizes and runs are cyclic garbage: collected here, not charged
        # to the pass whose allocations would trigger the collection.
        gc.collect()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(blocks: int, dim: int, repeat: int) -> dict:
    gc.collect()
    model = build_stack(dim, blocks, "tensorwise", head=False)
    x = torch.randn(8, dim, requires_grad=True)
    # Trace without the propagation step, so it can be timed on its own afterwards.
    start = time.perf_counter()
    with mock.patch.object(fp8conf.graph.trace, "propagate_provenance", lambda gm, modules: gm):
        gm = fp8conf.trace_joint(model, (x,))
    trace_s = time.perf_counter() - start
    modules = fp8conf.trace_info(gm).modules
    annotations = {n: n.meta.get("custom") for n in gm.graph.nodes}

    def provenance():
        for node, custom in annotations.items():  # propagation consumes the annotations
            if custom is not None:
                node.meta["custom"] = custom
        propagate_provenance(gm, modules)

    # Small graphs take a millisecond or less per pass: more runs, so the best is not noise.
    repeat = max(repeat, min(50, 20000 // len(gm.graph.nodes)))
    times = {"provenance": _best_of(provenance, repeat)}
    times["validate"] = _best_of(lambda: validate_fp8_graph(gm, strict=True), repeat)
    times["regions"] = _best_of(lambda: identify_fp8_regions(gm), repeat)
    times["split"] = _best_of(lambda: split_stage(gm, strict=False), repeat)
    return {"blocks": blocks, "nodes": len(gm.graph.nodes), "trace_s": trace_s, **times}


def table(rows) -> str:
    lines = [
        "| blocks | nodes | trace s | " + " | ".join(f"{p} µs/node" for p in PASSES) + " | all passes / trace |",
        "|---:|---:|---:|" + "---:|" * len(PASSES) + "---:|",
    ]
    for r in rows:
        per_node = " | ".join(f"{1e6 * r[p] / r['nodes']:.2f}" for p in PASSES)
        share = sum(r[p] for p in PASSES) / r["trace_s"]
        lines.append(f"| {r['blocks']} | {r['nodes']} | {r['trace_s']:.2f} | {per_node} | {100 * share:.1f} % |")
    spread = " | ".join(
        f"{max(r[p] / r['nodes'] for r in rows) / min(r[p] / r['nodes'] for r in rows):.2f}x" for p in PASSES
    )
    lines.append(f"| max/min per node | | | {spread} | |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 4, 16, 64, 128, 256, 512])
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3, help="best of this many runs per pass")
    parser.add_argument("--write", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    rows = []
    for blocks in args.blocks:
        rows.append(measure(blocks, args.dim, args.repeat))
        r = rows[-1]
        print(f"{blocks:4d} blocks, {r['nodes']:6d} nodes: trace {r['trace_s']:7.2f} s; "
              + ", ".join(f"{p} {1e3 * r[p]:8.1f} ms" for p in PASSES), flush=True)
    text = table(rows)
    print(text)
    if args.write:
        import torchao

        results.append(
            "bench_passes",
            f"CPU, torch {torch.__version__}, torchao {torchao.__version__}; tensorwise Float8Linear block stacks of "
            f"width {args.dim}; best of {args.repeat} runs per pass (up to 50 on graphs under 20k nodes), each after a full garbage collection; trace = aot export with provenance annotations, "
            "without propagation; split includes its (non-strict) validation.",
            text,
        )


if __name__ == "__main__":
    main()
