"""Mutant backends for DP: the reference with one defect each in how it shards FP8 training."""

from __future__ import annotations

import dataclasses

import torch
import trainer_backend  # docs/examples, on sys.path for fp8conf's tests
import trainer_float8

from conformance.backends.reference import ReferenceBackend


def _float8_linears(model):
    from torchao.float8.float8_linear import Float8Linear

    return [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, Float8Linear)]


def _set_float8_all_gather(model, on: bool) -> None:
    """Convert every Float8Linear's config to ``enable_fsdp_float8_all_gather=on``, with the weight
    TorchAO's conversion gives under it (its FSDP cast subclass, or the plain tensor)."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    for _fqn, module in _float8_linears(model):
        module.config = dataclasses.replace(module.config, enable_fsdp_float8_all_gather=on)
        weight = module.weight
        if not on and isinstance(weight, WeightWithDynamicFloat8CastTensor):
            module.weight = torch.nn.Parameter(weight._tensor, requires_grad=weight.requires_grad)


def _to_plain_linears(model, fqns) -> None:
    """Replace the Float8Linears at ``fqns`` by ``nn.Linear``s with their weights."""
    for fqn, module in _float8_linears(model):
        if fqn in fqns:
            plain = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            plain.weight = torch.nn.Parameter(getattr(module.weight, "_tensor", module.weight).detach().clone())
            if module.bias is not None:
                plain.bias = torch.nn.Parameter(module.bias.detach().clone())
            parent, _, name = fqn.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, name, plain)


def _sharded_gathering(model, mesh, *, float8_all_gather: bool):
    """The reference's data-parallel sharding with the model's float8 all-gather set to
    ``float8_all_gather``, whatever the suite asked for."""
    from fp8conf.parallel import shard_data_parallel

    _set_float8_all_gather(model, float8_all_gather)
    return shard_data_parallel(model, mesh, float8_all_gather=float8_all_gather)


class HighPrecisionGatherThenCast(ReferenceBackend):
    """Gathers the high-precision weight and casts it to FP8 after the gather although float8
    all-gather is on: a tracer that bypasses TorchAO's FSDP hooks (torchtitan #3123)."""

    name = "mutant-high-precision-gather-then-cast"
    KILLED_BY = "DP-001"

    def shard_data_parallel(self, model, mesh, *, float8_all_gather):
        return _sharded_gathering(model, mesh, float8_all_gather=False)


class GatheredFp8Requantized(ReferenceBackend):
    """Gathers FP8 bytes, then dequantizes the gathered weight and lets the linear cast it again
    with a scale of its own: FP8 on the wire, but the matmul does not take the bytes gathered."""

    name = "mutant-gathered-fp8-requantized"
    KILLED_BY = "DP-001"

    def trace_joint(self, model, args):
        import fp8conf.parallel.data_parallel as data_parallel
        from mutants.backends import _replaced

        gather = data_parallel._Float8AllGather.forward

        def dequantized(ctx, *inputs):
            return gather(ctx, *inputs).to_original_precision()

        with _replaced(data_parallel._Float8AllGather, "forward", staticmethod(dequantized)):
            return super().trace_joint(model, args)


class Float8GatherAlthoughOff(ReferenceBackend):
    """Gathers quantized weights as FP8 whatever the model's config says."""

    name = "mutant-float8-gather-although-off"
    KILLED_BY = "DP-002"

    def shard_data_parallel(self, model, mesh, *, float8_all_gather):
        return _sharded_gathering(model, mesh, float8_all_gather=True)


class NoFp8WithoutFloat8AllGather(ReferenceBackend):
    """Takes float8 all-gather off for FP8 off: converts the quantized linears back to
    ``nn.Linear`` before sharding, so the step gathers high precision and computes in it too."""

    name = "mutant-no-fp8-without-float8-all-gather"
    KILLED_BY = "DP-002"

    def shard_data_parallel(self, model, mesh, *, float8_all_gather):
        from fp8conf.parallel import shard_data_parallel

        if not float8_all_gather:
            _to_plain_linears(model, {fqn for fqn, _ in _float8_linears(model)})
        return shard_data_parallel(model, mesh, float8_all_gather=None)


class SummedGradients(ReferenceBackend):
    """Reduce-scatters the gradients with a sum where data parallelism averages them."""

    name = "mutant-summed-gradients"
    KILLED_BY = "DP-003"

    def shard_data_parallel(self, model, mesh, *, float8_all_gather):
        from fp8conf.parallel import shard_data_parallel

        return shard_data_parallel(model, mesh, float8_all_gather=float8_all_gather, reduce="sum")


class LocalGradientsKept(ReferenceBackend):
    """Keeps each rank's own rows of its local gradient instead of reduce-scattering the ranks'
    gradients: every rank trains on its own part of the batch only."""

    name = "mutant-local-gradients-kept"
    KILLED_BY = "DP-003"

    def trace_joint(self, model, args):
        import fp8conf.parallel.data_parallel as data_parallel
        from mutants.backends import _replaced

        def local_rows(grad, mesh, reduce, fqn, module_fqn):
            return grad.chunk(mesh.size())[mesh.get_local_rank()].contiguous()

        with _replaced(data_parallel, "_reduce_scatter", local_rows):
            return super().trace_joint(model, args)


class TensorParallelInHighPrecision(ReferenceBackend):
    """Applies tensor parallelism with torch's plain styles to linears it converts back to
    ``nn.Linear`` first (a trainer that converts to float8 after TP and skips ``DTensor`` weights):
    every sharded linear computes in high precision."""

    name = "mutant-tensor-parallel-in-high-precision"
    KILLED_BY = "DP-004"

    def shard_tensor_parallel(self, model, mesh, *, plan):
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        _to_plain_linears(model, set(plan))
        styles = {fqn: ColwiseParallel() if style == "colwise" else RowwiseParallel() for fqn, style in plan.items()}
        return parallelize_module(model, mesh, styles)


class ShardScaledFloat8Linear(trainer_float8.TrainerFloat8Linear):
    """The worked example's float8 linear, with its weight's scale taken from the rank's own shard:
    a trainer that saves a collective by scaling before the gather."""

    def forward(self, x):
        local = self._parameters["weight"]
        local = local.to_local() if hasattr(local, "to_local") else local
        with torch.no_grad():
            weight = self.weight  # gathered, where sharded
            amax = local.abs().amax().to(torch.float32).clamp(min=1e-12)
            scale = ((trainer_float8._MAX / amax).view(torch.int32) & 0x7F800000).view(torch.float32)
            w_data = (weight.to(torch.float32) * scale).clamp(-trainer_float8._MAX, trainer_float8._MAX).to(torch.float8_e4m3fn)
            w_inv = scale.reciprocal().expand(weight.shape[0], 1).contiguous()
        out = trainer_float8._Float8LinearFunction.apply(x, self.weight, w_data, w_inv, self.recipe, self.emulate)
        return out if self.bias is None else out + self.bias.to(out.dtype)


class WeightScaleFromTheShard(trainer_backend.TrainerBackend):
    """The worked example, quantizing after the gather as it declares, but computing each
    weight's scale from the rank's shard before the gather: the ranks cast one weight with
    different scales."""

    name = "mutant-weight-scale-from-the-shard"
    KILLED_BY = "DP-005"

    def convert_float8(self, model, *, module_filter_fn, recipe, emulate):
        super().convert_float8(model, module_filter_fn=module_filter_fn, recipe=recipe, emulate=emulate)
        for module in model.modules():
            if type(module) is trainer_float8.TrainerFloat8Linear:
                module.__class__ = ShardScaledFloat8Linear

MUTANTS = [
    HighPrecisionGatherThenCast, GatheredFp8Requantized, Float8GatherAlthoughOff, NoFp8WithoutFloat8AllGather, SummedGradients,
    LocalGradientsKept, TensorParallelInHighPrecision, WeightScaleFromTheShard,
]
