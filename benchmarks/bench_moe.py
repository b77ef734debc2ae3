"""Tokens per second and peak memory of one FP8 mixture-of-experts training step (forward +
backward) of a stack of MoE layers: TorchAO's MoE training path side by side with fp8conf's
grouped experts, eager and compiled.

The model is ``conformance.draw.moe``'s MoE stack (a bf16 top-k router, experts up and down with a
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
turn for ``--steps`` steps; a figure is the median over rounds. Every step drops the gradients
of the step before (``set_to_none``) and, under CUDA graphs, marks a new step
(``torch.compiler.cudagraph_mark_step_begin``), so no step reads what a replay overwrote. Memory is
what the variant holds above what was allocated before it was built: ``step MiB`` the peak of
one step once built, ``build MiB`` the peak while building (tracing, compiling, autotuning,
capturing) and running its first steps. A variant that fails prints its error.

``--memory`` measures nothing on a GPU: it traces each experts kind's joint graph with fake
tensors (on CPU, at the given shapes) and prints what a step saves for its backward and the
peak of its live tensors in graph order (``benchmarks/joint_memory.py``), then runs a small
step eagerly on CPU under the profiler to show what recording autograd through a joint graph
costs.

    python benchmarks/bench_moe.py --jsonl moe.jsonl           # on an sm90 GPU, torchao with Triton
    python benchmarks/bench_moe.py --from-jsonl moe.jsonl --write   # the table, appended to RESULTS.md
    python benchmarks/bench_moe.py --device cpu --quick        # CPU: the variants that can run there
    python benchmarks/bench_moe.py --memory                    # CPU: saved and peak bytes per variant
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

import fp8conf
from conformance.draw.moe import MoESpec, build_moe_model

import joint_memory  # benchmarks/joint_memory.py, beside this script
import results

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
        graphed = "CUDA graphs" in variant
        if variant.startswith("torch.compile"):
            fn = torch.compile(model, mode="reduce-overhead" if graphed else None)

        def step():
            # Gradients accumulated into last step's .grad would read (under CUDA graphs) a
            # buffer the next replay overwrote; a training loop zeroes them anyway.
            model.zero_grad(set_to_none=True)
            x.grad = None
            if graphed:
                torch.compiler.cudagraph_mark_step_begin()
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
        # The results are dropped at once: a CUDA-graphed joint graph returns the same output
        # buffers at every replay, so holding them across steps would read the next step's values.
        fp8conf.run_joint(gm, model, args, grads, fn=compiled)

    return step


def _time(step, steps, device) -> float:
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    return (time.perf_counter() - start) / steps


def _mib_above(before) -> float:
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def _build_row(variant, spec, device, dtype):
    """``(row, step)``: ``variant`` built and run twice, its first step time and memory in
    ``row``; ``step`` is ``None`` with ``row["error"]`` when it fails."""
    row = {"variant": variant}
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
        _sync(device)
        if device == "cuda":
            row["build MiB"] = _mib_above(before)
            torch.cuda.reset_peak_memory_stats()
            step()
            _sync(device)
            row["step MiB"] = _mib_above(before)
    except Exception as exc:  # a variant this torch/torchao cannot run is reported, not fatal
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        step = None
    return row, step


def _kernels(step) -> dict:
    """Kernels one step launches on the GPU, their summed time, and the costliest (a CUDA-graph
    replay shows its kernels too)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, float] = {}
    for event in kernels:
        by_name[event.name] = by_name.get(event.name, 0.0) + event.device_time
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:5]
    return {
        "kernels": len(kernels),
        "kernel ms": sum(e.device_time for e in kernels) / 1e3,
        "top kernels": [[name[:80], us / 1e3] for name, us in top],
    }


def measure(spec, device, dtype, variants, steps, repeats, sink=lambda row: None) -> list[dict]:
    """One row per variant; ``sink`` gets each row once it is complete."""
    built, rows = {}, []
    for variant in variants:
        row, step = _build_row(variant, spec, device, dtype)
        rows.append(row)
        if step is None:
            sink(row)
        else:
            built[variant] = step
    times: dict[str, list[float]] = {v: [] for v in built}
    for _ in range(repeats):
        for variant, step in built.items():
            times[variant].append(_time(step, steps, device))
    for row in rows:
        if row["variant"] in times:
            seconds = statistics.median(times[row["variant"]])
            row["ms/step"] = 1e3 * seconds
            row["tokens/s"] = spec.tokens / seconds
            if device == "cuda":
                try:
                    row.update(_kernels(built[row["variant"]]))
                except Exception as exc:  # the profiler is an extra: its failure loses no timing
                    row["kernels error"] = f"{type(exc).__name__}: {exc}"[:120]
            sink(row)
    return rows


def table(rows) -> str:
    base = next((r["tokens/s"] for r in rows if r["variant"] == "eager torchao" and "tokens/s" in r), None)
    lines = [
        "| variant | tokens/s | ms/step | vs eager torchao | step MiB | build MiB | first step s | kernels/step | kernel ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | failed: {r['error']} | | | | | | | |")
            continue
        ratio = f"{r['tokens/s'] / base:.2f}x" if base else "-"
        step_mib, build_mib = (f"{r[k]:.0f}" if k in r else "-" for k in ("step MiB", "build MiB"))
        kernel_ms = f"{r['kernel ms']:.2f}" if "kernel ms" in r else "-"
        lines.append(
            f"| {r['variant']} | {r['tokens/s']:,.0f} | {r['ms/step']:.2f} | {ratio} | {step_mib} | {build_mib} | "
            f"{r['first step s']:.1f} | {r.get('kernels', '-')} | {kernel_ms} |"
        )
    top = [r for r in rows if r.get("top kernels")]
    if top:
        lines += ["", "| variant | costliest kernels of one step (ms) |", "|---|---|"]
        lines += [f"| {r['variant']} | " + "; ".join(f"`{n}` {ms:.2f}" for n, ms in r["top kernels"]) + " |" for r in top]
    return "\n".join(lines)


#: The experts of the memory table: ``None`` high precision, else fp8conf's with that ``emulate``.
_MEMORY_KINDS = {"bf16 experts": None, "fp8conf rowwise": False, "fp8conf rowwise, emulated": True}


def _traced(spec, emulate):
    convert = (lambda *a, **k: None) if emulate is None else _fp8conf_convert(emulate)
    model, (x,) = build_moe_model(spec, "cpu", convert=convert)
    model.to(torch.bfloat16)
    x = x.detach().to(torch.bfloat16).requires_grad_()
    return model, x, fp8conf.trace_joint(model, (x,))


def memory_table(spec) -> str:
    """Saved and peak live bytes of each experts kind's joint graph, from fake tensors."""
    lines = ["| experts | saved for backward MiB | peak live MiB | saved, by op (MiB, 1 MiB and more) | peak at |", "|---|---:|---:|---|---|"]
    for kind, emulate in _MEMORY_KINDS.items():
        memory = joint_memory.joint_memory(_traced(spec, emulate)[2])
        by_op: dict[str, int] = {}
        for nbytes, description in memory.saved:
            by_op[description.split()[0]] = by_op.get(description.split()[0], 0) + nbytes
        saved = ", ".join(f"{op} {b / 2**20:.0f}" for op, b in sorted(by_op.items(), key=lambda kv: -kv[1]) if b >= 2**20)
        lines.append(f"| {kind} | {memory.saved_bytes / 2**20:.0f} | {memory.peak_bytes / 2**20:.0f} | {saved} | {memory.peak_node} |")
    return "\n".join(lines)


def eager_memory_table(spec) -> str:
    """Measured CPU peaks of one eager step: the high-precision model through autograd, and
    fp8conf's emulated joint graph run with and without autograd recording through it."""
    model, x, _ = _traced(spec, None)
    grad = torch.randn_like(x)
    fp8_model, fp8_x, gm = _traced(spec, True)
    signature = fp8conf.joint_signature(gm)

    def recorded():
        signature.results(gm(*signature.feed(fp8_model, (fp8_x,), (grad,))))

    runs = {
        "bf16 experts, autograd (`model(x).backward`)": lambda: model(x).backward(grad),
        "fp8conf emulated, joint graph under grad mode": recorded,
        "fp8conf emulated, `run_joint` (no_grad)": lambda: fp8conf.run_joint(gm, fp8_model, (fp8_x,), (grad,)),
    }
    lines = ["| eager step | measured CPU peak MiB |", "|---|---:|"]
    for name, run in runs.items():
        lines.append(f"| {name} | {joint_memory.measured_cpu_peak(run) / 2**20:.1f} |")
    return "\n".join(lines)


def memory_report(args, spec) -> tuple[str, str]:
    small = dataclasses.replace(spec, dim=256, hidden=256, tokens=1024)
    conditions = (
        f"CPU, torch {torch.__version__}; {spec.layers} MoE layers, {spec.experts} experts, top-{spec.top_k}, bf16; "
        f"joint graphs traced with fake tensors at dim {spec.dim}, hidden {spec.hidden}, {spec.tokens} tokens "
        f"(placeholders not counted); eager steps measured at dim 256, hidden 256, 1024 tokens"
    )
    return conditions, memory_table(spec) + "\n\n" + eager_memory_table(small)


def _arguments(argv):
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
    parser.add_argument("--memory", action="store_true", help="CPU only: saved and peak bytes per experts kind")
    results.jsonl_arguments(parser)
    parser.add_argument("--write", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    if args.quick:
        args.dim, args.hidden, args.tokens, args.layers, args.steps, args.repeats = 64, 64, 256, 1, 2, 1
    return args


def _conditions(args, dtype) -> str:
    import torchao

    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    return (
        f"{where}, torch {torch.__version__}, torchao {torchao.__version__}; {args.layers} MoE layers, dim {args.dim}, "
        f"hidden {args.hidden}, {args.experts} experts, top-{args.top_k}, {args.tokens} tokens, {dtype}; "
        f"median of {args.repeats} rounds of {args.steps} steps"
    )


def main(argv=None) -> None:
    args = _arguments(argv)
    spec = MoESpec(dim=args.dim, hidden=args.hidden, experts=args.experts, top_k=args.top_k, layers=args.layers, tokens=args.tokens)
    if args.memory:
        conditions, text = memory_report(args, spec)
        print(conditions + "\n\n" + text)
        if args.write:
            results.append("bench_moe --memory: what an MoE step saves and holds", conditions, text)
        return
    if args.from_jsonl:
        order = {variant: i for i, variant in enumerate(VARIANTS)}
        rows = sorted(results.read_jsonl(args.from_jsonl), key=lambda r: order.get(r["variant"], len(order)))
        conditions = rows[0].get("conditions", "") if rows else ""
    else:
        if args.device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("bench_moe: CUDA is not available; use --device cpu --quick for the CPU variants")
        variants = args.variants or (VARIANTS if args.device == "cuda" else _CPU_VARIANTS)
        if args.device == "cpu":
            print("bench_moe on CPU: no FP8 grouped-GEMM kernel and no Triton, so fp8conf's experts run emulated "
                  f"and TorchAO's path is left out; variants: {', '.join(variants)}")
        dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
        conditions = _conditions(args, dtype)

        def sink(row):
            results.append_jsonl(args.jsonl, dict(row, conditions=conditions))

        rows = measure(spec, args.device, dtype, variants, args.steps, args.repeats, sink)
    text = table(rows)
    print(conditions + "\n\n" + text)
    if args.write:
        results.append("bench_moe: FP8 MoE training step", conditions, text)


if __name__ == "__main__":
    main()
