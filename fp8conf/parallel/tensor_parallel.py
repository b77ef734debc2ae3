"""Tensor parallelism of FP8 linears, with TorchAO's FP8 styles, recorded for the FP8 passes.

:func:`shard_tensor_parallel` applies torch's ``parallelize_module`` with TorchAO's
``Float8ColwiseParallel`` / ``Float8RowwiseParallel`` (:mod:`torchao.float8.float8_tensor_parallel`)
to the quantized modules a plan names (torch's ``ColwiseParallel`` / ``RowwiseParallel`` to plain
linears), and records the plan as the model's :class:`~fp8conf.parallel.layout.ParallelLayout`.
The weights become ``DTensor`` shards; the FP8 styles cast a module's input to FP8 in the
module's own forward pre-hook, before any redistribution, so that a collective of the input
moves FP8 bytes and the module's matmul takes them without casting again. Traced, the step's
collectives (the rowwise output's all-reduce, their backward counterparts) are torch's functional
collectives in the joint graph; every rank computes its shard in FP8.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from fp8conf.arguments import require
from fp8conf.errors import FP8ConfigError
from fp8conf.parallel.layout import LAYOUT_ATTRIBUTE, ParallelLayout
from fp8conf.quantized.float8 import import_torchao_quietly
from fp8conf.quantized.protocol import quantization_config_of

__all__ = ["shard_tensor_parallel"]

_STYLES = ("colwise", "rowwise")


def shard_tensor_parallel(model: torch.nn.Module, mesh: DeviceMesh, plan: dict[str, str]) -> torch.nn.Module:
    """Shard the linears ``plan`` names over ``mesh`` (in place) and return ``model``.

    ``plan`` maps a module FQN to ``"colwise"`` (weight split along output features; the
    input replicated, the output left sharded along its last dim for the next layer) or
    ``"rowwise"`` (split along input features, taking that sharded input; the output summed over
    the ranks). A quantized module must be a tensorwise ``Float8Linear`` (TorchAO's FP8 styles
    assume tensorwise scaling); each sharded dimension must divide by the mesh's size.
    """
    require(model, "model", "shard_tensor_parallel", "model")
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise FP8ConfigError(
            f"shard_tensor_parallel: mesh must be a one-dimensional torch.distributed.device_mesh.DeviceMesh, got {mesh!r}; "
            "make one with init_device_mesh(device_type, (world_size,))"
        )
    if getattr(model, LAYOUT_ATTRIBUTE, None) is not None:
        raise FP8ConfigError("shard_tensor_parallel: the model is sharded already; shard a fresh model")
    import_torchao_quietly()
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    styles, recorded = {}, []
    for fqn, style in sorted(plan.items()):
        module = _linear(model, fqn, style, mesh)
        config = quantization_config_of(module)
        if config is not None:
            if config.kind != "float8_linear" or config.recipe != "tensorwise":
                raise FP8ConfigError(
                    f"shard_tensor_parallel: module '{fqn}' is {config.kind} with recipe {config.recipe!r}; TorchAO's "
                    "Float8ColwiseParallel/Float8RowwiseParallel assume tensorwise Float8Linear modules: convert it with "
                    "the tensorwise recipe, or leave it out of the plan"
                )
            styles[fqn] = Float8ColwiseParallel() if style == "colwise" else Float8RowwiseParallel()
            recorded.append((fqn, f"float8_{style}"))
        else:
            styles[fqn] = ColwiseParallel() if style == "colwise" else RowwiseParallel()
            recorded.append((fqn, style))
    parallelize_module(model, mesh, styles)
    object.__setattr__(model, LAYOUT_ATTRIBUTE, ParallelLayout("tensor_parallel", mesh.size(), "sum", (), tuple(recorded)))
    return model


def _linear(model, fqn, style, mesh) -> torch.nn.Module:
    if style not in _STYLES:
        raise FP8ConfigError(f"shard_tensor_parallel: plan['{fqn}'] is {style!r}; expected one of {list(_STYLES)}")
    try:
        module = model.get_submodule(fqn)
    except AttributeError:
        raise FP8ConfigError(f"shard_tensor_parallel: the plan names '{fqn}', which is no module of the model") from None
    if not isinstance(module, torch.nn.Linear):
        raise FP8ConfigError(f"shard_tensor_parallel: module '{fqn}' is a {type(module).__name__}; the plan shards linears only")
    dim = module.out_features if style == "colwise" else module.in_features
    if dim % mesh.size():
        raise FP8ConfigError(
            f"shard_tensor_parallel: module '{fqn}' ({style}) splits {dim} features over {mesh.size()} ranks unevenly; "
            "choose sizes divisible by the mesh size"
        )
    return module
