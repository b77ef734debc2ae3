"""A self-checking tensor-parallel FP8 step over ``torch.distributed``: ``python -m fp8conf.tools.tensor_parallel_check``.

Runs a two-layer tensorwise FP8 MLP (``Float8Linear`` up, colwise; down, rowwise) sharded by
:func:`fp8conf.parallel.shard_tensor_parallel` (TorchAO's ``Float8ColwiseParallel`` /
``Float8RowwiseParallel``) in ``ranks`` gloo processes on CPU, every rank given the same batch
(tensor parallelism replicates the input), and checks on every rank that the traced step
(``fp8conf.trace_joint``, its collectives in the graph) passes :func:`fp8conf.validate_fp8_graph`
with the unsharded step's FP8 compute counts, that its FP8 regions are all complete, and that
:func:`fp8conf.run_joint` gives the output, the input gradient and each rank's shard of every
parameter gradient (up's weight and bias rows, down's weight columns, down's replicated bias)
within ``TOLERANCE`` of the unsharded eager step's (relative norm). The input of ``down`` is cast
with the amax of the whole activation (TorchAO's rowwise style casts the ``DTensor``), so FP8
rounding is the unsharded step's; what differs is the order of float32 sums. Except for the
biases: TorchAO's float8 styles cast a module's output gradient to e5m2 in the module's output
hook, before the bias's gradient is taken, where an unsharded ``Float8Linear`` sums the
high-precision output gradient; so a bias gradient is held to e5m2's rounding
(``BIAS_TOLERANCE``, measured 0.065 for ``up.bias``).

With ``--compile regional`` the traced step is also compiled regionally
(:func:`fp8conf.compile_joint`: the collectives stay outside the FP8 regions) and run over gloo;
its output and gradients must equal the traced step's within ``COMPILED_TOLERANCE`` (Inductor
sums float32 in its own order). A sharded step is not compiled whole (``mode="full"`` refuses it).

    python -m fp8conf.tools.tensor_parallel_check --dim 64 --hidden 128 --compile regional
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import sys
import tempfile

import torch

from fp8conf.errors import FP8Error
from fp8conf.tools import ranks as rank_processes

__all__ = ["TensorParallelCheck", "TOLERANCE", "BIAS_TOLERANCE", "COMPILED_TOLERANCE", "tolerance_of", "launch", "main"]

#: Relative norm of (sharded - unsharded) outputs and gradients allowed: float32 sums in
#: another order (measured: weight gradients equal bitwise, output and input gradient 1.1e-7).
TOLERANCE = 1e-4
#: For bias gradients, taken from the output gradient cast to e5m2 (2 mantissa bits): its unit
#: roundoff, 2**-3.
BIAS_TOLERANCE = 0.125
#: Largest absolute difference allowed between the regionally compiled and the traced step.
COMPILED_TOLERANCE = 1e-4


def tolerance_of(what: str) -> float:
    return BIAS_TOLERANCE if what.endswith(".bias") else TOLERANCE


@dataclasses.dataclass
class TensorParallelCheck:
    ranks: int
    validated: bool
    regions_complete: bool
    errors: dict  # what -> largest relative error over the ranks
    all_reduce_bytes: int
    compile: str | None = None
    #: Largest absolute difference of the compiled step's output and gradients from the traced step's, over the ranks.
    compiled_max_abs_diff: float | None = None

    @property
    def ok(self) -> bool:
        compiled = self.compile is None or (self.compiled_max_abs_diff is not None and self.compiled_max_abs_diff <= COMPILED_TOLERANCE)
        return self.validated and self.regions_complete and compiled and all(e <= tolerance_of(k) for k, e in self.errors.items())

    def summary(self) -> str:
        worst = max((e for k, e in self.errors.items() if not k.endswith(".bias")), default=float("nan"))
        bias = max((e for k, e in self.errors.items() if k.endswith(".bias")), default=float("nan"))
        return (
            f"tensor-parallel FP8 step over gloo: {self.ranks} ranks (up colwise, down rowwise, TorchAO's float8 styles); "
            f"validation {'passed' if self.validated else 'FAILED'}; FP8 regions {'complete' if self.regions_complete else 'INCOMPLETE'}; "
            f"largest relative error against the unsharded step {worst:.3g} (tolerance {TOLERANCE:g}), of a bias gradient "
            f"{bias:.3g} (tolerance {BIAS_TOLERANCE:g}, e5m2 output gradients): "
            + ", ".join(f"{k} {v:.3g}" for k, v in sorted(self.errors.items()))
            + f"; all-reduced per step and rank: {self.all_reduce_bytes} bytes"
            + ("" if self.compile is None else
               f"; {self.compile} compiled: largest absolute difference from the traced step {self.compiled_max_abs_diff:.3g} "
               f"(tolerance {COMPILED_TOLERANCE:g})")
        )


def _model(dim, hidden):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("up", torch.nn.Linear(dim, hidden, bias=True))
    model.add_module("act", torch.nn.ReLU())
    model.add_module("down", torch.nn.Linear(hidden, dim, bias=True))
    return convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"))


def _relative(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _worker(rank, ranks, init_file, options, out_dir):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import fp8conf
    from fp8conf.graph.collectives import get_collective
    from fp8conf.parallel import shard_tensor_parallel

    torch.set_num_threads(1)  # the ranks share this machine's cores
    rank_processes.start_process_group("gloo", init_file, rank, ranks)
    try:
        dim, hidden, tokens = options["dim"], options["hidden"], options["tokens"]
        model = _model(dim, hidden)
        x = torch.randn(tokens, dim, generator=torch.Generator().manual_seed(1))
        g = torch.randn(tokens, dim, generator=torch.Generator().manual_seed(2))
        reference = copy.deepcopy(model)
        xr = x.clone().requires_grad_()
        out_ref = reference(xr)
        out_ref.backward(g)
        plain = fp8conf.validate_fp8_graph(fp8conf.trace_joint(copy.deepcopy(model), (x.clone().requires_grad_(),)))
        shard_tensor_parallel(model, init_device_mesh("cpu", (ranks,)), {"up": "colwise", "down": "rowwise"})
        gm = fp8conf.trace_joint(model, (x.clone().requires_grad_(),))
        validated = True
        try:
            validated = fp8conf.validate_fp8_graph(gm).compute_counts == plain.compute_counts
        except fp8conf.FP8ValidationError as exc:
            validated = False
            print(f"rank {rank}: {type(exc).__name__}: {exc}")
        regions_complete = all(r.complete for r in fp8conf.identify_fp8_regions(gm))
        outputs, grads = fp8conf.run_joint(gm, model, (x.clone().requires_grad_(),), (g,))
        expected = {
            "output": out_ref.detach(), "input.0": xr.grad,
            "up.weight": reference.up.weight.grad.chunk(ranks, 0)[rank], "up.bias": reference.up.bias.grad.chunk(ranks, 0)[rank],
            "down.weight": reference.down.weight.grad.chunk(ranks, 1)[rank], "down.bias": reference.down.bias.grad,
        }
        seen = {"output": outputs[0], **grads}
        compiled_diff = None
        if options["compile"]:
            compiled = fp8conf.compile_joint(gm, mode=options["compile"])
            outputs_c, grads_c = fp8conf.run_joint(gm, model, (x.clone().requires_grad_(),), (g,), fn=compiled)
            compiled_seen = {"output": outputs_c[0], **grads_c}
            compiled_diff = max(float((compiled_seen[k].detach() - seen[k].detach()).abs().max()) for k in seen)
        records = [r for r in (get_collective(n) for n in gm.graph.nodes) if r is not None]
        torch.save({
            "validated": validated,
            "regions_complete": regions_complete,
            "errors": {k: _relative(seen[k].detach(), v) for k, v in expected.items()},
            "all_reduce_bytes": sum(r.result_bytes for r in records if r.op == "all_reduce"),
            "compiled_diff": compiled_diff,
        }, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    rank_processes.leave()


def launch(*, ranks: int = 2, dim: int = 32, hidden: int = 64, tokens: int = 16, compile: str | None = None) -> TensorParallelCheck:
    """Spawn ``ranks`` gloo processes, run the checks and return them (``compile``: also compile
    the traced step, ``"regional"``). A failed rank raises one error naming the cause
    (:func:`fp8conf.tools.ranks.spawn`)."""
    if compile not in (None, "regional"):
        raise ValueError(f"tensor_parallel_check: compile must be None or 'regional' (a sharded step is not compiled whole), got {compile!r}")
    options = dict(dim=dim, hidden=hidden, tokens=tokens, compile=compile)
    with tempfile.TemporaryDirectory() as tmp:
        rank_processes.spawn(_worker, (ranks, os.path.join(tmp, "init"), options, tmp), ranks=ranks, tool="tensor_parallel_check")
        results = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(ranks)]
    errors = {k: max(r["errors"][k] for r in results) for k in results[0]["errors"]}
    return TensorParallelCheck(
        ranks, all(r["validated"] for r in results), all(r["regions_complete"] for r in results), errors,
        results[0]["all_reduce_bytes"], compile,
        None if compile is None else max(r["compiled_diff"] for r in results),
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fp8conf.tools.tensor_parallel_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=rank_processes.rank_count, default=2)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64, help="split over the ranks; each rank's part a multiple of 16")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--compile", choices=["regional"], default=None,
                        help="also compile the traced step regionally and compare it with the traced step")
    args = parser.parse_args(argv)
    try:
        check = launch(ranks=args.ranks, dim=args.dim, hidden=args.hidden, tokens=args.tokens, compile=args.compile)
    except FP8Error as exc:
        print(f"tensor_parallel_check: {rank_processes.one_line(exc)}", file=sys.stderr)
        return 2
    print(check.summary())
    return 0 if check.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
