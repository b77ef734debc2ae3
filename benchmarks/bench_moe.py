"""Tokens per second and peak memory of one FP8 mixture-of-experts training step (forward +
backward) of a stack of MoE layers: TorchAO's MoE training path side by side with fp8conf's
grouped experts, eager and compiled.

The model is ``conformance.moe``'s MoE stack (a bf16 top-k router, experts up and down with a
ReLU between them, token groups padded to multiples of 16) at ``--dim 2048``, ``--experts 8``,
``--top-k 2``. Variants:

* ``eager bf16``: the high-precision experts (``torch._grouped_mm``);
* ``eager torchao``: the experts' weights converted by ``torchao.quantization.quantize_`` with
  ``torchao.prototype.moe_training.Float8TrainingOpConfig`` (rowwise FP8 through Triton casts and
  ``torch._scaled_grouped_mm``), and ``torch.compile`` of that model (``+ CUDA graphs``:
  ``mode="reduce-overhead"``);
* ``fp8conf eager``: fp8conf's ``Float8GroupedExperts``, the traced joint graph run eagerly; and
  that graph compiled ``full`` and ``regional`` (only the FP8 regions) by
  ``fp8conf.compile_joint``, each also captured in a CUDA graph.

Each variant is built (its first step timed), then ``--repeats`` rounds time every variant in
turn for ``--steps`` steps; a figure is the median over rounds. Peak memory is what the variant
allocates above what was allocated before it was built. A variant that fails prints its error.

    python benchmarks/bench_moe.py                       # on an sm90 GPU, torchao with Triton
    python benchmarks/bench_moe.py --write               # ... and append the table to RESULTS.md
    python benchmarks/bench_moe.py --device cpu --quick  # CPU: the variants that can run there
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fp8conf
from conformance.moe import MoESpec, build_moe_model

import results  # benchmarks/results.py, beside this script

VARIANTS = (
    "eager bf16", "eager torchao", "torch.compile torchao", "torch.compile torchao + CUDA graphs",
    "fp8conf eager", "fp8conf full", "fp8conf full + CUDA graphs", "fp8conf regional", "fp8conf regional + CUDA graphs",
)
_CPU_VARIANTS = ("eager bf16", "fp8conf eager", "fp8conf full")


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _fp8conf_convert(emulate: bool):
    def convert(model, *, module_filter_fn, recipe, emulate_flag=emulate, **_):
        fp8conf.convert_to_float8_grouped_experts(model, recipe=recipe, emulate=emulate_flag, module_filter_fn=module_filter_fn)

    return convert


def _torchao_convert(model, *, module_filter_fn, **_):
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.quantization import quantize_

    quantize_(model, Float8TrainingOpConfig(), filter_fn=lambda m, fqn: module_filter_fn(m, fqn))


def _build(variant, spec, device, dtype):
    """``step()`` running one training step of ``variant``, or raises."""
    if variant == "eager bf16" or "torchao" in variant:
        convert = (lambda *a, **k: None) if variant == "eager bf16" else _torchao_convert
        model, (x,) = build_moe_model(spec, device, convert=convert)
        model.to(dtype)
        x = x.detach().to(dtype).requires_grad_()
        grad = torch.randn_like(x)
        fn = model
        if variant.startswith("torch.compile"):
            fn = torch.compile(model, mode="reduce-overhead" if "CUDA graphs" in variant else None)

        def step():
            fn(x).backward(grad)

        return step
    model, (x,) = build_moe_model(spec, device, convert=_fp8conf_convert(emulate=device != "cuda"))
    model.to(dtype)
    args = (x.detach().to(dtype).requires_grad_(),)
    grads = (torch.randn_like(args[0]),)
    gm = fp8conf.trace_joint(model, args)
    compiled = None
    if variant != "fp8conf eager":
        mode = "full" if "full" in variant else "regional"
        compiled = fp8conf.compile_joint(gm, mode=mode, strict=True, cudagraph="CUDA graphs" in variant)

    def step():
        fp8conf.run_joint(gm, model, args, grads, fn=compiled)

    return step


def _time(step, steps, device) -> float:
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    return (time.perf_counter() - start) / steps


def measure(spec, device, dtype, variants, steps, repeats) -> list[dict]:
    built, rows = {}, []
    for variant in variants:
        row = {"variant": variant}
        rows.append(row)
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        try:
            start = time.perf_counter()
            step = _build(variant, spec, device, dtype)
            step()
            _sync(device)
            row["first step s"] = time.perf_counter() - start
            step()  # CUDA-graph variants capture on a later call
            built[variant] = step
            if device == "cuda":
                row["peak MiB"] = (torch.cuda.max_memory_allocated() - before) / 2**20
        except Exception as exc:  # a variant this torch/torchao cannot run is reported, not fatal
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    times: dict[str, list[float]] = {v: [] for v in built}
    for _ in range(repeats):
        for variant, step in built.items():
            times[variant].append(_time(step, steps, device))
    for row in rows:
        if row["variant"] in times:
            seconds = statistics.median(times[row["variant"]])
            row["ms/step"] = 1e3 * seconds
            row["tokens/s"] = spec.tokens / seconds
    return rows


def table(rows) -> str:
    base = next((r["tokens/s"] for r in rows if r["variant"] == "eager torchao" and "tokens/s" in r), None)
    lines = ["| variant | tokens/s | ms/step | vs eager torchao | peak MiB | first step s |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | failed: {r['error']} | | | | |")
            continue
        ratio = f"{r['tokens/s'] / base:.2f}x" if base else "-"
        peak = f"{r['peak MiB']:.0f}" if "peak MiB" in r else "-"
        lines.append(f"| {r['variant']} | {r['tokens/s']:,.0f} | {r['ms/step']:.2f} | {ratio} | {peak} | {r['first step s']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS)
    parser.add_argument("--quick", action="store_true", help="small shapes, 1 repeat of 2 steps")
    parser.add_argument("--write", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    if args.quick:
        args.dim, args.hidden, args.tokens, args.layers, args.steps, args.repeats = 64, 64, 256, 1, 2, 1
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_moe: CUDA is not available; use --device cpu --quick for the CPU variants")
    variants = args.variants or (VARIANTS if args.device == "cuda" else _CPU_VARIANTS)
    if args.device == "cpu":
        print("bench_moe on CPU: no FP8 grouped-GEMM kernel and no Triton, so fp8conf's experts run emulated "
              f"and TorchAO's path is left out; variants: {', '.join(variants)}")
    spec = MoESpec(dim=args.dim, hidden=args.hidden, experts=args.experts, top_k=args.top_k, layers=args.layers, tokens=args.tokens)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    rows = measure(spec, args.device, dtype, variants, args.steps, args.repeats)
    import torchao

    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    conditions = (
        f"{where}, torch {torch.__version__}, torchao {torchao.__version__}; {args.layers} MoE layers, dim {args.dim}, "
        f"hidden {args.hidden}, {args.experts} experts, top-{args.top_k}, {args.tokens} tokens, {dtype}; "
        f"median of {args.repeats} rounds of {args.steps} steps"
    )
    text = table(rows)
    print(conditions + "\n\n" + text)
    if args.write:
        results.append("bench_moe: FP8 MoE training step", conditions, text)


if __name__ == "__main__":
    main()
