"""Cold start of a regionally compiled FP8 training step: compiled on the spot vs loaded from an artifact.

Every measurement is a fresh Python process (what a trainer's restart is). "compile" traces the
step and compiles it with ``fp8conf.compile_joint(mode="regional")``; "artifact" loads a
regional artifact saved beforehand (``fp8conf.precompile_joint(gm, mode="regional")``, signed
with a key made for the run) and compiles nothing. Both then run the first step. Each is timed
with an empty Inductor cache (a new machine) and with a warm one (the same machine again);
the table gives the median over ``--repeats`` processes of the seconds from the model built to
the first step's gradients, and of the whole process, and the ratio artifact / compile for the
same cache state, measured side by side in one run.

    python benchmarks/bench_precompile.py --write                       # on a GPU (sm89+)
    python benchmarks/bench_precompile.py --device cpu --dim 64 --blocks 2 --tokens 256
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import results  # benchmarks/results.py, beside this script

ROOT = Path(__file__).resolve().parent.parent


def _setup(args):
    import torch

    from fp8conf.tools.example_models import build_stack

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build_stack(args.dim, args.blocks, args.recipe, head=False, device=args.device, dtype=dtype)
    generator = torch.Generator(device=args.device).manual_seed(1)
    x = torch.randn(args.tokens, args.dim, device=args.device, dtype=dtype, generator=generator)
    grad = torch.ones(args.tokens, args.dim, device=args.device, dtype=dtype)
    return model, (x,), (grad,)


def _sync(device):
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def child(args) -> None:
    """One measurement, in this process: prints one JSON line."""
    import warnings

    warnings.simplefilter("ignore")
    import fp8conf
    from imports import import_compile_stack

    import_compile_stack(args.device)  # what every variant loads, outside the timed first step
    model, inputs, grads = _setup(args)
    start = time.perf_counter()
    if args.child == "save":
        gm = fp8conf.trace_joint(model, inputs)
        fp8conf.save_artifact(args.artifact, fp8conf.precompile_joint(gm, mode="regional"), fp8conf.QuantizationSignature.from_model(model))
    elif args.child == "compile":
        gm = fp8conf.trace_joint(model, inputs)
        compiled = fp8conf.compile_joint(gm, mode="regional")
        fp8conf.run_joint(gm, model, inputs, grads, fn=compiled)
    else:
        fp8conf.load_for_model(args.artifact, model, inputs).run(model, inputs, grads)
    _sync(args.device)
    print(json.dumps({"first_step_s": time.perf_counter() - start}))


def _spawn(args, what: str, cache_dir: str, artifact: str, env: dict) -> dict:
    command = [sys.executable, __file__, "--child", what, "--artifact", artifact, "--device", args.device,
               "--dim", str(args.dim), "--blocks", str(args.blocks), "--tokens", str(args.tokens), "--recipe", args.recipe]
    start = time.perf_counter()
    proc = subprocess.run(command, env=dict(env, TORCHINDUCTOR_CACHE_DIR=cache_dir), capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"bench_precompile: the {what} process failed:\n{proc.stderr[-4000:]}")
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    row["process_s"] = time.perf_counter() - start
    return row


def measure(args) -> list[dict]:
    from fp8conf.artifacts.format import read_header
    from fp8conf.artifacts.keys import generate_key_file

    scratch = tempfile.mkdtemp(prefix="fp8conf-bench-precompile-")
    generate_key_file(f"{scratch}/key")
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path, FP8CONF_ARTIFACT_KEY_FILE=f"{scratch}/key")
    env.pop("FP8CONF_ARTIFACT_KEY", None)
    artifact = f"{scratch}/step.fp8"
    _spawn(args, "save", f"{scratch}/cache-save", artifact, env)
    warm = {what: f"{scratch}/cache-warm-{what}" for what in ("compile", "artifact")}
    if "warm" in args.caches:
        for what, cache in warm.items():  # fill each warm cache once, the way the same machine would
            _spawn(args, what, cache, artifact, env)
    samples: dict[tuple[str, str], list[dict]] = {}
    for i in range(args.repeats):
        for what in ("compile", "artifact"):  # interleaved, so that drift hits both alike
            if "empty" in args.caches:
                samples.setdefault((what, "empty"), []).append(_spawn(args, what, f"{scratch}/cache-{what}-{i}", artifact, env))
            if "warm" in args.caches:
                samples.setdefault((what, "warm"), []).append(_spawn(args, what, warm[what], artifact, env))
    rows = []
    for (what, cache), runs in samples.items():
        rows.append({
            "variant": "regional compile" if what == "compile" else "regional artifact",
            "cache": cache,
            "first_step_s": statistics.median(r["first_step_s"] for r in runs),
            "process_s": statistics.median(r["process_s"] for r in runs),
            "artifact_bytes": os.path.getsize(artifact),
            "compiled_pieces": len(read_header(artifact).pieces),
        })
    return rows


def table(rows: list[dict]) -> str:
    compile_s = {r["cache"]: r["first_step_s"] for r in rows if r["variant"] == "regional compile"}
    lines = ["| Inductor cache | variant | first step s (median) | process s (median) | first step vs compile |", "|---|---|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["cache"], r["variant"] != "regional compile")):
        ratio = r["first_step_s"] / compile_s[r["cache"]]
        lines.append(f"| {r['cache']} | {r['variant']} | {r['first_step_s']:.2f} | {r['process_s']:.2f} | {ratio:.2f}x |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="cuda when available, else cpu")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--recipe", default="tensorwise")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--caches", nargs="+", choices=("empty", "warm"), default=["empty", "warm"], help="Inductor cache states to measure")
    parser.add_argument("--write", action="store_true", help="append the table to benchmarks/RESULTS.md")
    parser.add_argument("--child", choices=("save", "compile", "artifact"), help=argparse.SUPPRESS)
    parser.add_argument("--artifact", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.child:
        return child(args)
    import torch
    import torchao

    rows = measure(args)
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({os.cpu_count()} cores)"
    conditions = (
        f"{device}; torch {torch.__version__}, torchao {torchao.__version__}; BlockStack dim {args.dim} x {args.blocks} blocks, "
        f"{args.recipe}, {args.tokens} tokens; each a fresh process, median of {args.repeats}; first step = from the model built "
        f"to the first step's gradients (trace + regional compile + step, or load + step), the compile stack imported before it "
        f"(benchmarks/imports.py); process = the whole process, imports included; artifact {rows[0]['artifact_bytes']} bytes, "
        f"{rows[0]['compiled_pieces']} compiled pieces stored."
    )
    text = table(rows)
    print(conditions + "\n\n" + text)
    if args.write:
        results.append("bench_precompile: regional artifact vs regional compile at cold start", conditions, text)


if __name__ == "__main__":
    main()
