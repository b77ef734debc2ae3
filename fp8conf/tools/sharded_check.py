"""A self-checking data-parallel FP8 step over ``torch.distributed``: ``python -m fp8conf.tools.sharded_check``.

Runs a stack of FP8 blocks (:mod:`fp8conf.tools.example_models`, tensorwise by default) sharded by
:func:`fp8conf.parallel.shard_data_parallel` in ``ranks`` processes (gloo on CPU), with float8
all-gather on or off, and checks on every rank:

- the traced step (``fp8conf.trace_joint`` of the sharded model, its all-gathers and
  reduce-scatters in the graph) passes :func:`fp8conf.validate_fp8_graph` and
  :func:`fp8conf.graph.all_gathers.validate_weight_all_gathers`, and running it with
  :func:`fp8conf.run_joint` over the real process group gives the gradients the eager sharded step
  gives, bitwise;
- with every rank given the **whole** batch, each rank's gradient shard equals the unsharded
  step's gradient rows bitwise (the weight's scale is all-reduced, so its FP8 bytes are those of
  the unsharded cast);
- with the batch **split** over the ranks, each shard is within the recipe's tolerance of the
  unsharded step's: activations and output gradients are then cast with each rank's own amax,
  so FP8 rounding differs from the unsharded step's (relative norm of the difference).

With ``--compile regional`` the traced step is also compiled (:func:`fp8conf.compile_joint`; no
FP8 region holds a collective, while the compiled units around the regions take them in, as
Inductor lowers functional collectives) and run over the real process group; its gradients must
match the traced step's within 1e-4 (Inductor rounds float32 its own way). ``full`` cannot compile a sharded step yet
(the shards' ``device_mesh`` placeholders carry no example value).

It reports the bytes all-gathered per step (from the collectives' records in the traced graph)
and the median step times, eager and traced. Exit status 1 when a check fails, 2 when the step
cannot run: a usage mistake, or a rank that failed, said in one line (fp8conf's own error as
itself, a process group that did not start as :class:`~fp8conf.errors.ProcessGroupStartError`
naming what to change on the machine; :mod:`fp8conf.tools.ranks`).

::

    python -m fp8conf.tools.sharded_check                       # float8 all-gather on and off
    python -m fp8conf.tools.sharded_check --float8-all-gather off --dim 128 --blocks 4
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time

import torch

from fp8conf.errors import FP8ConfigError, FP8Error
from fp8conf.tools import ranks as rank_processes

__all__ = ["ShardedCheck", "SPLIT_BATCH_TOLERANCE", "launch", "main"]

#: Relative norm of (sharded - unsharded) gradients allowed with the batch split over ranks, per
#: recipe: per-rank amax changes the FP8 rounding of activations and output gradients.
SPLIT_BATCH_TOLERANCE = {"tensorwise": 0.1, "rowwise": 0.1, "rowwise_with_gw_hp": 0.1}


@dataclasses.dataclass
class ShardedCheck:
    """One sharded step per rank compared with the unsharded step."""

    ranks: int
    recipe: str
    float8_all_gather: bool
    parameters: int
    validated: bool
    traced_equals_eager: bool
    same_batch_bitwise: bool
    split_batch_error: float
    tolerance: float
    all_gather_bytes: int
    all_gather_bytes_float8: int
    reduce_scatter_bytes: int
    eager_step_s: float
    traced_step_s: float
    compile: str | None = None
    backend: str = "gloo"
    compiled_max_abs_diff: float | None = None
    compiled_step_s: float | None = None

    @property
    def ok(self) -> bool:
        compiled = self.compile is None or (self.compiled_max_abs_diff is not None and self.compiled_max_abs_diff <= 1e-4)
        return self.validated and self.traced_equals_eager and self.same_batch_bitwise and self.split_batch_error <= self.tolerance and compiled

    def summary(self) -> str:
        return (
            f"data-parallel FP8 step over {self.backend}: {self.ranks} ranks, recipe {self.recipe}, float8 all-gather "
            f"{'on' if self.float8_all_gather else 'off'}, {self.parameters} sharded parameters; validation "
            f"{'passed' if self.validated else 'FAILED'}; traced step {'bitwise equal to' if self.traced_equals_eager else 'DIFFERS from'} "
            f"the eager sharded step; whole batch per rank: gradients {'bitwise equal to' if self.same_batch_bitwise else 'DIFFER from'} "
            f"the unsharded step; batch split: relative error {self.split_batch_error:.3g} (tolerance {self.tolerance}); "
            f"all-gathered per step and rank: {self.all_gather_bytes} bytes ({self.all_gather_bytes_float8} as FP8), "
            f"reduce-scattered: {self.reduce_scatter_bytes} bytes; step: eager {self.eager_step_s * 1e3:.2f} ms, "
            f"traced {self.traced_step_s * 1e3:.2f} ms"
            + ("" if self.compile is None else
               f", {self.compile} compiled {self.compiled_step_s * 1e3:.2f} ms (max abs diff from the traced step {self.compiled_max_abs_diff:.3g})")
        )


class _StepWithLoss(torch.nn.Module):
    """The model and its loss as one module, so that the traced step ends in the loss."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, target):
        return torch.nn.functional.mse_loss(self.model(x), target)


def _build(options, float8_all_gather: bool) -> _StepWithLoss:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from fp8conf.tools.example_models import build_stack

    model = build_stack(options["dim"], options["blocks"], recipe=None, seed=0)
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(options["recipe"]), enable_fsdp_float8_all_gather=float8_all_gather)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, fqn: fqn != "head")
    return _StepWithLoss(model)


def _data(options, device="cpu"):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(options["tokens"], options["dim"], generator=generator)
    return x.to(device), torch.randn(options["tokens"], options["dim"], generator=generator).to(device)


def _eager_grads(step, x, target) -> dict[str, torch.Tensor]:
    for p in step.parameters():
        p.grad = None
    step(x, target).backward()
    return {fqn: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).detach().clone() for fqn, p in step.named_parameters()}


def _timed(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return result, statistics.median(times)


def _worker(rank, ranks, init_file, options, result_dir):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import fp8conf
    from fp8conf.graph.all_gathers import validate_weight_all_gathers
    from fp8conf.graph.collectives import get_collective
    from fp8conf.parallel import shard_data_parallel

    backend = options["backend"]
    device = "cpu" if backend == "gloo" else f"cuda:{rank}"
    if backend == "gloo":
        # The ranks share this machine's cores: one thread each, or their matmuls oversubscribe them.
        torch.set_num_threads(max(1, (os.cpu_count() or ranks) // ranks))
    else:
        torch.cuda.set_device(rank)
    rank_processes.start_process_group(backend, init_file, rank, ranks)
    try:
        on = options["float8_all_gather"]
        mesh = init_device_mesh("cpu" if backend == "gloo" else "cuda", (ranks,))
        x, target = _data(options, device)
        reference = _build(options, on).to(device)
        whole = _eager_grads(reference, x, target)
        step = shard_data_parallel(_build(options, on).to(device), mesh)
        rows = options["tokens"] // ranks
        mine = (x[rank * rows:(rank + 1) * rows], target[rank * rows:(rank + 1) * rows])
        same_batch = _eager_grads(step, x, target)
        split_batch, eager_s = _timed(lambda: _eager_grads(step, *mine), options["repeats"])
        gm = fp8conf.trace_joint(step, mine)
        validated = True
        try:
            fp8conf.validate_fp8_graph(gm)
            validate_weight_all_gathers(gm)
        except fp8conf.FP8ValidationError as exc:
            validated = False
            print(f"rank {rank}: {type(exc).__name__}: {exc}")
        (_, traced), traced_s = _timed(lambda: fp8conf.run_joint(gm, step, mine, (torch.ones((), device=device),)), options["repeats"])
        compiled_diff = compiled_s = None
        if options["compile"]:
            compiled = fp8conf.compile_joint(gm, mode=options["compile"])
            (_, grads), compiled_s = _timed(lambda: fp8conf.run_joint(gm, step, mine, (torch.ones((), device=device),), fn=compiled), options["repeats"])
            compiled_diff = max(float((grads[f] - traced[f]).abs().max()) for f in traced)
        records = [r for r in (get_collective(n) for n in gm.graph.nodes) if r is not None]
        shard = {fqn: whole[fqn].chunk(ranks)[rank] for fqn in whole}
        torch.save({
            "validated": validated,
            "traced_equals_eager": all(torch.equal(traced[f], split_batch[f]) for f in split_batch),
            "same_batch_bitwise": all(torch.equal(same_batch[f], shard[f]) for f in shard),
            "error_parts": [(float((split_batch[f] - shard[f]).norm() ** 2), float(shard[f].norm() ** 2)) for f in shard],
            "parameters": len(shard),
            "all_gather_bytes": sum(r.result_bytes for r in records if r.op == "all_gather"),
            "all_gather_bytes_float8": sum(r.result_bytes for r in records if r.op == "all_gather" and r.float8),
            "reduce_scatter_bytes": sum(r.result_bytes * ranks for r in records if r.op == "reduce_scatter"),
            "eager_s": eager_s,
            "traced_s": traced_s,
            "compiled_diff": compiled_diff,
            "compiled_s": compiled_s,
        }, os.path.join(result_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    rank_processes.leave()


def launch(*, float8_all_gather: bool = True, ranks: int = 2, dim: int = 64, blocks: int = 2, tokens: int = 32,
           recipe: str = "tensorwise", repeats: int = 3, compile: str | None = None, backend: str = "gloo") -> ShardedCheck:
    """Spawn ``ranks`` processes (``backend`` ``"gloo"`` on CPU, ``"nccl"`` one GPU each), run the
    checks and return them (``compile``: also compile the traced step, ``"regional"``). A failed
    rank raises one error naming the cause (:func:`fp8conf.tools.ranks.spawn`)."""
    if backend == "nccl" and torch.cuda.device_count() < ranks:
        raise FP8ConfigError(f"sharded_check --backend nccl --ranks {ranks}: this machine has {torch.cuda.device_count()} GPU(s); "
                             "ask for at most that many ranks")
    options = dict(float8_all_gather=float8_all_gather, dim=dim, blocks=blocks, tokens=tokens, recipe=recipe, repeats=repeats,
                   compile=compile, backend=backend)
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        rank_processes.spawn(_worker, (ranks, init_file, options, tmp), ranks=ranks, tool="sharded_check")
        results = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(ranks)]
    parts = [p for r in results for p in r["error_parts"]]
    error = (sum(d for d, _ in parts) / max(sum(n for _, n in parts), 1e-30)) ** 0.5
    return ShardedCheck(
        ranks=ranks,
        recipe=recipe,
        float8_all_gather=float8_all_gather,
        parameters=results[0]["parameters"],
        validated=all(r["validated"] for r in results),
        traced_equals_eager=all(r["traced_equals_eager"] for r in results),
        same_batch_bitwise=all(r["same_batch_bitwise"] for r in results),
        split_batch_error=error,
        tolerance=SPLIT_BATCH_TOLERANCE[recipe],
        all_gather_bytes=results[0]["all_gather_bytes"],
        all_gather_bytes_float8=results[0]["all_gather_bytes_float8"],
        reduce_scatter_bytes=results[0]["reduce_scatter_bytes"],
        eager_step_s=statistics.median(r["eager_s"] for r in results),
        traced_step_s=statistics.median(r["traced_s"] for r in results),
        compile=compile,
        backend=backend,
        compiled_max_abs_diff=max(r["compiled_diff"] for r in results) if compile else None,
        compiled_step_s=statistics.median(r["compiled_s"] for r in results) if compile else None,
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fp8conf.tools.sharded_check",
        description="Run a data-parallel FP8 step in gloo (CPU) or NCCL (GPU) processes and check its gradients against the unsharded step, "
        "and its traced graph's weight all-gathers against the float8 all-gather setting.",
    )
    parser.add_argument("--float8-all-gather", choices=["on", "off", "both"], default="both")
    parser.add_argument("--ranks", type=rank_processes.rank_count, default=2, help="processes, one rank each (default 2)")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo",
                        help="gloo: processes on the CPU; nccl: one GPU per rank")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32, help="the batch, split over the ranks")
    parser.add_argument("--recipe", default="tensorwise", choices=["tensorwise"],
                        help="TorchAO's float8 all-gather supports tensorwise weight scaling only")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps (median reported)")
    parser.add_argument("--compile", choices=["regional"], default=None, help="also compile the traced step and compare")
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    settings = {"on": [True], "off": [False], "both": [True, False]}[args.float8_all_gather]
    ok = True
    if args.backend == "nccl" and torch.cuda.device_count() < args.ranks:
        print(f"sharded_check: --backend nccl --ranks {args.ranks}: this machine has {torch.cuda.device_count()} GPU(s); "
              "ask for at most that many ranks", file=sys.stderr)
        return 2
    for on in settings:
        try:
            check = launch(float8_all_gather=on, ranks=args.ranks, dim=args.dim, blocks=args.blocks, tokens=args.tokens,
                           recipe=args.recipe, repeats=args.repeats, compile=args.compile, backend=args.backend)
        except FP8Error as exc:
            print(f"sharded_check: {rank_processes.one_line(exc)}", file=sys.stderr)
            return 2
        print(check.summary())
        ok = ok and check.ok
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
