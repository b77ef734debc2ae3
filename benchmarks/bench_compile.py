"""Throughput and peak memory of one FP8 training step (forward + backward), compiled six ways.

Variants: eager bf16 (no FP8); eager Float8Linear; ``torch.compile`` of the Float8Linear model;
fp8conf full compile of the joint graph; fp8conf regional compile; regional + CUDA graphs.
Models: a transformer-like stack (dim 256, 6 blocks) and a matmul-bound one (dim 4096, 2
blocks), bf16 weights, for the tensorwise and rowwise recipes. Prints one Markdown table with
ratios against eager Float8Linear and against ``torch.compile``, plus cold compile seconds, and
appends it with date, versions and device to ``benchmarks/RESULTS.md`` (``--write``).

    python benchmarks/bench_compile.py --write            # on a GPU (sm89+)
    python benchmarks/bench_compile.py --device cpu --quick   # smoke test of the script itself
    python benchmarks/bench_compile.py --recipes rowwise --jsonl rows.jsonl   # a part; then
    python benchmarks/bench_compile.py --from-jsonl a.jsonl rows.jsonl --write   # one table
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

import fp8conf
from fp8conf.tools.example_models import build_stack

import results  # benchmarks/results.py, beside this script

CONFIGS = {"dim256x6": (256, 6), "dim4096x2": (4096, 2)}


def build(dim, blocks, recipe, device, fp8=True):
    return build_stack(dim, blocks, recipe if fp8 else None, head=False, device=device, dtype=torch.bfloat16)


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def measure(step, device, warmup, iters):
    for _ in range(warmup):
        step()
    _sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    _sync(device)
    seconds = (time.perf_counter() - start) / iters
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    return seconds, peak


def eager_step(model, x, grad):
    def step():
        model.zero_grad(set_to_none=True)
        model(x).backward(grad)

    return step


def joint_step(gm, model, x, grad, fn):
    signature = fp8conf.joint_signature(gm)
    primals, tangents = signature.feed(model, (x,), (grad,))

    def step():
        return signature.results(fn(primals, tangents))

    return step


def variants(dim, blocks, recipe, device, tokens):
    x = torch.randn(tokens, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    yield "eager bf16", lambda: eager_step(build(dim, blocks, recipe, device, fp8=False), x, grad)
    yield "eager Float8Linear", lambda: eager_step(build(dim, blocks, recipe, device), x, grad)
    yield "torch.compile", lambda: eager_step(torch.compile(build(dim, blocks, recipe, device)), x, grad)
    modes = [("full", False), ("regional", False)]
    modes += [("full", True), ("regional", True)] if device == "cuda" else []
    for mode, cudagraph in modes:
        label = f"fp8conf {mode}" + (" + CUDA graphs" if cudagraph else "")

        def make(mode=mode, cudagraph=cudagraph):
            model = build(dim, blocks, recipe, device)
            gm = fp8conf.trace_joint(model, (x,))
            compiled = fp8conf.compile_joint(gm, mode=mode, cudagraph=cudagraph)
            return joint_step(gm, model, x, grad, compiled)

        yield label, make


def gpu_profile(step, steps=3):
    """Kernels launched and GPU-busy milliseconds per step (CUDA only): tells launch-bound from
    compute-bound variants."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    busy_us = sum(getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0) for e in kernels)
    return len(kernels) / steps, busy_us / steps / 1e3


def run(args, sink):
    for name, (dim, blocks) in CONFIGS.items():
        if name not in args.configs:
            continue
        if args.quick:
            dim, blocks = min(dim, 64), 2
        for recipe in args.recipes:
            for label, make in variants(dim, blocks, recipe, args.device, args.tokens):
                if args.variants and label not in args.variants:
                    continue
                torch._dynamo.reset()
                # Cold: an empty Inductor (and Triton) cache per variant; identical regions within
                # one compilation may still share cached kernels, as they would on a user's machine.
                with temporary_cache_dir(tempfile.mkdtemp(prefix="bench-compile-")):
                    start = time.perf_counter()
                    step = make()
                    step()  # the first step compiles
                    _sync(args.device)
                    cold = time.perf_counter() - start
                seconds, peak = measure(step, args.device, args.warmup, args.iters)
                kernels, busy_ms = gpu_profile(step) if args.device == "cuda" else (float("nan"), float("nan"))
                row = dict(model=name, recipe=recipe, variant=label, tokens_per_s=args.tokens / seconds,
                           step_ms=seconds * 1e3, peak_gib=peak, first_step_s=cold, kernels=kernels, gpu_busy_ms=busy_ms)
                print(f"{name} {recipe:10s} {label:28s} {row['tokens_per_s'] / 1e6:8.3f} Mtok/s  peak {peak:6.2f} GiB  "
                      f"first step {cold:6.1f} s  kernels/step {kernels:6.0f}  GPU busy {busy_ms:7.2f} of {seconds * 1e3:7.2f} ms",
                      flush=True)
                sink(row)
                del step
                if args.device == "cuda":
                    torch.cuda.empty_cache()


def table(rows) -> str:
    lines = [
        "| model | recipe | variant | Mtok/s | vs eager Float8Linear | vs torch.compile | peak GiB | vs torch.compile peak | first step s | kernels/step | GPU busy % |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    by_key = {(r["model"], r["recipe"], r["variant"]): r for r in rows}
    for r in rows:
        base = by_key.get((r["model"], r["recipe"], "eager Float8Linear"))
        peer = by_key.get((r["model"], r["recipe"], "torch.compile"))
        ratio = lambda other, key: f"{r[key] / other[key]:.2f}x" if other else "n/a"
        busy = f"{100 * r['gpu_busy_ms'] / r['step_ms']:.0f}" if r["gpu_busy_ms"] == r["gpu_busy_ms"] else "n/a"
        kernels = f"{r['kernels']:.0f}" if r["kernels"] == r["kernels"] else "n/a"
        lines.append(
            f"| {r['model']} | {r['recipe']} | {r['variant']} | {r['tokens_per_s'] / 1e6:.3f} | {ratio(base, 'tokens_per_s')} | "
            f"{ratio(peer, 'tokens_per_s')} | {r['peak_gib']:.2f} | {ratio(peer, 'peak_gib')} | {r['first_step_s']:.1f} | {kernels} | {busy} |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--recipes", nargs="+", default=["tensorwise", "rowwise"])
    parser.add_argument("--variants", nargs="+", help="measure only these variants (labels as printed)")
    results.jsonl_arguments(parser)
    parser.add_argument("--quick", action="store_true", help="tiny models: checks the script, measures nothing")
    parser.add_argument("--write", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    rows = []
    if args.from_jsonl:
        rows = results.read_jsonl(args.from_jsonl)
        environment = rows[0].get("environment", "") if rows else ""
    else:
        import torchao

        device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
        environment = f"{device}; torch {torch.__version__}, torchao {torchao.__version__}; {args.tokens} tokens per step, bf16"

        def sink(row):
            row["environment"] = environment
            rows.append(row)
            results.append_jsonl(args.jsonl, row)

        run(args, sink)
    text = table(rows)
    print(text)
    if args.write:
        results.append(
            "bench_compile",
            f"{environment}; first step includes cold compilation (an empty Inductor cache per variant); "
            "kernels/step and GPU busy from torch.profiler over 3 steps.",
            text,
        )


if __name__ == "__main__":
    main()
