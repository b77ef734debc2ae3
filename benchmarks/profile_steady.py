"""Where a steady training step's time goes, fp8conf regional beside torch.compile, on one GPU.

For a Llama-shaped FP8 model (benchmarks/llama.py) each path is built, compiled, warmed, then
timed (median of ``--steps`` steps, the device synchronised after each) and profiled over three
steps with ``torch.profiler``. The table gives, per step: wall time, its spread, the median
again with Python's collector off and the collections per step; when the host returned (before
the synchronisation: a host-bound step returns late); the kernels' summed device time and the
share of the wall it fills; kernel launches; the caching allocator's allocations and its
cudaMalloc calls; the runtime calls that make the host wait (synchronisations, blocking copies,
cudaMalloc/cudaFree); and the device time by kernel kind (generated Triton, matmuls, attention,
copies, other), with each path's ten costliest kernels; each path's row is printed as soon as it is
measured, the table of all at the end. One process, one card: the rows compare with each other only.

    python3 benchmarks/profile_steady.py --blocks 32 --recipe tensorwise
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench_compile import eager_step, joint_step  # noqa: E402
from imports import import_compile_stack  # noqa: E402
from llama import build_llama  # noqa: E402

import fp8conf  # noqa: E402

LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
#: Runtime calls that make the host wait for the device (or, for cudaMalloc/cudaFree, may).
SYNCS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMalloc", "cudaFree")
KINDS = (
    ("triton", ("triton",)),
    ("matmul", ("gemm", "sm90", "cutlass", "scaled_mm", "cublas", "nvjet", "xmma")),
    ("attention", ("flash", "fmha", "attention", "efficient")),
    ("copy", ("memcpy", "memset", "copy", "elementwise_kernel", "fill")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, marks in KINDS:
        if any(m in low for m in marks):
            return kind
    return "other"


def sync(args) -> None:
    if args.device == "cuda":
        torch.cuda.synchronize()


def allocated(args) -> tuple[int, int]:
    """The caching allocator's allocations so far, and its calls of cudaMalloc (``num_device_alloc``)."""
    if args.device != "cuda":
        return 0, 0
    stats = torch.cuda.memory_stats()
    return stats["allocation.all.allocated"], stats.get("num_device_alloc", stats["segment.all.allocated"])


def build(path: str, args):
    model = build_llama(args.dim, args.blocks, args.recipe, device=args.device, heads=args.heads, vocab=args.vocab)
    x = torch.randint(0, args.vocab, (1, args.tokens), device=args.device)
    grad = torch.randn(1, args.tokens, args.vocab, device=args.device, dtype=torch.bfloat16)
    start = time.perf_counter()
    if path == "torch.compile":
        step = eager_step(torch.compile(model), x, grad)
        note = ""
    else:
        # ", whole trace": every block traced (trace_joint(repeat=False)), not four repeated;
        # ", CUDA graphs": the compiled step captured once and replayed (compile_joint(cudagraph=True)),
        # so that the host's share of the step shows as the difference.
        gm = fp8conf.trace_joint(model, (x,), **({"repeat": False} if path.endswith(", whole trace") else {}))
        compiled = fp8conf.compile_joint(gm, fp8conf.CompileConfig(mode=path.split(",")[0].split()[-1],
                                                                   cudagraph=path.endswith(", CUDA graphs")))
        step = joint_step(gm, model, x, grad, compiled)
        note = f"{compiled.inductor_compiles} Inductor compiles, fallbacks {list(compiled.fallbacks) or 'none'}"
    step()
    sync(args)
    return step, time.perf_counter() - start, note


def measure(path: str, args) -> dict:
    step, first, note = build(path, args)
    for _ in range(3):
        step()
    sync(args)
    walls, hosts = [], []
    stats, collections = allocated(args), sum(g["collections"] for g in gc.get_stats())
    for _ in range(args.steps):
        t = time.perf_counter()
        step()
        hosts.append(time.perf_counter() - t)
        sync(args)
        walls.append(time.perf_counter() - t)
    allocations, device_allocations = ((now - before) / args.steps for now, before in zip(allocated(args), stats))
    collections = (sum(g["collections"] for g in gc.get_stats()) - collections) / args.steps
    # The same steps with Python's collector off: a step slowed by collections of a large heap shows here.
    gc.disable()
    try:
        quiet = []
        for _ in range(args.steps):
            t = time.perf_counter()
            step()
            sync(args)
            quiet.append(time.perf_counter() - t)
    finally:
        gc.enable()
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(3):
            step()
        sync(args)
    averages = prof.key_averages()
    kernels = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0]
    by_kind: dict[str, float] = {}
    for e in kernels:
        by_kind[kind_of(e.key)] = by_kind.get(kind_of(e.key), 0.0) + e.self_device_time_total / 3 / 1e3
    device_ms = sum(by_kind.values())
    wall_ms = statistics.median(walls) * 1e3
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:10]
    return {
        "path": path, "first_s": first, "note": note, "wall_ms": wall_ms, "host_ms": statistics.median(hosts) * 1e3,
        "no_gc_ms": statistics.median(quiet) * 1e3, "collections": collections, "spread": (min(walls) * 1e3, max(walls) * 1e3),
        "device_ms": device_ms, "busy": device_ms / wall_ms, "by_kind": by_kind,
        "launches": sum(e.count for e in averages if e.key in LAUNCHES) / 3,
        "kernels": sum(e.count for e in kernels) / 3, "allocations": allocations, "device_allocations": device_allocations,
        "syncs": sum(e.count for e in averages if e.key in SYNCS) / 3,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else float("nan"),
        "top": [(e.key[:90], e.count / 3, e.self_device_time_total / 3 / 1e3) for e in top],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=32)
    parser.add_argument("--recipe", default="tensorwise")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script (no device times)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--paths", nargs="+", default=["fp8conf regional", "torch.compile"],
                        choices=["fp8conf regional", "fp8conf regional, whole trace", "fp8conf regional, CUDA graphs", "fp8conf full",
                                 "torch.compile"])
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    import_compile_stack(args.device)
    kinds = [k for k, _ in KINDS] + ["other"]
    print(f"{args.blocks} blocks, {args.recipe}, dim {args.dim}, {args.tokens} tokens, "
          f"{torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}, torch {torch.__version__}", flush=True)
    header = ("| path | step ms | min-max ms | gc off ms | collections | host returns ms | kernel ms | busy | kernels | launches | "
              "allocations | cudaMalloc | waits | peak GiB | " + " | ".join(f"{k} ms" for k in kinds) + " |\n|" + "---|" * (14 + len(kinds)))
    rows = []
    for path in args.paths:
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        rows.append(measure(path, args))
        torch._dynamo.reset()
        if args.device == "cuda":
            torch.cuda.empty_cache()
        # Each row as soon as it is measured, so that a run cut short keeps the rows it made.
        r = rows[-1]
        print(f"{path}: first step {r['first_s']:.1f} s {r['note']}\n{_row(r, kinds)}\ncostliest kernels (calls per step, ms per step):", flush=True)
        for name, count, ms in r["top"]:
            print(f"  {ms:7.2f} ms  {count:5.0f}x  {name}", flush=True)
    print(f"\n{header}")
    for r in rows:
        print(_row(r, kinds))


def _row(r: dict, kinds: list[str]) -> str:
    return (f"| {r['path']} | {r['wall_ms']:.1f} | {r['spread'][0]:.1f}-{r['spread'][1]:.1f} | {r['no_gc_ms']:.1f} | "
            f"{r['collections']:.2f} | {r['host_ms']:.1f} | {r['device_ms']:.1f} | {r['busy']:.0%} | {r['kernels']:.0f} | "
            f"{r['launches']:.0f} | {r['allocations']:.0f} | {r['device_allocations']:.1f} | {r['syncs']:.1f} | {r['peak_gib']:.2f} | "
            + " | ".join(f"{r['by_kind'].get(k, 0.0):.1f}" for k in kinds) + " |")


if __name__ == "__main__":
    main()
