"""Collectives in a joint graph: which parameter each one moves, in which pass, in what dtype.

A sharded step (:func:`fp8conf.parallel.shard_data_parallel`) gathers each parameter before the
module that owns it computes and reduce-scatters its gradient in the backward, through torch's
functional collectives (``_c10d_functional.all_gather_into_tensor``, ``reduce_scatter_tensor``,
``all_reduce``, each followed by ``wait_tensor``). Tracing leaves a :class:`CollectiveRecord` on
every such op in ``node.meta["fp8conf_collective"]``: the parameter and module it moves data
of, the pass, what moves (the ``parameter``, its ``gradient``, or the ``amax`` TorchAO reduces
to give every rank the same scale), and the bytes: the dtype on the wire, the element size,
whether those bytes are an FP8 tensor viewed as integers (how float8 all-gather sends them),
and the size of the result.

Forward ops are attributed from the annotation the sharding code puts around each gather,
backward ops from the one it puts around each reduce-scatter; a collective nobody annotated
(issued by other code: tensor parallelism's activation collectives) is recorded with
``parameter=None`` and ``moves=None``, and with the module its provenance names, if any.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx

from fp8conf.arguments import require
from fp8conf.graph.roles import is_fp8_dtype

__all__ = [
    "COLLECTIVE_ANNOTATION",
    "COLLECTIVE_META_KEY",
    "CollectiveRecord",
    "is_collective",
    "get_collective",
    "record_collectives",
    "bitcast_source_dtype",
]

#: Key, in ``node.meta``, of a :class:`CollectiveRecord`.
COLLECTIVE_META_KEY = "fp8conf_collective"
#: Key, in ``node.meta["custom"]`` while tracing, of ``(parameter FQN, module FQN, what moves)``
#: for the nodes a gather or a reduce-scatter issues; :func:`record_collectives` takes it out.
COLLECTIVE_ANNOTATION = "fp8conf.collective"

_COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "_c10d_functional_autograd", "c10d"})
_OPS = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
}
# Ops through which a tensor keeps its bytes: a dtype view, shape views, and copies that do not convert.
_SAME_BYTES = frozenset({
    "aten.view.dtype", "aten.view.default", "aten.reshape.default", "aten._unsafe_view.default", "aten.detach.default",
    "aten.clone.default", "aten.contiguous.default", "aten.alias.default",
})


@dataclasses.dataclass(frozen=True)
class CollectiveRecord:
    """One collective of a traced step.

    Attributes:
        op: ``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"`` ...
        parameter: the FQN of the parameter whose data it moves, or ``None`` if unknown.
        module_fqn: the module owning that parameter (``None`` if unknown).
        pass_name: ``"forward"`` or ``"backward"``.
        moves: ``"parameter"``, ``"gradient"`` or ``"amax"`` (``None`` if unknown).
        wire_dtype: the dtype of the tensor the collective is given (``"torch.uint8"``).
        element_size: bytes per element on the wire.
        float8: the bytes on the wire are an FP8 tensor (in its own dtype, or viewed as integers).
        source_dtype: the dtype of the bytes before any dtype view (``"torch.float8_e4m3fn"``).
        result_bytes: the size of the collective's result on each rank.
    """

    op: str
    parameter: str | None
    module_fqn: str | None
    pass_name: str
    moves: str | None
    wire_dtype: str
    element_size: int
    float8: bool
    source_dtype: str
    result_bytes: int


def is_collective(node: torch.fx.Node) -> bool:
    """A functional collective or its ``wait_tensor``: the points where a value leaves the rank."""
    namespace = getattr(node.target, "namespace", None)
    return node.op == "call_function" and namespace in _COLLECTIVE_NAMESPACES


def get_collective(node: torch.fx.Node) -> CollectiveRecord | None:
    """The :class:`CollectiveRecord` tracing left on ``node`` (None: no collective, or a wait)."""
    require(node, "node", "get_collective", "node")
    return node.meta.get(COLLECTIVE_META_KEY)


def bitcast_source_dtype(value: torch.fx.Node):
    """The dtype ``value``'s bytes had before dtype views and plain copies (``view(uint8)`` of an
    FP8 tensor gives the FP8 dtype)."""
    node = value
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and str(node.target) in _SAME_BYTES and node.args:
        if not isinstance(node.args[0], torch.fx.Node):
            break
        node = node.args[0]
    return getattr(node.meta.get("val"), "dtype", None) if isinstance(node, torch.fx.Node) else None


def record_collectives(gm: torch.fx.GraphModule, passes: dict[torch.fx.Node, str]) -> list[CollectiveRecord]:
    """Put a :class:`CollectiveRecord` on every collective op of ``gm`` (not on waits) and take
    the tracing annotation out of every node. Returns the records in graph order."""
    records = []
    for node in gm.graph.nodes:
        annotation = _take_annotation(node)
        if not is_collective(node) or node.target.__name__.split(".")[0] == "wait_tensor":
            continue
        op = _OPS.get(node.target.__name__.split(".")[0], node.target.__name__.split(".")[0])
        moved = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
        wire = getattr(moved.meta.get("val") if moved is not None else None, "dtype", None)
        source = bitcast_source_dtype(moved) if moved is not None else None
        result = node.meta.get("val")
        parameter, module_fqn, moves = annotation if annotation else (None, getattr(node.meta.get("fp8conf_provenance"), "module_fqn", None), None)
        pass_name = passes.get(node, "forward")
        if moves is not None:
            # What moves follows from the op: torch may copy a gather's annotation onto the
            # backward nodes it pairs with it (2.13 does), so the annotation alone cannot say.
            moves = {"all_reduce": "amax", "reduce_scatter": "gradient"}.get(op, "gradient" if pass_name == "backward" else "parameter")
        record = CollectiveRecord(
            op=op,
            parameter=parameter,
            module_fqn=module_fqn,
            pass_name=pass_name,
            moves=moves,
            wire_dtype=str(wire),
            element_size=wire.itemsize if isinstance(wire, torch.dtype) else 0,
            float8=is_fp8_dtype(wire) or is_fp8_dtype(source),
            source_dtype=str(source),
            result_bytes=int(result.numel() * result.element_size()) if isinstance(result, torch.Tensor) else 0,
        )
        node.meta[COLLECTIVE_META_KEY] = record
        records.append(record)
    return records


def _take_annotation(node):
    custom = node.meta.get("custom")
    if not custom or COLLECTIVE_ANNOTATION not in custom:
        return None
    rest = {k: v for k, v in custom.items() if k != COLLECTIVE_ANNOTATION}
    if rest:
        node.meta["custom"] = rest
    else:
        del node.meta["custom"]
    return tuple(custom[COLLECTIVE_ANNOTATION])
