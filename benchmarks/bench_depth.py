"""First step against depth: fp8conf's two compile modes beside torch's own answers for deep models.

For the Llama-shaped FP8 model of ``benchmarks/llama.py`` at each ``--blocks`` depth and each
``--recipes`` recipe, dense or with grouped experts (``--ffn``), five paths, each row in a fresh
process with an empty Inductor cache of its own (a new ``TORCHINDUCTOR_CACHE_DIR``), killed after
``--row-timeout`` seconds:

- ``fp8conf regional``: ``trace_joint(model, args)`` with no flag (from 12 equal blocks on it traces
  four and repeats them) and ``compile_joint(gm, mode="regional")``;
- ``fp8conf full``: the same trace, ``compile_joint(gm, mode="full")``;
- ``torch.compile``: ``torch.compile(model)``, its forward and backward a training step;
- ``torch.compile + nested_compile_region``: the same with the block's forward wrapped in
  ``torch.compiler.nested_compile_region`` (one block traced and compiled, the others reusing it);
- ``regional_inductor``: the joint graph ``trace_joint`` makes, its FP8 regions tagged by
  ``fp8conf.tag_fp8_regions`` (the ``compile_with_inductor`` annotation), cut into forward and
  backward by the min-cut partitioner keeping the regions whole, and each half compiled by
  ``torch.fx.passes.regional_inductor`` under a tracing context of the graph's fake mode, as a
  graph trainer's compiler calls it; what is not tagged runs as eager FX code.

Columns: the first step (trace, compile and one step: what a user waits for), the host seconds of
each phase the path has (trace, compile, first call; Inductor's own share of them counted in
``torch._inductor.compile_fx._compile_fx_inner``), the graphs Inductor was handed and how many of
them it generated code for (the rest were hits of its in-memory cache), the steady step (median
of ``--iters`` steps after two warm ones), and the peak memory (CUDA: the most allocated; CPU: the
child's maximum resident set, compile workers not counted). A path that fails says how, with the
first line of its error; a row that runs out of time says so and carries no number.

``--ffn experts`` gives every block a mixture-of-experts feed-forward instead of the dense SwiGLU:
a bf16 top-``--top-k`` router over ``--experts`` experts whose grouped GEMMs, forward and
backward, are fp8conf's rowwise FP8 grouped experts (``Float8GroupedExperts``), token groups
padded to multiples of 16. Grouped experts have recipe ``rowwise`` only: a ``tensorwise`` experts
row fails saying so. Where torch has no FP8 grouped-GEMM kernel (any device but CUDA) the experts
are emulated (quantized as FP8 is, multiplied in bf16), and the row says ``experts_emulated``.
Each row records its ``ffn`` (a row without one, written before the option, is dense); the table
has an ``ffn`` column, the plot's series name it, and ``--from-jsonl`` draws the rows of one
``--ffn`` as it does those of one ``--device``.

Rows are appended to ``--jsonl`` as each finishes (by default ``benchmarks/bench_depth.jsonl``,
and for ``--ffn experts`` ``benchmarks/bench_depth-experts.jsonl``, apart from the dense rows the
performance page's depth goals read); the table is printed and a plot of first-step seconds
against depth per path, with each path's exponent fitted by least squares on log-log axes, is
written next to the JSONL (``.svg``; another device's ``-DEVICE.svg``, experts rows'
``-experts.svg``).

    python benchmarks/bench_depth.py --device cpu --dim 64 --heads 4 --vocab 256 --tokens 256 --blocks 2 8 32
    python benchmarks/bench_depth.py --blocks 2 8 32 64 --recipes tensorwise rowwise       # on a GPU (sm89+)
    python benchmarks/bench_depth.py --device cpu --ffn experts --recipes rowwise --dim 64 --heads 4 --vocab 256 --tokens 256 --blocks 2 8
    python benchmarks/bench_depth.py --from-jsonl benchmarks/bench_depth.jsonl --write      # the table and plot again
    python benchmarks/bench_depth.py --from-jsonl benchmarks/bench_depth.jsonl --device cpu --ffn experts   # the experts rows
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import results  # benchmarks/results.py, beside this script

ROOT = Path(__file__).resolve().parent.parent
JSONL = Path(__file__).with_name("bench_depth.jsonl")
#: Where ``--ffn experts`` rows go by default: apart from the dense rows, which
#: ``benchmarks/results_table.py`` reads for the depth goals.
EXPERTS_JSONL = Path(__file__).with_name("bench_depth-experts.jsonl")
PATHS = ("fp8conf regional", "fp8conf full", "torch.compile", "torch.compile + nested_compile_region", "regional_inductor")
#: Phase columns, in the order a path meets them; a path has those it records.
PHASES = ("trace_s", "partition_s", "compile_s", "first_call_s", "inductor_s")
#: The block feed-forwards ``--ffn`` picks (``benchmarks/llama.py``'s ``FFN_KINDS``).
FFNS = ("dense", "experts")


def row_ffn(row: dict) -> str:
    """The feed-forward of ``row``'s model; rows written before ``--ffn`` existed are dense."""
    return row.get("ffn", "dense")


def ffn_label(row: dict) -> str:
    """``row``'s feed-forward as the table and plot name it: ``dense``, or ``experts`` with the
    number of experts, the router's top-k and whether the experts were emulated."""
    if row_ffn(row) == "dense":
        return "dense"
    details = [f"{row['experts']} experts" if "experts" in row else "", f"top-{row['top_k']}" if "top_k" in row else "",
               "emulated" if row.get("experts_emulated") else ""]
    details = [d for d in details if d]
    return f"experts ({', '.join(details)})" if details else "experts"


def select_rows(rows, device: str, ffn: str) -> list[dict]:
    """The rows of one device and one feed-forward: a CPU row and a GPU row of one path, or a
    dense row and an experts row, are other models."""
    return [row for row in rows if row.get("device", "cpu") == device and row_ffn(row) == ffn]


class InductorCounter:
    """Counts and times the graphs Inductor is handed (``_compile_fx_inner``, whichever entry point
    led there: ``torch.compile``, ``compile_fx_inner``, ``standalone_compile``) and those it
    generates code for (``fx_codegen_and_compile``, skipped on a cache hit). Both are looked up as
    module globals when called, so patching the module sees every call."""

    def __init__(self):
        import torch._inductor.compile_fx as compile_fx

        self.compiles = self.generated = 0
        self.seconds = 0.0
        self._depth = 0
        inner, codegen = compile_fx._compile_fx_inner, compile_fx.fx_codegen_and_compile

        def counted_inner(*args, **kwargs):
            self.compiles += 1
            self._depth += 1
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self._depth -= 1
                if not self._depth:  # a graph compiled inside another's compile is already counted
                    self.seconds += time.perf_counter() - start

        def counted_codegen(*args, **kwargs):
            self.generated += 1
            return codegen(*args, **kwargs)

        compile_fx._compile_fx_inner, compile_fx.fx_codegen_and_compile = counted_inner, counted_codegen


def _timed(phases: dict, name: str, sync, fn, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    sync()
    phases[name] = time.perf_counter() - start
    return out


def _fp8conf(mode, model, x, grad, sync, phases):
    import fp8conf
    from bench_compile import joint_step

    gm = _timed(phases, "trace_s", sync, fp8conf.trace_joint, model, (x,))
    compiled = _timed(phases, "compile_s", sync, fp8conf.compile_joint, gm, mode=mode)
    return joint_step(gm, model, x, grad, compiled)


def _torch_compile(nested, model, x, grad, sync, phases):
    import torch
    from bench_compile import eager_step

    if nested:
        from llama import Block

        Block.forward = torch.compiler.nested_compile_region(Block.forward)  # this process's class only
    return eager_step(torch.compile(model), x, grad)


def _regional_inductor(model, x, grad, sync, phases):
    """The joint graph tagged and cut as a graph trainer does, each half through regional_inductor."""
    import torch
    from torch.fx.passes.regional_inductor import regional_inductor

    import fp8conf
    from fp8conf.compile.assemble import run_partitioned
    from fp8conf.compile.partition import partition_joint
    from fp8conf.compile.region_compile import tracing_fake_mode
    from fp8conf.graph.regions import tag_fp8_regions
    from fp8conf.graph.trace import flat_graph_module

    gm = _timed(phases, "trace_s", sync, fp8conf.trace_joint, model, (x,))
    start = time.perf_counter()
    flat = flat_graph_module(gm)
    tag_fp8_regions(flat)
    halves = partition_joint(flat, keep_fp8_regions=True)
    if halves is None:
        raise RuntimeError("the min-cut partitioner cannot cut this joint graph")
    phases["partition_s"] = time.perf_counter() - start

    def compile_half(half):
        with tracing_fake_mode(half):
            compiled = regional_inductor(half)
        # Its graph comes back taking its inputs as one list (the boxed convention of a compiler
        # AOTAutograd calls), whatever it took before.
        return lambda *inputs: compiled(list(inputs))

    start = time.perf_counter()
    forward, backward = compile_half(halves.forward), compile_half(halves.backward)
    phases["compile_s"] = time.perf_counter() - start
    run = run_partitioned(halves, forward, backward)
    signature = fp8conf.joint_signature(gm)
    primals, tangents = signature.feed(model, (x,), (grad,))

    def step():
        with torch.no_grad():
            return signature.results(run(*primals, *tangents))

    return step


BUILDERS = {
    "fp8conf regional": lambda *a: _fp8conf("regional", *a),
    "fp8conf full": lambda *a: _fp8conf("full", *a),
    "torch.compile": lambda *a: _torch_compile(False, *a),
    "torch.compile + nested_compile_region": lambda *a: _torch_compile(True, *a),
    "regional_inductor": _regional_inductor,
}


def child(args) -> dict:
    """One row, in this process: the first step of ``args.path``, then the steady step."""
    import warnings

    warnings.simplefilter("ignore")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch

    from imports import import_compile_stack
    from llama import build_llama

    import_compile_stack(args.device)  # module loading is no part of a first step
    sync = torch.cuda.synchronize if args.device == "cuda" else lambda: None
    model = build_llama(args.dim, args.blocks, args.recipe, device=args.device, heads=args.heads, vocab=args.vocab,
                        ffn=args.ffn, tokens=args.tokens, experts=args.experts, top_k=args.top_k,
                        emulate_experts=experts_emulated(args.device))
    x = torch.randint(0, args.vocab, (1, args.tokens), device=args.device)
    grad = torch.randn(1, args.tokens, args.vocab, device=args.device, dtype=torch.bfloat16)
    counter, phases = InductorCounter(), {}
    start = time.perf_counter()
    step = BUILDERS[args.path](model, x, grad, sync, phases)
    _timed(phases, "first_call_s", sync, step)
    first = time.perf_counter() - start
    phases["inductor_s"] = counter.seconds
    row = {"first_step_s": first, **phases, "inductor_compiles": counter.compiles, "inductor_generated": counter.generated}
    for _ in range(2):
        step()
    seconds = []
    for _ in range(args.iters):
        start = time.perf_counter()
        step()
        sync()
        seconds.append(time.perf_counter() - start)
    row["step_s"] = statistics.median(seconds)
    # A steady step that compiles again (a guard that fails every call) shows here.
    row["steady_inductor_compiles"] = counter.compiles - row["inductor_compiles"]
    if args.device == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    else:
        row["peak_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return row


def experts_emulated(device: str) -> bool:
    """Whether experts on ``device`` are emulated: torch has FP8 grouped-GEMM kernels on CUDA only."""
    return device.split(":")[0] != "cuda"


def measure(args, path: str, recipe: str, blocks: int) -> dict:
    """One row in a fresh process with an Inductor cache of its own, killed after ``--row-timeout``."""
    row = {"path": path, "recipe": recipe, "blocks": blocks, "device": args.device, "ffn": args.ffn, "dim": args.dim,
           "heads": args.heads, "vocab": args.vocab, "tokens": args.tokens}
    if args.ffn == "experts":
        row.update(experts=args.experts, top_k=args.top_k, experts_emulated=experts_emulated(args.device))
    command = [sys.executable, __file__, "--child", path, "--recipes", recipe, "--blocks", str(blocks), "--device", args.device,
               "--dim", str(args.dim), "--heads", str(args.heads), "--vocab", str(args.vocab), "--tokens", str(args.tokens),
               "--iters", str(args.iters), "--ffn", args.ffn, "--experts", str(args.experts), "--top-k", str(args.top_k)]
    cache = tempfile.mkdtemp(prefix="bench-depth-")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    try:
        proc = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT, timeout=args.row_timeout)
    except subprocess.TimeoutExpired:
        return dict(row, timed_out=True, error=f"timed out after {args.row_timeout} s")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit status {proc.returncode}"
        return dict(row, error=tail[:300])
    return dict(row, **json.loads(lines[-1]))


def _child_main(args) -> None:
    """Print the row as one JSON line; a path that fails prints its error's first line instead."""
    import traceback

    try:
        row = child(args)
    except Exception as exc:  # torch's paths may refuse the FP8 modules: the row says how
        traceback.print_exc()
        row = {"error": describe_error(exc)}
    print(json.dumps(row), flush=True)


def describe_error(exc: BaseException) -> str:
    """``exc``'s type and first line, and where it wraps another (torch's ``BackendCompilerFailed``
    says only "backend='inductor' raised:", holding the error as ``inner_exception``), the
    innermost one's type and first line too."""
    def first_line(e: BaseException) -> str:
        return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"

    cause = exc
    while (getattr(cause, "inner_exception", None) or cause.__cause__) not in (None, cause):
        cause = getattr(cause, "inner_exception", None) or cause.__cause__
    text = first_line(exc) if cause is exc else f"{first_line(exc)} {first_line(cause)}"
    return text[:300]


def fitted_exponent(points) -> float | None:
    """The slope of ``log(seconds)`` against ``log(blocks)`` by least squares; None under 2 depths."""
    if len({b for b, _ in points}) < 2:
        return None
    xs, ys = [math.log(b) for b, _ in points], [math.log(s) for _, s in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def _series(rows) -> dict:
    """``(recipe, path, feed-forward label) -> [(blocks, first step s)]`` of the rows that measured one."""
    series = {}
    for row in rows:
        key = (row["recipe"], row["path"], ffn_label(row))
        series.setdefault(key, [])
        if "first_step_s" in row:
            series[key].append((row["blocks"], row["first_step_s"]))
    return series


def _cell(row, key, scale=1.0, digits=1) -> str:
    return f"{row[key] * scale:.{digits}f}" if key in row else ""


def table(rows) -> str:
    lines = ["| recipe | ffn | path | blocks | first step s | trace s | partition s | compile s | first call s | of which Inductor s "
             "| Inductor compiles (generated) | steady step ms | peak GiB | failed or timed out |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    order = {path: i for i, path in enumerate(PATHS)}
    for row in sorted(rows, key=lambda r: (r["recipe"], ffn_label(r), order.get(r["path"], 99), r["blocks"])):
        compiles = f"{row['inductor_compiles']} ({row['inductor_generated']})" if "inductor_compiles" in row else ""
        compiles += f", {row['steady_inductor_compiles']} more in steady steps" if row.get("steady_inductor_compiles") else ""
        lines.append(f"| {row['recipe']} | {ffn_label(row)} | {row['path']} | {row['blocks']} | {_cell(row, 'first_step_s')} | {_cell(row, 'trace_s')} "
                     f"| {_cell(row, 'partition_s')} | {_cell(row, 'compile_s')} | {_cell(row, 'first_call_s')} | {_cell(row, 'inductor_s')} "
                     f"| {compiles} | {_cell(row, 'step_s', 1e3)} | {_cell(row, 'peak_gib', digits=2)} | {row.get('error', '')} |")
    exponents = []
    for (recipe, path, ffn), points in _series(rows).items():
        k = fitted_exponent(points)
        if k is not None:
            exponents.append(f"{path} ({recipe}, {ffn}) {k:.2f}")
    return "\n".join(lines) + ("\n\nFitted exponent of first step against blocks: " + "; ".join(exponents) if exponents else "")


COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")


def plot_svg(rows, title: str) -> str:
    """First-step seconds against blocks, both axes logarithmic, a line per (recipe, path,
    feed-forward) with its fitted exponent in the legend; rows without a first step (failed, timed
    out) are left out, and the legend names their depths. The legend is as wide as its longest
    label needs (an experts series names its experts)."""
    series = {key: sorted(points) for key, points in _series(rows).items() if points}
    labels = {}
    for recipe, path, ffn in series:
        k = fitted_exponent(series[(recipe, path, ffn)])
        label = f"{path} ({recipe}, {ffn})" + (f": exponent {k:.2f}" if k is not None else "")
        for outcome, lost in (("timed out", True), ("failed", False)):
            depths = sorted(r["blocks"] for r in rows if (r["recipe"], r["path"], ffn_label(r)) == (recipe, path, ffn)
                            and "first_step_s" not in r and bool(r.get("timed_out")) == lost)
            label += f"; {outcome} at {', '.join(map(str, depths))}" if depths else ""
        labels[(recipe, path, ffn)] = label
    # About 7 px a character at 12 px sans-serif, after the legend's line and gap.
    right = max([500] + [50 + 7 * len(label) for label in labels.values()])
    width, height, left, top, bottom = 480 + right, 460, 70, 40, 50
    if not series:
        return f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}"><text x="20" y="30">no first step measured</text></svg>\n'
    blocks = [b for points in series.values() for b, _ in points]
    seconds = [s for points in series.values() for _, s in points]
    x0, x1 = math.log2(min(blocks)), math.log2(max(blocks)) if max(blocks) > min(blocks) else math.log2(min(blocks)) + 1
    y0, y1 = math.floor(math.log10(min(seconds))), math.ceil(math.log10(max(seconds)))
    y1 += y1 == y0

    def px(b):
        return left + (math.log2(b) - x0) / (x1 - x0) * (width - left - right)

    def py(s):
        return height - bottom - (math.log10(s) - y0) / (y1 - y0) * (height - top - bottom)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="22" font-size="14">{title}</text>',
           f'<text x="{(left + width - right) / 2}" y="{height - 12}" text-anchor="middle">blocks (log scale)</text>',
           f'<text x="16" y="{(top + height - bottom) / 2}" transform="rotate(-90 16 {(top + height - bottom) / 2})" '
           'text-anchor="middle">first step, s (log scale)</text>']
    for b in sorted(set(blocks)):
        out.append(f'<line x1="{px(b):.1f}" y1="{top}" x2="{px(b):.1f}" y2="{height - bottom}" stroke="#ddd"/>'
                   f'<text x="{px(b):.1f}" y="{height - bottom + 16}" text-anchor="middle">{b}</text>')
    for e in range(y0, y1 + 1):
        out.append(f'<line x1="{left}" y1="{py(10 ** e):.1f}" x2="{width - right}" y2="{py(10 ** e):.1f}" stroke="#ddd"/>'
                   f'<text x="{left - 6}" y="{py(10 ** e) + 4:.1f}" text-anchor="end">{10 ** e:g}</text>')
    for i, (key, points) in enumerate(sorted(series.items())):
        colour = COLOURS[i % len(COLOURS)]
        coords = " ".join(f"{px(b):.1f},{py(s):.1f}" for b, s in points)
        out.append(f'<polyline points="{coords}" fill="none" stroke="{colour}" stroke-width="2"/>')
        out += [f'<circle cx="{px(b):.1f}" cy="{py(s):.1f}" r="3.5" fill="{colour}"/>' for b, s in points]
        label = labels[key]
        y = top + 10 + 20 * i
        out.append(f'<line x1="{width - right + 12}" y1="{y}" x2="{width - right + 32}" y2="{y}" stroke="{colour}" stroke-width="2"/>'
                   f'<text x="{width - right + 38}" y="{y + 4}">{label}</text>')
    return "\n".join(out + ["</svg>"]) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="cuda when available, else cpu; with --from-jsonl, the device whose rows "
                        "are drawn (the plot of cpu rows is bench_depth.svg, of another device's bench_depth-DEVICE.svg)")
    parser.add_argument("--blocks", type=int, nargs="+", default=[2, 8, 32, 64])
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--recipes", nargs="+", default=["tensorwise", "rowwise"])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--ffn", choices=FFNS, default="dense", help="the blocks' feed-forward: dense SwiGLU, or a mixture of "
                        "experts on fp8conf's FP8 grouped experts (recipe rowwise only); with --from-jsonl, the rows drawn "
                        "(a row without ffn is dense)")
    parser.add_argument("--experts", type=int, default=4, help="with --ffn experts: experts per block")
    parser.add_argument("--top-k", type=int, default=2, help="with --ffn experts: experts each token is routed to")
    parser.add_argument("--iters", type=int, default=10, help="steps timed after the first (the steady step is their median)")
    parser.add_argument("--row-timeout", type=int, default=600, help="seconds a row may take, its own process")
    results.jsonl_arguments(parser)
    parser.add_argument("--write", action="store_true", help="append the table to benchmarks/RESULTS.md")
    parser.add_argument("--child", metavar="PATH", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.child:
        args.path, args.recipe, args.blocks = args.child, args.recipes[0], args.blocks[0]
        return _child_main(args)
    jsonl = Path(args.jsonl or (args.from_jsonl[0] if args.from_jsonl else JSONL if args.ffn == "dense" else EXPERTS_JSONL))
    if args.from_jsonl:
        # One device's rows of one feed-forward: a CPU row and a GPU row of one path are other models on
        # other machines, and a dense row and an experts row other models.
        rows = select_rows(results.read_jsonl(args.from_jsonl), args.device, args.ffn)
    else:
        import torch
        import torchao

        machine = torch.cuda.get_device_name() if args.device == "cuda" else f"{os.cpu_count()}-core CPU"
        environment = f"{machine}, torch {torch.__version__}, torchao {torchao.__version__}"
        rows = []
        for recipe in args.recipes:
            for blocks in args.blocks:
                for path in args.paths:
                    # host: which machine, so that only rows of one machine are compared (two hosts of one
                    # GPU model differ by 1.4x in first step).
                    row = dict(measure(args, path, recipe, blocks), environment=environment, host=socket.gethostname(),
                               date=time.strftime("%Y-%m-%d"))
                    rows.append(row)
                    results.append_jsonl(str(jsonl), row)
                    print(f"{recipe} {args.ffn} {blocks:3d} blocks {path:40s} {row.get('first_step_s', float('nan')):7.1f} s {row.get('error', '')}", flush=True)
    first = rows[0] if rows else {}
    feed_forward = f", feed-forward {ffn_label(first)}" if first and row_ffn(first) != "dense" else ""
    conditions = (f"{first.get('environment', '')}; Llama dim {first.get('dim')}, {first.get('heads')} heads, vocab {first.get('vocab')}, "
                  f"{first.get('tokens')} tokens{feed_forward}; each row a fresh process with an empty Inductor cache; {first.get('date', '')}")
    text = table(rows)
    print(conditions + "\n\n" + text)
    if not rows:
        print(f"no rows of device {args.device} and feed-forward {args.ffn}: no plot written")
        return
    # Each device's plot, and each feed-forward's, apart: bench_depth.svg, bench_depth-cuda.svg,
    # bench_depth-experts.svg and bench_depth-experts-cuda.svg, whichever JSONL the rows came from.
    stem = jsonl.stem.removesuffix("-experts") + ("" if args.ffn == "dense" else f"-{args.ffn}")
    svg = jsonl.with_name(f"{stem}.svg" if args.device == "cpu" else f"{stem}-{args.device}.svg")
    svg.write_text(plot_svg(rows, f"First step against depth: {first.get('environment', '')}"))
    print(f"plot: {svg}")
    if args.write:
        heading = "bench_depth: first step against depth, fp8conf beside torch's paths"
        results.append(heading if args.ffn == "dense" else f"{heading}, grouped experts", conditions, text)


if __name__ == "__main__":
    main()
