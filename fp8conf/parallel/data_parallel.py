"""Data-parallel sharding whose weight all-gathers are traced into the joint graph.

:func:`shard_data_parallel` shards every parameter of a model along dim 0 over a one-dimensional
``DeviceMesh`` as a ``DTensor`` (``Shard(0)``), as FSDP2 does, and makes each module's forward
gather its parameters through functional collectives (``all_gather_into_tensor`` + ``wait_tensor``),
whose backward reduce-scatters the gradient (``reduce_scatter_tensor``). Unlike ``fully_shard``,
whose gathers run in hooks outside the autograd graph, these are ops of the step itself, so that
``fp8conf.trace_joint`` puts every collective in the joint graph, where the FP8 passes see them.

With float8 all-gather on, a quantized weight is cast to FP8 *before* the gather by TorchAO's own
hooks (``WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather``: the amax is all-reduced over the
mesh, so every rank casts its shard with the scale of the whole weight) and rebuilt as a
``Float8TrainingTensor`` after it (``fsdp_post_all_gather``), which ``Float8Linear`` then uses without
casting again. The FP8 bytes travel viewed as ``uint8``: the all-gather moves one byte per
element, its scale stays beside it (replicated, never gathered), and the view also takes the
tensor past process groups that have no FP8 dtype (gloo raises ``Invalid scalar type`` for one,
which is what ``fully_shard`` with float8 all-gather hits on CPU).

The gradient of a gathered weight is reduce-scattered in high precision and, for ``reduce="mean"``,
divided by the number of ranks (gloo has no average reduction), so each rank's shard of the
gradient is the mean of the ranks' gradients, as FSDP's.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.fx.traceback as fx_traceback
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from fp8conf.arguments import require
from fp8conf.errors import FP8ConfigError
from fp8conf.graph.collectives import COLLECTIVE_ANNOTATION
from fp8conf.parallel.layout import LAYOUT_ATTRIBUTE, ParallelLayout, ShardedParameter
from fp8conf.quantized.float8 import import_torchao_quietly
from fp8conf.quantized.protocol import quantization_config_of

__all__ = ["shard_data_parallel"]


def shard_data_parallel(
    model: torch.nn.Module, mesh: DeviceMesh, *, float8_all_gather: bool | None = None, reduce: str = "mean"
) -> torch.nn.Module:
    """Shard ``model``'s parameters over ``mesh`` (in place) and return it.

    ``float8_all_gather``: whether the weights of quantized modules (``Float8Linear``) are gathered
    as FP8. ``None`` follows each module's ``Float8LinearConfig.enable_fsdp_float8_all_gather``;
    ``True`` or ``False`` must agree with it (a module converted otherwise is an
    :class:`~fp8conf.errors.FP8ConfigError` naming it). Other parameters are gathered in their own
    dtype. ``reduce``: ``"mean"`` (FSDP's) or ``"sum"`` of the ranks' gradients.

    Every rank must call this on the same model (same initial values): each keeps its own slice
    of every parameter, and nothing is communicated here. Dim 0 of every parameter must divide
    by the mesh's size.
    """
    require(model, "model", "shard_data_parallel", "model")
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise FP8ConfigError(
            f"shard_data_parallel: mesh must be a one-dimensional torch.distributed.device_mesh.DeviceMesh, got {mesh!r}; "
            "make one with init_device_mesh(device_type, (world_size,))"
        )
    if reduce not in ("mean", "sum"):
        raise FP8ConfigError(f"shard_data_parallel: reduce must be 'mean' or 'sum', got {reduce!r}")
    if getattr(model, LAYOUT_ATTRIBUTE, None) is not None:
        raise FP8ConfigError("shard_data_parallel: the model is sharded already; shard a fresh model")
    import_torchao_quietly()
    sharded, owners = [], {}
    for module_fqn, module in list(model.named_modules()):
        params = dict(module.named_parameters(recurse=False))
        if not params:
            continue
        on = _float8_all_gather_of(module, module_fqn, float8_all_gather)
        names = list(params)
        for name, param in params.items():
            fqn = f"{module_fqn}.{name}" if module_fqn else name
            if id(param) in owners:
                raise FP8ConfigError(
                    f"shard_data_parallel: parameter '{fqn}' is the same tensor as '{owners[id(param)]}' (tied weights); "
                    "sharding each would untie them: untie them, or keep the model unsharded"
                )
            owners[id(param)] = fqn
            _check_divisible(param, fqn, mesh)
            local = distribute_tensor(param.detach(), mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(name, torch.nn.Parameter(local, requires_grad=param.requires_grad))
            is_weight = name == "weight" and on is not None
            sharded.append(ShardedParameter(fqn, module_fqn, bool(on) and is_weight, is_weight))
        _gather_on_access(module, module_fqn, names, mesh, reduce, on)
    layout = ParallelLayout("data_parallel", mesh.size(), reduce, tuple(sharded))
    object.__setattr__(model, LAYOUT_ATTRIBUTE, layout)
    return model


def _float8_all_gather_of(module, module_fqn, asked) -> bool | None:
    """Whether ``module``'s weight is gathered in FP8; None for a module that is not quantized."""
    config = quantization_config_of(module)
    if config is None or config.kind != "float8_linear":
        return None
    configured = bool(getattr(module.config, "enable_fsdp_float8_all_gather", False))
    if asked is not None and bool(asked) != configured:
        raise FP8ConfigError(
            f"shard_data_parallel(float8_all_gather={asked}): module '{module_fqn or '<root>'}' was converted with "
            f"Float8LinearConfig(enable_fsdp_float8_all_gather={configured}), so its weight "
            f"{'is not' if asked else 'is'} the tensor TorchAO's float8 all-gather hooks act on; convert it with "
            f"enable_fsdp_float8_all_gather={bool(asked)}, or pass float8_all_gather=None to follow each module's config"
        )
    return configured


def _check_divisible(param, fqn, mesh) -> None:
    if param.dim() == 0 or param.shape[0] % mesh.size():
        raise FP8ConfigError(
            f"shard_data_parallel: parameter '{fqn}' of shape {tuple(param.shape)} cannot be sharded evenly along dim 0 "
            f"over {mesh.size()} ranks; choose sizes divisible by the mesh size"
        )


def _gather_on_access(module, module_fqn, names, mesh, reduce, float8_all_gather) -> None:
    """Make ``module.<name>`` the gathered parameter inside the module's forward, gathered once
    per call, and the shard (the ``DTensor`` in ``module._parameters``) everywhere else, as under
    FSDP2: parameter FQNs, optimizers and state dicts see the shards. The module's class is
    swapped for a subclass with one property per sharded parameter and a forward that opens the
    per-call gather cache."""
    gathers = {}
    for name in names:
        fqn = f"{module_fqn}.{name}" if module_fqn else name
        gathers[name] = _gatherer(name, fqn, module_fqn, mesh, reduce, bool(float8_all_gather) and name == "weight")
    cls = type(module)

    def forward(self, *args, **kwargs):
        outer = self.__dict__.get(_GATHERED)
        self.__dict__[_GATHERED] = _Gathered(torch.is_grad_enabled())
        try:
            return cls.forward(self, *args, **kwargs)
        finally:
            self.__dict__[_GATHERED] = outer

    namespace = {name: property(_accessor(name, gather)) for name, gather in gathers.items()}
    namespace["forward"] = forward
    module.__class__ = type(f"DataParallel{cls.__name__}", (cls,), namespace)


# Instance attribute holding the parameters gathered in the current forward call (None outside).
_GATHERED = "_fp8conf_gathered"


class _Gathered(dict):
    """The parameters gathered in one forward call, and the grad mode the call began in: a
    parameter first read under ``torch.no_grad()`` inside the forward (a weight quantized
    outside the module's autograd function) is still gathered with autograd, as the rest of
    the forward reads the same gathered tensor and its gradient must reach the shard."""

    def __init__(self, grad_enabled: bool):
        super().__init__()
        self.grad_enabled = grad_enabled


def _accessor(name, gather):
    def get(self):
        cache = self.__dict__.get(_GATHERED)
        if cache is None:
            return self._parameters[name]
        if name not in cache:
            try:
                with torch.set_grad_enabled(cache.grad_enabled):
                    cache[name] = gather(self)
            except AttributeError as exc:
                # Raised out of a property, an AttributeError makes Python fall back to
                # Module.__getattr__, which returns the shard: the forward would go on with a
                # DTensor and fail far from here, or compute on the shard.
                raise RuntimeError(f"shard_data_parallel: gathering '{name}' of {type(self).__name__} failed: {exc!r}") from exc
        return cache[name]

    return get


def _gatherer(name, fqn, module_fqn, mesh, reduce, fp8):
    def gather(module):
        shard = module._parameters[name].to_local()
        with _annotated(fqn, module_fqn, "parameter"):
            if fp8:
                return _Float8AllGather.apply(shard, module, mesh, reduce, fqn, module_fqn)
            return _AllGather.apply(shard, mesh, reduce, fqn, module_fqn)

    return gather


def _annotated(fqn, module_fqn, moves):
    # The annotation reaches node.meta["custom"] only while tracing (preserve_node_meta); in an
    # eager step it costs a dict update.
    return fx_traceback.annotate({COLLECTIVE_ANNOTATION: (fqn, module_fqn, moves)})


def _waited(tensor):
    # Eagerly a functional collective returns a tensor that waits on first use; traced, the
    # wait is already in the graph.
    return tensor.wait() if isinstance(tensor, funcol.AsyncCollectiveTensor) else tensor


def _reduce_scatter(grad, mesh, reduce, fqn, module_fqn):
    with _annotated(fqn, module_fqn, "gradient"):
        shard = _waited(funcol.reduce_scatter_tensor(grad.contiguous(), "sum", 0, mesh))
        return shard / mesh.size() if reduce == "mean" else shard


# The gathers call the functional collectives inside one autograd.Function each, rather than
# DTensor.redistribute: DTensor's conversions are autograd Functions of their own, which give the
# traced gather and its reduce-scatter different sequence numbers, so the reduce-scatter would no
# longer be paired with its module's forward (and lose its provenance).
class _AllGather(torch.autograd.Function):
    """High-precision gather of a dim-0 shard; backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, shard, mesh, reduce, fqn, module_fqn):
        ctx.mesh, ctx.reduce, ctx.fqn, ctx.module_fqn = mesh, reduce, fqn, module_fqn
        return _waited(funcol.all_gather_tensor(shard.contiguous(), 0, mesh))

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.mesh, ctx.reduce, ctx.fqn, ctx.module_fqn), None, None, None, None


class _Float8AllGather(torch.autograd.Function):
    """FP8 gather of a quantized weight's shard through TorchAO's FSDP hooks. The result is a
    ``Float8TrainingTensor`` of the whole weight; the cast is the identity for gradients (as
    TorchAO's own), so the backward reduce-scatters the high-precision weight gradient."""

    @staticmethod
    def forward(ctx, shard, module, mesh, reduce, fqn, module_fqn):
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

        ctx.mesh, ctx.reduce, ctx.fqn, ctx.module_fqn = mesh, reduce, fqn, module_fqn
        if not isinstance(shard, WeightWithDynamicFloat8CastTensor):
            shard = WeightWithDynamicFloat8CastTensor(shard, module.linear_mm_config, module.config.cast_config_weight.target_dtype)
        (data,), metadata = shard.fsdp_pre_all_gather(mesh)
        gathered = _waited(funcol.all_gather_tensor(data.contiguous().view(torch.uint8), 0, mesh))
        weight, _ = shard.fsdp_post_all_gather((gathered.view(data.dtype),), metadata, shard.dtype)
        return weight

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.mesh, ctx.reduce, ctx.fqn, ctx.module_fqn), None, None, None, None, None
