"""What is live on the GPU at a training step's peak, variant by variant (CUDA only).

Builds each variant of ``bench_compile.py`` (same models, same labels), runs two steps, then
records the CUDA caching allocator's history (``torch.cuda.memory._record_memory_history``)
over one more step, replays its allocations and frees to find the moment the most bytes were
live, and prints what was live then: grouped by allocation size (a parameter's gradient, an
activation, an FP8 copy of a weight each have sizes of their own at a given shape), with the
innermost Python frame that allocated each group. Tells apart two variants whose peaks differ:
the sizes one holds and the other does not are the difference.

    python benchmarks/bench_peak.py --configs dim2048x4 --variants "torch.compile" "fp8conf full"
"""

from __future__ import annotations

import argparse
import collections

import torch

import bench_compile  # beside this script


def _frame(frames) -> str:
    """The innermost frame of a Python file that is not torch's own dispatch machinery."""
    for frame in frames:
        name = frame.get("filename", "")
        if name.endswith(".py") and "/torch/" not in name.replace("\\", "/") or "torchinductor" in name or "/fp8conf/" in name:
            return f"{name.rsplit('/', 1)[-1]}:{frame.get('line')} {frame.get('name')}"
    return "?"


def live_at_peak(step) -> tuple[int, list, str]:
    """``(peak bytes above the step's start, [(size, count, frame)], where)`` for one run of
    ``step``: what was live when the most was, and which allocation (its rank, its frame) made it."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    events = [e for trace in snapshot["device_traces"] for e in trace]
    live, best, at_peak, where = {}, 0, {}, ""
    total = 0
    allocs = sum(e["action"] == "alloc" for e in events)
    seen = 0
    for event in events:
        if event["action"] == "alloc":
            seen += 1
            live[event["addr"]] = event
            total += event["size"]
            if total > best:
                best, at_peak = total, dict(live)
                where = f"allocation {seen} of {allocs}, by {_frame(event.get('frames', []))}"
        elif event["action"] in ("free_requested",) and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
    groups = collections.Counter((e["size"], _frame(e.get("frames", []))) for e in at_peak.values())
    return best, sorted(((size, count, frame) for (size, frame), count in groups.items()), key=lambda g: -g[0] * g[1]), where


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama", choices=list(bench_compile.CONFIGS))
    parser.add_argument("--configs", nargs="+", default=["dim2048x4"])
    parser.add_argument("--variants", nargs="+", default=["torch.compile", "fp8conf full", "fp8conf regional"])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    for name in args.configs:
        dim, blocks = bench_compile.CONFIGS[args.model][name]
        work = bench_compile.Workload(args.model, dim, blocks, "tensorwise", "cuda", args.tokens)
        for label in args.variants:
            step, model, _ = bench_compile.make_variant(label, work)
            step()
            step()
            params = sum(p.numel() * p.element_size() for p in model.parameters())
            before = torch.cuda.memory_allocated()
            peak, groups, where = live_at_peak(step)
            print(f"\n{name} {label}: {before / 2**30:.2f} GiB allocated before the step (parameters {params / 2**30:.2f}); "
                  f"at its peak the step held {peak / 2**30:.2f} GiB more ({where})")
            print("| size MiB | count | MiB | allocated at |\n|---:|---:|---:|---|")
            for size, count, frame in groups[: args.top]:
                print(f"| {size / 2**20:.1f} | {count} | {size * count / 2**20:.0f} | {frame} |")
            by_size = collections.Counter()
            for size, count, _ in groups:
                by_size[size] += count
            print("by size (MiB x count): " + ", ".join(f"{size / 2**20:.1f} x {n}" for size, n in sorted(by_size.items(), reverse=True) if size >= 2**20))
            del step, model
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
