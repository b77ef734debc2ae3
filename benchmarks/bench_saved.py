"""What one FP8 training step keeps for its backward, the kernels Inductor generates for it and
(on CUDA) the step's peak memory: ``torch.compile`` side by side with fp8conf full and regional.

Saved bytes are counted on real tensors by :mod:`fp8conf.tools.saved`: distinct storages, the
step's inputs (parameters, batch) left out. Kernels: ``torch._inductor.metrics``'
``generated_kernel_count`` over the variant's compilation (Inductor's cache replays the count
on a hit), and on CUDA the kernels launched per step (torch.profiler). Step peak: the most
memory allocated during one step beyond what was allocated before it (the model, the batch),
after two warm-up steps, so compilation's own allocations are not in it: saved values,
gradients and temporaries.

    python benchmarks/bench_saved.py                                  # on a GPU: Llama dim256x6 and dim2048x4
    python benchmarks/bench_saved.py --configs dim2048x4 --recipes tensorwise rowwise
    python benchmarks/bench_saved.py --device cpu --quick             # Llama dim64x2 on CPU (no peak)
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from torch._inductor import metrics
from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

import fp8conf
from fp8conf.tools.saved import saved_by_compiled_joint, saved_by_torch_compile

from bench_compile import CONFIGS, Workload, eager_step, gpu_profile, joint_step

VARIANTS = ("torch.compile", "fp8conf full", "fp8conf regional")


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def build(label, work):
    """``(step, model, saved, boxed)`` of a variant, compiled and run once: ``saved`` measures its
    saved values, ``boxed`` says whether its backward frees them as it consumes them."""
    model = work.build()
    if label == "torch.compile":
        compiled_model = torch.compile(model)
        step = eager_step(compiled_model, work.x, work.grad)
        step()
        return step, model, lambda: saved_by_torch_compile(compiled_model, model, (work.x,)), "yes"
    gm = fp8conf.trace_joint(model, (work.x,))
    compiled = fp8conf.compile_joint(gm, mode=label.split()[-1])
    step = joint_step(gm, model, work.x, work.grad, compiled)
    step()
    return step, model, lambda: saved_by_compiled_joint(gm, compiled, model, (work.x,)), _boxed(compiled)


def _boxed(compiled) -> str:
    """Whether the compiled backward is called boxed, freeing saved values as it consumes them
    (found inside torch's CompiledArtifact, which other torch versions may lay out otherwise)."""
    if compiled.mode != "full":
        # The regional backward graph takes its inputs as one list and hands each compiled call one.
        boxed = type(compiled.artifact[1].graph._codegen).__name__ == "_BoxedCodeGen"
        return "yes (per compiled call)" if boxed else "no: this torch has no boxed FX code generator"
    from fp8conf.compile.units import _boxed_entry

    return "yes" if _boxed_entry(compiled.artifact[1]) is not None else "NO: not found in this torch"


def step_peak_gib(step, model, device) -> float:
    if device != "cuda":
        return float("nan")
    for _ in range(2):
        step()
    # An eager step frees the last step's .grad only when the next one starts; fp8conf's steps
    # return their gradients: neither is in what was allocated before the step.
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**30


def measure(label, work, device) -> dict:
    torch._dynamo.reset()
    with temporary_cache_dir(tempfile.mkdtemp(prefix="bench-saved-")):
        metrics.reset()
        start = time.perf_counter()
        step, model, saved, boxed = build(label, work)
        _sync(device)
        seconds = time.perf_counter() - start
        generated = metrics.generated_kernel_count
    values = saved()
    peak = step_peak_gib(step, model, device)
    launched = gpu_profile(step)[0] if device == "cuda" else float("nan")
    del step, model, saved
    if device == "cuda":
        torch.cuda.empty_cache()
    return dict(variant=label, saved_mib=values.nbytes / 2**20, storages=values.storages, tensors=values.tensors,
                generated=generated, launched=launched, peak_gib=peak, first_step_s=seconds, boxed=boxed)


def table(rows) -> str:
    lines = ["| model | recipe | variant | saved MiB | saved vs torch.compile | storages / tensors saved | kernels generated | "
             "kernels/step | step peak GiB | step peak vs torch.compile | saved freed as consumed | first step s |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    base = {(r["model"], r["recipe"]): r for r in rows if r["variant"] == "torch.compile"}
    for r in rows:
        b = base.get((r["model"], r["recipe"]))

        def ratio(key):
            return f"{r[key] / b[key]:.2f}x" if b and b[key] == b[key] and b[key] > 0 else "n/a"

        lines.append(f"| {r['model']} | {r['recipe']} | {r['variant']} | {r['saved_mib']:.3f} | {ratio('saved_mib')} | "
                     f"{r['storages']} / {r['tensors']} | {r['generated']} | {r['launched']:.0f} | {r['peak_gib']:.3f} | "
                     f"{ratio('peak_gib')} | {r['boxed']} | {r['first_step_s']:.1f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--configs", nargs="+", help="Llama configurations (default: all)")
    parser.add_argument("--recipes", nargs="+", default=["tensorwise"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--quick", action="store_true", help="Llama dim64x2, 4 heads, vocab 256, 64 tokens")
    args = parser.parse_args()
    configs = {"dim64x2": (64, 2)} if args.quick else CONFIGS["llama"]
    tokens = 64 if args.quick else args.tokens
    rows = []
    for name, (dim, blocks) in configs.items():
        if args.configs and name not in args.configs and not args.quick:
            continue
        for recipe in args.recipes:
            work = Workload("llama", dim, blocks, recipe, args.device, tokens, quick=args.quick)
            for label in args.variants:
                try:
                    row = measure(label, work, args.device)
                except Exception as exc:  # one variant failing leaves the others' rows
                    print(f"{name} {recipe} {label}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                    continue
                rows.append(dict(row, model=f"llama-{name}", recipe=recipe))
                print(f"{name} {recipe} {label:18s} saved {row['saved_mib']:9.2f} MiB  generated {row['generated']:5d}  "
                      f"step peak {row['peak_gib']:.3f} GiB", flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
