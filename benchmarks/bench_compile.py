"""Throughput and peak memory of one FP8 training step (forward + backward), compiled six ways.

Variants: eager bf16 (no FP8); eager Float8Linear; ``torch.compile`` of the Float8Linear model;
fp8conf full compile of the joint graph; fp8conf regional compile; regional + CUDA graphs.
Models: a transformer-like stack (dim 256, 6 blocks) and a matmul-bound one (dim 4096, 2
blocks), bf16 weights, for the tensorwise and rowwise recipes. Prints one Markdown table with
ratios against eager Float8Linear and against ``torch.compile``, plus cold compile seconds, and
appends it with date, versions and device to ``benchmarks/RESULTS.md`` (``--write``).

    python benchmarks/bench_compile.py --write            # on a GPU (sm89+)
    python benchmarks/bench_compile.py --device cpu --quick   # smoke test of the script itself
"""

from __future__ import annotations

import argparse
import datetime
import time
from pathlib import Path

import torch

import fp8conf
from fp8conf.trace import joint_inputs, joint_results

CONFIGS = {"dim256x6": (256, 6), "dim4096x2": (4096, 2)}


class Block(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, 4 * dim, bias=False)
        self.down = torch.nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def build(dim, blocks, recipe, device, fp8=True):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(Block(dim) for _ in range(blocks))).to(device=device, dtype=torch.bfloat16)
    if fp8:
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))
    return model


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
    primals, tangents = joint_inputs(gm, model, (x,), (grad,))

    def step():
        return joint_results(gm, fn(primals, tangents))

    return step


def variants(dim, blocks, recipe, device, tokens):
    x = torch.randn(tokens, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    yield "eager bf16", lambda: eager_step(build(dim, blocks, recipe, device, fp8=False), x, grad)
    yield "eager Float8Linear", lambda: eager_step(build(dim, blocks, recipe, device), x, grad)
    yield "torch.compile", lambda: eager_step(torch.compile(build(dim, blocks, recipe, device)), x, grad)
    modes = [("full", False), ("regional", False)] + ([("regional", True)] if device == "cuda" else [])
    for mode, cudagraph in modes:
        label = f"fp8conf {mode}" + (" + CUDA graphs" if cudagraph else "")

        def make(mode=mode, cudagraph=cudagraph):
            model = build(dim, blocks, recipe, device)
            gm = fp8conf.trace_joint(model, (x,))
            compiled = fp8conf.compile_joint(gm, mode=mode, cudagraph=cudagraph)
            return joint_step(gm, model, x, grad, compiled)

        yield label, make


def run(args):
    rows = []
    for name, (dim, blocks) in CONFIGS.items():
        if args.quick:
            dim, blocks = min(dim, 64), 2
        for recipe in ("tensorwise", "rowwise"):
            results = {}
            for label, make in variants(dim, blocks, recipe, args.device, args.tokens):
                torch._dynamo.reset()
                start = time.perf_counter()
                step = make()
                step()  # the first step compiles
                _sync(args.device)
                cold = time.perf_counter() - start
                seconds, peak = measure(step, args.device, args.warmup, args.iters)
                results[label] = (args.tokens / seconds, peak, cold)
                print(f"{name} {recipe:10s} {label:28s} {args.tokens / seconds / 1e6:8.3f} Mtok/s  peak {peak:6.2f} GiB  first step {cold:6.1f} s", flush=True)
            base, peer = results["eager Float8Linear"][0], results["torch.compile"][0]
            for label, (tps, peak, cold) in results.items():
                rows.append((name, recipe, label, tps, tps / base, tps / peer, peak, cold))
    return rows


def table(rows) -> str:
    lines = [
        "| model | recipe | variant | Mtok/s | vs eager Float8Linear | vs torch.compile | peak GiB | first step s |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, recipe, label, tps, vs_base, vs_peer, peak, cold in rows:
        lines.append(f"| {name} | {recipe} | {label} | {tps / 1e6:.3f} | {vs_base:.2f}x | {vs_peer:.2f}x | {peak:.2f} | {cold:.1f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="tiny models: checks the script, measures nothing")
    parser.add_argument("--write", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    text = table(run(args))
    print(text)
    if args.write:
        import torchao

        device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
        header = (
            f"\n## bench_compile, {datetime.date.today()}\n\n{device}; torch {torch.__version__}, torchao "
            f"{torchao.__version__}; {args.tokens} tokens per step, bf16; first step includes cold compilation.\n\n"
        )
        with open(Path(__file__).with_name("RESULTS.md"), "a") as f:
            f.write(header + text + "\n")


if __name__ == "__main__":
    main()
