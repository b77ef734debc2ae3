"""The record of how a model's parameters are laid out across ranks, as the FP8 passes see it.

A model sharded by :func:`fp8conf.parallel.shard_data_parallel` carries a :class:`ParallelLayout`
under :data:`LAYOUT_ATTRIBUTE`; tracing copies it onto the joint graph (``TraceInfo.layout``), the
all-gather check reads it there and the quantization signature records its FP8-relevant part
(which weights are gathered in FP8). This module imports nothing from torch.
"""

from __future__ import annotations

import dataclasses

__all__ = ["LAYOUT_ATTRIBUTE", "ShardedParameter", "ParallelLayout", "layout_of"]

#: Attribute of the root module that holds its :class:`ParallelLayout`.
LAYOUT_ATTRIBUTE = "_fp8conf_parallel_layout"


@dataclasses.dataclass(frozen=True)
class ShardedParameter:
    """One parameter sharded along dim 0 over the data-parallel ranks.

    Attributes:
        fqn: the parameter's FQN (``layers.0.fc1.weight``).
        module_fqn: the module that owns it (``layers.0.fc1``).
        float8_all_gather: the forward gathers it as FP8 bytes with its scale beside them
            (a quantized module's weight with float8 all-gather on), not in high precision.
        quantized_weight: it is the weight of a quantized module (what the all-gather check holds
            to the setting).
    """

    fqn: str
    module_fqn: str
    float8_all_gather: bool
    quantized_weight: bool


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """How a model is sharded. ``kind`` is ``"data_parallel"`` (:func:`~fp8conf.parallel.shard_data_parallel`)
    or ``"tensor_parallel"`` (:func:`~fp8conf.parallel.shard_tensor_parallel`); ``world_size`` the
    ranks of the mesh (not FP8-relevant: the signature leaves it out); ``reduce`` how gradients
    combine over ranks (``"mean"`` or ``"sum"``; ``"sum"`` for tensor parallelism, whose partial
    results are summed); ``parameters`` the data-parallel shards; ``plan`` the tensor-parallel
    plan as sorted ``(module FQN, style)`` pairs, the style ``"float8_colwise"``,
    ``"float8_rowwise"`` (TorchAO's FP8 styles, on a quantized module), ``"colwise"`` or
    ``"rowwise"`` (torch's, on a high-precision linear)."""

    kind: str
    world_size: int
    reduce: str
    parameters: tuple[ShardedParameter, ...]
    plan: tuple[tuple[str, str], ...] = ()

    def parameter(self, fqn: str) -> ShardedParameter | None:
        return next((p for p in self.parameters if p.fqn == fqn), None)

    @property
    def float8_all_gather(self) -> bool:
        """Every quantized weight is gathered in FP8 (False when none is)."""
        quantized = [p for p in self.parameters if p.quantized_weight]
        return bool(quantized) and all(p.float8_all_gather for p in quantized)

    def signature_fields(self) -> dict:
        """The FP8-relevant part, as plain JSON data: per quantized weight, how it is gathered;
        for tensor parallelism, the plan (which modules are sharded and in which style)."""
        if self.kind == "tensor_parallel":
            return {"kind": self.kind, "plan": dict(self.plan)}
        return {
            "kind": self.kind,
            "all_gather": {p.fqn: ("float8" if p.float8_all_gather else "high_precision") for p in self.parameters if p.quantized_weight},
        }


def layout_of(model) -> ParallelLayout | None:
    """The layout a sharding function recorded on ``model``, or ``None``."""
    return getattr(model, LAYOUT_ATTRIBUTE, None)
