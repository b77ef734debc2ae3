"""Where the seconds of a regional cold start go, pass by pass, as the model gets deeper.

Builds the Llama-shaped model of ``benchmarks/llama.py`` at each ``--blocks`` depth, then traces
it (``fp8conf.trace_joint``) and compiles it (``fp8conf.compile_joint(mode="regional")``) with a
timer around each pass, in a fresh process per depth. Passes that are torch's own (AOT export,
the min-cut partitioner, ``fuse_by_partitions``, Inductor) are told apart from fp8conf's
(provenance, joint signature, flat copy, region identification and tagging, structural keys,
and whatever else compile_joint does: "fp8conf other"). A pass that grows faster than the
node count shows in the last column, seconds per 1000 nodes. The first step is not run unless
``--step`` asks for it (trace + compile + one step, the first step a user waits for): on a CPU at
the default shapes it times the FP8 matmul emulation more than the cold start.

``--tracing`` picks how the model is traced: ``layers`` names the container of equal blocks
(``trace_joint(repeat="layers")``), ``default`` passes no flag (equal blocks found and proven by
trace_joint itself), ``whole`` traces every block (``repeat=False``).

    python benchmarks/bench_coldstart.py --device cpu --dim 64 --heads 4 --vocab 256 --tokens 256 --blocks 2 8 16 --clock cpu
    python benchmarks/bench_coldstart.py --device cpu --dim 64 --heads 4 --vocab 256 --tokens 256 --blocks 8 32 64 --tracing default --step
    python benchmarks/bench_coldstart.py --blocks 2 8 32            # on a GPU (sm89+)
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import results  # benchmarks/results.py, beside this script

ROOT = Path(__file__).resolve().parent.parent

#: (label, module, attribute, owner): the functions timed, patched where their callers look them up.
PASSES = (
    ("aot export", "torch._functorch.aot_autograd", "aot_export_joint_with_descriptors", "torch"),
    ("provenance", "fp8conf.graph.trace", "propagate_provenance", "fp8conf"),
    ("joint signature", "fp8conf.graph.trace.JointSignature", "of_traced", "fp8conf"),
    ("flat copy", "fp8conf.compile.plan", "flat_graph_module", "fp8conf"),
    ("min-cut partition", "torch._functorch.partitioners", "min_cut_rematerialization_partition", "torch"),
    ("regions", "fp8conf.graph.regions", "identify_fp8_regions", "fp8conf"),
    ("fuse_by_partitions", "torch.fx.passes.utils.fuser_utils", "fuse_by_partitions", "torch"),
    ("structural keys", "fp8conf.compile.region_compile", "structural_key", "fp8conf"),
    ("Inductor", "fp8conf.compile.region_compile", "compile_unit", "torch"),
)


def _resolve(dotted: str):
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


#: The clock passes are timed with: wall time, or (``--clock cpu``) this process's CPU time, which
#: a machine shared with other work does not inflate (compiler subprocesses are not counted).
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter


@contextlib.contextmanager
def timers(seconds: dict):
    """Time every function of :data:`PASSES`; a pass called inside another (identification inside
    partitioning) is charged to itself only."""
    stack: list[list] = []
    patched = []

    def wrap(label, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            frame = [0.0]
            stack.append(frame)
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = clock() - start
                stack.pop()
                seconds[label] += spent - frame[0]
                if stack:
                    stack[-1][0] += spent

        return timed

    for label, owner_path, attribute, _ in PASSES:
        owner = _resolve(owner_path)
        original = owner.__dict__[attribute]
        fn = original.__func__ if isinstance(original, classmethod) else original
        timed = wrap(label, fn)
        setattr(owner, attribute, classmethod(timed) if isinstance(original, classmethod) else timed)
        patched.append((owner, attribute, original))
    try:
        yield
    finally:
        for owner, attribute, original in patched:
            setattr(owner, attribute, original)


def child(args) -> None:
    """One depth, in this process: prints one JSON line."""
    import warnings

    global clock
    clock = CLOCKS[args.clock]
    warnings.simplefilter("ignore")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch

    import fp8conf
    from imports import import_compile_stack
    from llama import build_llama

    import_compile_stack(args.device)  # module loading is no pass of the cold start
    model = build_llama(args.dim, args.blocks[0], args.recipe, device=args.device, heads=args.heads, vocab=args.vocab)
    x = torch.randint(0, args.vocab, (1, args.tokens), device=args.device)
    seconds = collections.defaultdict(float)
    collector = {"s": 0.0}

    def timed_collection(phase, info):  # the collector's pauses, wherever they fall
        if phase == "start":
            collector["start"] = clock()
        else:
            collector["s"] += clock() - collector["start"]

    import gc

    gc.callbacks.append(timed_collection)
    with timers(seconds):
        start = clock()
        gm = fp8conf.trace_joint(model, (x,), **TRACING_ARGUMENTS[args.tracing])
        traced = clock()
        compiled = fp8conf.compile_joint(gm, mode="regional")
        done = clock()
    row = {"blocks": args.blocks[0], "nodes": len(gm.graph.nodes), "trace_s": traced - start, "compile_s": done - traced,
           "inductor_compiles": compiled.inductor_compiles, "complete_regions": sum(r.complete for r in compiled.regions), **seconds}
    if args.step:
        tangent = next(n for n in gm.graph.find_nodes(op="placeholder") if n.name.startswith("tangents")).meta["val"]
        grad = torch.randn(tangent.shape, dtype=tangent.dtype, device=args.device)
        start = clock()
        fp8conf.run_joint(gm, model, (x,), (grad,), fn=compiled)
        if args.device == "cuda":
            torch.cuda.synchronize()
        row["step_s"] = clock() - start
    row["fp8conf other"] = row["trace_s"] + row["compile_s"] - sum(seconds.values())
    row["garbage collection"] = collector["s"]
    print(json.dumps(row))


def measure(args, blocks: int) -> dict:
    command = [sys.executable, __file__, "--child", "--blocks", str(blocks), "--device", args.device, "--dim", str(args.dim),
               "--tokens", str(args.tokens), "--heads", str(args.heads), "--vocab", str(args.vocab), "--recipe", args.recipe, "--clock", args.clock, "--tracing", args.tracing] + (["--step"] if args.step else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="bench-coldstart-"))
    try:
        proc = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"blocks": blocks, "error": f"timed out after {args.timeout} s"}
    if proc.returncode != 0:
        return {"blocks": blocks, "error": proc.stderr.strip().splitlines()[-1][:300] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(rows) -> str:
    labels = [label for label, *_ in PASSES] + ["fp8conf other"]
    owners = {label: owner for label, _, _, owner in PASSES} | {"fp8conf other": "fp8conf"}
    ok = [r for r in rows if "error" not in r]
    lines = ["| pass (owner) | " + " | ".join(f"{r['blocks']} blocks ({r['nodes']} nodes) s" for r in ok) + " | s per 1000 nodes |",
             "|---|" + "---:|" * (len(ok) + 1)]
    for label in labels:
        per_k = " / ".join(f"{1e3 * r.get(label, 0.0) / r['nodes']:.2f}" for r in ok)
        lines.append(f"| {label} ({owners[label]}) | " + " | ".join(f"{r.get(label, 0.0):.2f}" for r in ok) + f" | {per_k} |")
    for owner in ("torch", "fp8conf"):
        total = [sum(r.get(label, 0.0) for label in labels if owners[label] == owner) for r in ok]
        per_k = " / ".join(f"{1e3 * t / r['nodes']:.2f}" for t, r in zip(total, ok))
        lines.append(f"| **all {owner}** | " + " | ".join(f"{t:.2f}" for t in total) + f" | {per_k} |")
    lines.append("| trace + compile | " + " | ".join(f"{r['trace_s'] + r['compile_s']:.2f}" for r in ok) + " | |")
    if ok and "step_s" in ok[0]:
        lines.append("| one step | " + " | ".join(f"{r['step_s']:.2f}" for r in ok) + " | |")
        lines.append("| **first step** (trace + compile + step) | " + " | ".join(f"{r['trace_s'] + r['compile_s'] + r['step_s']:.2f}" for r in ok) + " | |")
    lines.append("| of which Python's garbage collector | " + " | ".join(f"{r.get('garbage collection', float('nan')):.2f}" for r in ok) + " | |")
    lines.append("| regions / Inductor compiles | " + " | ".join(f"{r['complete_regions']} / {r['inductor_compiles']}" for r in ok) + " | |")
    lines += [f"- {r['blocks']} blocks: {r['error']}" for r in rows if "error" in r]
    return "\n".join(lines)


TRACING = {"layers": 'four blocks traced, the rest repeated (trace_joint(repeat="layers"))',
           "default": "trace_joint with no flag (its own choice)", "whole": "every block traced (trace_joint(repeat=False))"}
#: trace_joint's keywords for each --tracing.
TRACING_ARGUMENTS = {"layers": {"repeat": "layers"}, "default": {}, "whole": {"repeat": False}}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="cuda when available, else cpu")
    parser.add_argument("--blocks", type=int, nargs="+", default=[2, 8, 16])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--recipe", default="tensorwise")
    parser.add_argument("--tracing", choices=list(TRACING), default="layers", help="how trace_joint is called (see above)")
    parser.add_argument("--whole-trace", dest="tracing", action="store_const", const="whole", help="--tracing whole")
    parser.add_argument("--step", action="store_true", help="run one step after compiling, and show the first step")
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall", help="cpu: this process's CPU time, for a busy machine")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per depth")
    parser.add_argument("--write", action="store_true", help="append the table to benchmarks/RESULTS.md")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.child:
        return child(args)
    rows = []
    for blocks in args.blocks:
        rows.append(measure(args, blocks))
        print(json.dumps(rows[-1]), flush=True)
    import torch
    import torchao

    device = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({os.cpu_count()} cores)"
    conditions = (f"{device}; torch {torch.__version__}, torchao {torchao.__version__}; Llama dim {args.dim}, {args.heads} heads, "
                  f"vocab {args.vocab}, {args.tokens} tokens, {args.recipe}; {args.clock} seconds; one process per depth; "
                  f"{TRACING[args.tracing]}; trace + regional compile, "
                  f"{'one step' if args.step else 'no step'}; Inductor's cache as the environment leaves it (TORCHINDUCTOR_CACHE_DIR, else an empty one per depth).")
    text = table(rows)
    print(conditions + "\n\n" + text)
    if args.write:
        results.append("bench_coldstart: regional cold start pass by pass", conditions, text)


if __name__ == "__main__":
    main()
