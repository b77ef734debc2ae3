"""Host time per step of fp8conf's regional compile: compiled regions and pieces called through
their ``CompiledArtifact`` (every AOTAutograd and Inductor wrapper layer) versus directly through
Inductor's generated code where that is safe (:mod:`fp8conf.compile.fast_call`).

Both variants are compiled from one traced joint graph of the Llama-shaped model
(``benchmarks/llama.py``), the second from the Inductor cache the first filled, and must give
equal results (checked). Columns, per training step (forward + backward):

- ``call sites``: calls of compiled regions and pieces; ``fast``: how many skip the wrappers;
- ``outer nodes``: nodes of the outer flat graphs run by their Python code (calls, getitems, eager ops);
- ``wall us``: median wall time of a step (on CUDA without synchronizing inside the timed steps,
  so with few tokens it is the host's time: the GPU waits for the host);
- ``python us``: time spent in Python functions themselves (cProfile's own time of every
  function not written in C, kernels and ATen ops excluded), inflated by the profiler alike in
  both variants: on CPU, where the kernels' time swamps the wall time, this is the host figure;
- ``per call us``: one compiled piece called through its artifact versus through its fast entry.

    python benchmarks/bench_host.py                       # CPU, dim 64, 2 blocks, 16 tokens
    python benchmarks/bench_host.py --device cuda --dim 256 --layers 6 --tokens 2048
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch
import torch.utils._pytree as pytree

import fp8conf

from llama import build_llama  # benchmarks/llama.py, beside this script


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _call_sites(compiled):
    graphs = compiled.artifact if isinstance(compiled.artifact, tuple) else (compiled.artifact,)
    nodes = [n for g in graphs for n in g.graph.nodes if n.op in ("call_function", "call_module")]
    sites = [n for n in nodes if n.op == "call_function" and hasattr(n.target, "__wrapped__")]
    fast = sum(1 for n in sites if n.target.fast is not None)
    return sites, fast, len(nodes)


def _wall_us(step, device, steps, repeats) -> float:
    rounds = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            step()
        _sync(device)
        rounds.append((time.perf_counter() - start) / steps * 1e6)
    return statistics.median(rounds)


def _python_us(step, steps, top=0, label="") -> float:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    if top:
        print(f"-- {label}: the {top} functions of most own time, {steps} steps")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(top)
    stats = pstats.Stats(profiler).stats
    # Entries of C functions have the file name "~"; everything else is Python code's own time.
    own = sum(tottime for (filename, _, _), (_, _, tottime, _, _) in stats.items() if filename != "~")
    return own / steps * 1e6


def _per_call_us(site, args, calls=2000) -> tuple[float, float]:
    """One call site timed through its artifact and through its fast entry (if any)."""
    artifact, fast = site.target.__wrapped__, site.target.fast
    out = []
    for fn in (artifact, fast):
        if fn is None:
            out.append(float("nan"))
            continue
        fn(*args)
        start = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        out.append((time.perf_counter() - start) / calls * 1e6)
    return out[0], out[1]


def _piece_site_args(compiled, device):
    """A remainder piece's call site (one with a fast entry) and inputs shaped as it was compiled
    for: the wrappers' cost does not depend on the values."""
    sites, _, _ = _call_sites(compiled)
    # One of the forward's: a backward call site takes its inputs packed in one list.
    site = next((n for n in sites if n.target.fast is not None and all("val" in i.meta for i in n.all_input_nodes)), sites[0])
    args = []
    for node in site.all_input_nodes:
        val = node.meta["val"]
        tensor = torch.zeros(tuple(val.shape), dtype=val.dtype, device=device)  # zeros: valid indices too
        args.append(tensor.as_strided(tuple(val.shape), tuple(val.stride())) if val.is_contiguous() else
                    torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype, device=device).zero_())
    return site, args


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--recipe", default="tensorwise")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile-top", type=int, default=0, help="print the N functions of most own time per variant")
    args = parser.parse_args()

    vocab = 256 if args.dim < 256 else 2048
    model = build_llama(args.dim, args.layers, args.recipe, device=args.device, heads=args.heads, vocab=vocab)
    x = torch.randint(0, vocab, (1, args.tokens), device=args.device)
    grad = torch.randn(1, args.tokens, vocab, device=args.device, dtype=torch.bfloat16)
    gm = fp8conf.trace_joint(model, (x,))
    primals, tangents = fp8conf.joint_signature(gm).feed(model, (x,), (grad,))

    rows, results = [], []
    for label, fast in (("artifact calls", False), ("fast calls", True)):
        compiled = fp8conf.compile_joint(gm, fp8conf.CompileConfig(mode="regional", fast_calls=fast))
        step = lambda: compiled(primals, tangents)  # noqa: E731
        results.append([t.clone() for t in pytree.tree_leaves(step()) if isinstance(t, torch.Tensor)])
        step()
        _sync(args.device)
        sites, fast_sites, outer = _call_sites(compiled)
        site, site_args = _piece_site_args(compiled, args.device)
        rows.append((label, len(sites), fast_sites, outer, _wall_us(step, args.device, args.steps, args.repeats),
                     _python_us(step, args.steps, args.profile_top, label), *_per_call_us(site, site_args)))
    equal = all(torch.equal(a, b) for a, b in zip(*results, strict=True))

    print(f"regional host time, llama dim {args.dim} x {args.layers}, {args.tokens} tokens, {args.recipe}, {args.device}; results equal: {equal}")
    header = ("variant", "call sites", "fast", "outer nodes", "wall us", "python us", "per call us (artifact)", "per call us (fast)")
    print(" | ".join(header))
    for label, n_sites, n_fast, outer, wall, python, via_artifact, via_fast in rows:
        print(f"{label} | {n_sites} | {n_fast} | {outer} | {wall:.0f} | {python:.0f} | {via_artifact:.1f} | {via_fast:.1f}")
    if not equal:
        raise SystemExit("the fast calls changed the results")


if __name__ == "__main__":
    main()
