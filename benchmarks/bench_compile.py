"""Throughput, peak memory and first-step time of one FP8 training step (forward + backward),
fp8conf's compiled joint graphs side by side with eager execution and ``torch.compile``.

Models: a Llama-shaped model (``benchmarks/llama.py``: RMSNorm, causal SDPA attention with FP8
q/k/v/o, SwiGLU feed-forward with FP8 projections, bf16 head) at the Llama-3 debug shape (dim
256, 6 layers, 16 heads, vocab 2048) and a matmul-bound one (dim 2048, 4 layers); and the block
stack of ``fp8conf.tools.example_models`` (``--model stack``). Variants: eager bf16, eager
Float8Linear, ``torch.compile``, fp8conf full, fp8conf regional, the last three also with CUDA
graphs (``torch.compile(mode="reduce-overhead")`` for torch's). fp8conf regional compiles the
rest of the graph with its FP8 regions, in units of a block each (``compile_joint``'s default
``remainder="inductor"``); ``--variants`` can add "fp8conf regional, pieces" (each region
compiled alone, the rest in pieces between them) and "fp8conf regional, eager remainder"
(``remainder="eager"``, the FP8 regions only), measured after the others and so sharing their
Inductor cache.

Every variant of a configuration is built first (its first step timed, with one empty Inductor
cache per configuration, shared by its variants in the order above); then ``--repeats`` rounds
time each variant in turn, so that drift hits all of them alike; a figure is the median over the
rounds, with min–max, and every ratio is taken within the run. Peak memory is what a variant
allocates itself (parameters, gradients, activations, CUDA-graph pools) above what was allocated
before it was built, compilation included; "step peak" the same over two steps after the first.
On CUDA each variant is also profiled over 3 steps: kernels and GPU-busy time per step, the GPU's
idle gaps between kernels (and the longest, with the kernels around them), and the kernel names
it launches more or less often than torch.compile.

Before any timer the compile stack is imported (``benchmarks/imports.py``), so that no first step
pays for loading Inductor; first steps of one configuration still share its cache, so only the
first compiled variant's is cold: the first-step goal comes from ``--depth`` rows.

``--fresh`` measures the first step of every compiled variant, CUDA graphs included, the
same way at the debug depth (6 blocks): each in a process of its own, as a trainer meets it,
and each running two more steps after it.

``--depth 2 6 32`` measures instead the first step (trace, compile and run, an empty Inductor
cache each) of fp8conf regional, torch.compile and fp8conf full at each depth of the Llama
model at the debug shape: cold start versus depth. Each row runs in a fresh process (nothing
compiled or cached in memory by another row), killed after ``--row-timeout`` seconds; all rows
together get ``--budget`` seconds (450 by default, so that the run fits a 10-minute call),
rows that would start after it are reported as not run; "fp8conf regional, N worker(s)" shares
the distinct units out between this process and N helper processes (``compile_joint(workers=N)``);
"fp8conf regional, saveable units" compiles every unit as a regional artifact stores it
(``standalone_compile``, which traces it through AOTAutograd again) rather than by Inductor's
inner compiler. Rows are printed (and appended to
``--jsonl``) as each finishes.

    python benchmarks/bench_compile.py --jsonl rows.jsonl                 # on a GPU (sm89+)
    python benchmarks/bench_compile.py --depth 2 6 32 --jsonl depth.jsonl
    python benchmarks/bench_compile.py --depth 6 --depth-variants "fp8conf regional" "fp8conf regional, 1 worker"
    python benchmarks/bench_compile.py --fresh --jsonl fresh.jsonl           # every compiled variant, its own process
    python benchmarks/bench_compile.py --from-jsonl rows.jsonl depth.jsonl --write   # the tables
    python benchmarks/bench_compile.py --device cpu --quick               # smoke test of the script
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

import fp8conf
from fp8conf.tools.example_models import build_stack

import goals  # benchmarks/goals.py, beside this script
import results  # benchmarks/results.py
from imports import import_compile_stack
from llama import build_llama

ROOT = Path(__file__).resolve().parent.parent

CONFIGS = {
    "llama": {"dim256x6": (256, 6), "dim2048x4": (2048, 4)},
    "stack": {"dim256x6": (256, 6), "dim4096x2": (4096, 2)},
}
VOCAB, HEADS, SEQ = 2048, 16, 2048
VARIANTS = (
    "eager bf16", "eager Float8Linear", "torch.compile", "torch.compile + CUDA graphs",
    "fp8conf full", "fp8conf full + CUDA graphs", "fp8conf regional", "fp8conf regional + CUDA graphs",
)
#: Measured only when --variants names them.
EXTRA_VARIANTS = ("fp8conf regional, eager remainder", "fp8conf regional + CUDA graphs, eager remainder",
                  "fp8conf regional, pieces", "fp8conf regional, 1 worker", "fp8conf regional, 4 workers")
DEPTH_VARIANTS = ("fp8conf regional", "torch.compile", "fp8conf full", "fp8conf regional, 1 worker",
                  "fp8conf regional, 2 workers", "fp8conf regional, 4 workers", "fp8conf regional, whole trace",
                  "fp8conf regional, saveable units", "fp8conf regional + CUDA graphs", "fp8conf full + CUDA graphs",
                  "torch.compile + CUDA graphs", "eager Float8Linear")
#: ``--fresh``: every variant a user compiles, each first step in a process of its own.
FRESH_VARIANTS = ("fp8conf regional", "fp8conf full", "fp8conf regional + CUDA graphs", "fp8conf full + CUDA graphs",
                  "torch.compile", "torch.compile + CUDA graphs")


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


class Workload:
    """A model family at one shape, with its inputs and output gradient."""

    def __init__(self, model, dim, blocks, recipe, device, tokens, quick=False):
        self.kind, self.dim, self.blocks, self.recipe, self.device = model, dim, blocks, recipe, device
        self.repeat = "layers" if model == "llama" else "blocks"  # the container of equal blocks
        self.heads, self.vocab = (4, 256) if quick else (HEADS, VOCAB)
        if model == "llama":
            seq = min(SEQ, tokens)
            self.x = torch.randint(0, self.vocab, (tokens // seq, seq), device=device)
            self.grad = torch.randn(tokens // seq, seq, self.vocab, device=device, dtype=torch.bfloat16)
        else:
            self.x = torch.randn(tokens, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
            self.grad = torch.randn_like(self.x)

    def build(self, fp8=True):
        recipe = self.recipe if fp8 else None
        if self.kind == "llama":
            return build_llama(self.dim, self.blocks, recipe, device=self.device, heads=self.heads, vocab=self.vocab)
        return build_stack(self.dim, self.blocks, recipe, head=False, device=self.device, dtype=torch.bfloat16)

    def fp8_flops(self, model) -> float:
        """FLOPs of the FP8 matmuls in one step: 2 per multiply-add, forward and two backward."""
        from torchao.float8.float8_linear import Float8Linear

        tokens = self.x.shape[0] * (self.x.shape[1] if self.kind == "llama" else 1)
        return sum(6.0 * m.in_features * m.out_features * tokens for m in model.modules() if isinstance(m, Float8Linear))


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


def make_variant(label, work: Workload):
    """Build ``label``'s model and step; returns ``(step, model, info)``."""
    model = work.build(fp8=label != "eager bf16")
    if label.startswith("eager"):
        return eager_step(model, work.x, work.grad), model, {}
    if label.startswith("torch.compile"):
        mode = "reduce-overhead" if "CUDA graphs" in label else None
        return eager_step(torch.compile(model, mode=mode), work.x, work.grad), model, {}
    mode = "full" if "full" in label else "regional"
    # fp8conf traces four blocks and repeats them (trace_joint(repeat=...)); ", whole trace" traces every block.
    gm = fp8conf.trace_joint(model, (work.x,), repeat=False if label.endswith(", whole trace") else work.repeat)
    remainder = "eager" if "eager remainder" in label else "pieces" if label.endswith(", pieces") else "inductor"
    # ", N workers": the distinct units shared out between this process and N helper processes
    # (compile_joint(workers=N)).
    helpers = re.search(r", (\d+) workers?$", label)
    workers = int(helpers.group(1)) if helpers else 0
    # ", saveable units": every unit compiled as a regional artifact stores it.
    config = fp8conf.CompileConfig(mode=mode, cudagraph="CUDA graphs" in label, remainder=remainder, workers=workers,
                                   saveable_units=label.endswith(", saveable units"))
    compiled = fp8conf.compile_joint(gm, config)
    info = {"inductor_compiles": compiled.inductor_compiles, "regions": sum(r.complete for r in compiled.regions)}
    return joint_step(gm, model, work.x, work.grad, compiled), model, info


def cold_build(label, work, device):
    """Build a variant and run its first step: ``(step, model, info, seconds, own peak GiB)``.
    ``info["step_peak_gib"]`` is the peak of the two steps after the first alone (compilation
    left out), above the same baseline."""
    _sync(device)
    before = torch.cuda.memory_allocated() if device == "cuda" else 0
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    step, model, info = make_variant(label, work)
    step()  # the first step compiles
    _sync(device)
    seconds = time.perf_counter() - start
    build_peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(2):  # CUDA-graph variants capture on a later step: count their pools too
        step()
    _sync(device)
    if device == "cuda":
        steps_peak = torch.cuda.max_memory_allocated()
        peak = (max(build_peak, steps_peak) - before) / 2**30
        info["step_peak_gib"] = (steps_peak - before) / 2**30
    else:
        peak = float("nan")
    return step, model, info, seconds, peak


def timed(step, device, warmup, iters) -> float:
    for _ in range(warmup):
        step()
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        step()
    _sync(device)
    return (time.perf_counter() - start) / iters


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
    names = collections.Counter(re.sub(r"_\d+$", "", e.name) for e in kernels)
    return len(kernels) / steps, busy_us / steps / 1e3, {name: count / steps for name, count in names.items()}, _idle(kernels, steps)


def _idle(kernels, steps, top=4) -> dict:
    """Where the GPU waits between kernels: the idle microseconds per step, those in gaps of 20 us
    or more, and the longest gaps with the kernels on either side."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in kernels)
    gaps = [(start - prev_end, prev, name) for (_, prev_end, prev), (start, _, name) in zip(spans, spans[1:]) if start > prev_end]
    long = sorted((g for g in gaps if g[0] >= 20), reverse=True)
    return {
        "idle_us": sum(g[0] for g in gaps) / steps,
        "idle_long_us": sum(g[0] for g in long) / steps,
        "longest": [f"{g:.0f} us after {a[:40]} before {b[:40]}" for g, a, b in long[:top]],
    }


def kernel_difference(row, peer, top=12) -> str:
    """The kernel names (Triton's numbering dropped) ``row`` launches more or less often per
    step than ``peer``, the largest differences first."""
    names, theirs = row.get("kernel_names", {}), peer.get("kernel_names", {})
    diff = {n: names.get(n, 0) - theirs.get(n, 0) for n in set(names) | set(theirs)}
    worst = sorted((n for n in diff if diff[n]), key=lambda n: (-abs(diff[n]), n))[:top]
    return "; ".join(f"{diff[n]:+.0f} {n[:70]}" for n in worst) or "same kernels"


def _labels(args):
    labels = [v for v in VARIANTS + EXTRA_VARIANTS if (v in args.variants if args.variants else v in VARIANTS)]
    return [v for v in labels if "CUDA graphs" not in v or args.device == "cuda"]


def run_config(args, name, dim, blocks, recipe, sink):
    work = Workload(args.model, dim, blocks, recipe, args.device, args.tokens, args.quick)
    live, rows = {}, {}
    torch._dynamo.reset()
    with temporary_cache_dir(tempfile.mkdtemp(prefix="bench-compile-")):
        for label in _labels(args):
            row = dict(model=f"{args.model}-{name}", recipe=recipe, variant=label, tokens=args.tokens)
            try:
                step, model, info, cold, peak = cold_build(label, work, args.device)
            except Exception as exc:  # a variant that cannot run is recorded, not fatal to the others
                rows[label] = dict(row, error=f"{type(exc).__name__}: {str(exc)[:300]}")
                print(f"{name} {label}: {rows[label]['error']}", flush=True)
                continue
            live[label] = step
            rows[label] = dict(row, first_step_s=cold, peak_gib=peak, fp8_flops=work.fp8_flops(model), seconds=[], **info)
            print(f"{name} {label:32s} first step {cold:6.1f} s  peak {peak:6.2f} GiB", flush=True)
        for _ in range(args.repeats):
            for label, step in live.items():
                rows[label]["seconds"].append(timed(step, args.device, args.warmup, args.iters))
    for label, step in live.items():
        row = rows[label]
        if args.device == "cuda":
            row["kernels"], row["gpu_busy_ms"], row["kernel_names"], row["idle"] = gpu_profile(step)
        else:
            row["kernels"], row["gpu_busy_ms"] = float("nan"), float("nan")
        median = statistics.median(row["seconds"])
        print(f"{name} {label:32s} {args.tokens / median / 1e6:8.3f} Mtok/s (median of {len(row['seconds'])})  "
              f"kernels/step {row['kernels']:6.0f}  GPU busy {row['gpu_busy_ms']:7.2f} of {median * 1e3:7.2f} ms  "
              f"step peak {row.get('step_peak_gib', float('nan')):.2f} GiB", flush=True)
        if "idle" in row:
            idle = row["idle"]
            print(f"{name} {label:32s} GPU idle {idle['idle_us']:.0f} us/step, {idle['idle_long_us']:.0f} in gaps >= 20 us; "
                  f"longest: {'; '.join(idle['longest'])}", flush=True)
    peer = rows.get("torch.compile", {})
    for label in live:
        if label != "torch.compile" and peer.get("kernel_names"):
            print(f"{name} {label:32s} kernels vs torch.compile per step: {kernel_difference(rows[label], peer)}", flush=True)
    for row in rows.values():
        sink(row)
    live.clear()
    if args.device == "cuda":
        torch.cuda.empty_cache()


def depth_row(args, label, blocks) -> dict:
    """One depth row, measured in this process (``--depth-child``): the first step of ``label``
    at ``blocks`` blocks, with an empty Inductor cache."""
    dim = 64 if args.quick else 256
    work = Workload("llama", dim, blocks, args.recipes[0], args.device, args.tokens, args.quick)
    row = dict(model=f"llama-dim{dim}", recipe=args.recipes[0], variant=label, blocks=blocks, tokens=args.tokens, depth=True)
    try:
        with temporary_cache_dir(tempfile.mkdtemp(prefix="bench-depth-")):
            _, _, info, cold, _ = cold_build(label, work, args.device)
        row.update(first_step_s=cold, **info)
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return row


def _spawn_depth_row(args, label, blocks, timeout) -> dict:
    """``depth_row`` in a fresh process (no compiled state, no warm caches left by another row),
    killed after ``timeout`` seconds."""
    command = [sys.executable, __file__, "--depth-child", label, str(blocks), "--device", args.device,
               "--tokens", str(args.tokens), "--recipes", args.recipes[0]] + (["--quick"] if args.quick else [])
    dim = 64 if args.quick else 256
    row = dict(model=f"llama-dim{dim}", recipe=args.recipes[0], variant=label, blocks=blocks, tokens=args.tokens, depth=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    try:
        proc = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(row, error=f"timed out after {timeout:.0f} s", timed_out=True, timeout_s=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit status {proc.returncode}"
        return dict(row, error=tail[:300])
    return json.loads(lines[-1])


def run_depth(args, sink):
    """Every (variant, depth) in a process of its own, rows printed and kept as they finish; a
    row gets at most ``--row-timeout`` seconds, and what is left of ``--budget`` for all of them."""
    deadline = time.monotonic() + args.budget
    # Rounds interleaved: a drift of the machine lands on every variant alike.
    for label, blocks in [(label, blocks) for _ in range(args.depth_repeats) for label in args.depth_variants for blocks in args.depth]:
        left = deadline - time.monotonic()
        if left < 10:
            row = dict(variant=label, blocks=blocks, depth=True, model=f"llama-dim{64 if args.quick else 256}", recipe=args.recipes[0],
                       error=f"not run: the {args.budget:.0f} s budget was spent", skipped=True)
        else:
            row = _spawn_depth_row(args, label, blocks, min(args.row_timeout, left))
        print(f"depth {blocks:3d} {label:20s} {row.get('first_step_s', float('nan')):7.1f} s {row.get('error', '')}", flush=True)
        sink(row)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default="llama", choices=list(CONFIGS))
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--warmup", type=int, default=3)
    # At the host-bound debug shape, rounds of 10 steps scattered by a third: 3 of them put full
    # mode at 0.92x torch.compile, 7 rounds of 50 steps of the same code at 1.22x.
    parser.add_argument("--iters", type=int, default=50, help="timed steps per round")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved rounds; figures are their medians")
    parser.add_argument("--configs", nargs="+", help="configurations of --model (default: all)")
    parser.add_argument("--recipes", nargs="+", default=["tensorwise"])
    parser.add_argument("--variants", nargs="+", help="measure only these variants (labels as printed)")
    parser.add_argument("--depth", nargs="+", type=int, help="measure cold start at these depths instead")
    parser.add_argument("--depth-variants", nargs="+", default=list(DEPTH_VARIANTS[:3]), choices=DEPTH_VARIANTS)
    parser.add_argument("--fresh", action="store_true",
                        help="the first step of every compiled variant (FRESH_VARIANTS) at the debug shape, each in a process of its "
                             "own with an empty Inductor cache, as a trainer meets it (same as --depth 6 --depth-variants ...)")
    parser.add_argument("--depth-repeats", type=int, default=1, help="interleaved rounds of the depth rows; the tables show medians")
    parser.add_argument("--row-timeout", type=float, default=150, help="seconds a depth row may take (its own process)")
    parser.add_argument("--budget", type=float, default=450, help="seconds all depth rows together may take")
    parser.add_argument("--depth-child", nargs=2, metavar=("VARIANT", "BLOCKS"), help=argparse.SUPPRESS)
    results.jsonl_arguments(parser)
    parser.add_argument("--quick", action="store_true", help="tiny models, one round: checks the script, measures nothing")
    parser.add_argument("--write", action="store_true", help="append the tables to benchmarks/RESULTS.md")
    args = parser.parse_args()
    if args.fresh:
        args.depth = args.depth or [6]
        args.depth_variants = [v for v in FRESH_VARIANTS if "CUDA graphs" not in v or args.device == "cuda"]
    if args.quick:
        args.tokens, args.warmup, args.iters, args.repeats = 256, 1, 1, 1
        args.depth = args.depth and [1, 2]
    # Before any timer: the first compiling variant would otherwise pay for loading Inductor.
    imported_s = import_compile_stack(args.device)
    if args.depth_child:
        print(json.dumps(depth_row(args, args.depth_child[0], int(args.depth_child[1]))), flush=True)
        return
    rows = []
    if args.from_jsonl:
        rows = results.read_jsonl(args.from_jsonl)
        environment = rows[0].get("environment", "") if rows else ""
    else:
        import torchao

        device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
        environment = (f"{device}; torch {torch.__version__}, torchao {torchao.__version__}; {args.tokens} tokens per step, bf16; "
                       f"compile stack imported before any timer ({imported_s:.1f} s)")

        def sink(row):
            row["environment"] = environment
            rows.append(row)
            results.append_jsonl(args.jsonl, row)

        if args.depth:
            run_depth(args, sink)
        for name, (dim, blocks) in ({} if args.depth else CONFIGS[args.model]).items():
            if args.configs and name not in args.configs:
                continue
            if args.quick:
                dim, blocks = 64, 2
            for recipe in args.recipes:
                run_config(args, name, dim, blocks, recipe, sink)
    text = goals.report(rows)
    print(text)
    if args.write:
        results.append("bench_compile", f"{environment}. {goals.CONDITIONS}", text)


if __name__ == "__main__":
    main()
