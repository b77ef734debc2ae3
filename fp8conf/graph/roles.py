"""What each node of a joint graph does for FP8: the op roles.

A role is decided by the node's target *and* the dtypes of its operands, never by its name:

* ``compute``: a scaled matmul (``aten._scaled_mm``, ``_scaled_mm_v2``, ``_scaled_grouped_mm``,
  ``_scaled_grouped_mm_v2``, the weight-gradient accumulation ``_scaled_addmm_`` where torch has
  it, ``fp8conf.scaled_mm_e8m0``, and a trainer's own ops declared with
  :func:`register_compute_op`) whose two matrix operands both have a low-precision dtype: FP8
  (e4m3, e5m2) or packed FP4 (``float4_e2m1fn_x2``, NVFP4 with e4m3 block scales);
  :func:`compute_format` says which. A scaled op fed a high-precision operand, or merely
  carrying an FP8 scale, is not low-precision compute;
* ``cast``: a node that makes an FP8 (or FP4) tensor from high-precision tensors (a dtype view, ``view(dtype)``,
  is not one: it reinterprets bytes that are FP8 already, as after a float8 all-gather);
* ``amax``: an absolute value or max reduction feeding a scale;
* ``scale``: arithmetic between an ``amax`` and the scale operand of a compute node or the
  input of a cast (reciprocals, clamps, power-of-2 rounding ...);
* ``input_boundary``: a placeholder whose value is FP8 (a GraphPP callable receiving a tensor
  quantized elsewhere);
* ``other``: everything else.
"""

from __future__ import annotations

import enum

import torch
import torch.fx

from fp8conf.arguments import require
from fp8conf.errors import FP8ConfigError

__all__ = [
    "OpRole", "FP8_DTYPES", "FP4_DTYPES", "register_compute_op", "registered_compute_ops", "is_fp8_dtype", "is_low_precision_dtype", "is_fp8_compute",
    "compute_format", "operand_positions", "matrix_operands", "scale_operands", "classify_node", "op_roles",
]


class OpRole(str, enum.Enum):
    COMPUTE = "compute"
    CAST = "cast"
    AMAX = "amax"
    SCALE = "scale"
    INPUT_BOUNDARY = "input_boundary"
    OTHER = "other"


FP8_DTYPES = frozenset(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)
)

#: Packed FP4 dtypes (two e2m1 values a byte: NVFP4's and MXFP4's element type), where torch has them.
FP4_DTYPES = frozenset(getattr(torch, name) for name in ("float4_e2m1fn_x2",) if hasattr(torch, name))

# Per scaled matmul (as ``str(node.target)``): the positions of its two matrix operands, and of
# its scales as (position, keyword) pairs. The second API (``_v2``, what ``F.scaled_mm`` and
# ``F.scaled_grouped_mm`` lower to) takes lists of scales, ``(a, b, scale_a[], recipe_a[],
# swizzle_a[], scale_b[], ...)``; the in-place accumulation ``_scaled_addmm_(acc, a, b, scale_a,
# scale_b, ...)`` (a weight gradient fused into its accumulator) reads its operands after the
# accumulator.
_FIRST_API = ((0, 1), ((2, "scale_a"), (3, "scale_b")))
_SECOND_API = ((0, 1), ((2, "scale_a"), (5, "scale_b")))
_OPERANDS = {
    "aten._scaled_mm.default": _FIRST_API,
    "aten._scaled_mm.out": _FIRST_API,
    "aten._scaled_grouped_mm.default": _FIRST_API,
    "fp8conf.scaled_mm_e8m0.default": _FIRST_API,
    "aten._scaled_mm_v2.default": _SECOND_API,
    "aten._scaled_mm_v2.out": _SECOND_API,
    "aten._scaled_grouped_mm_v2.default": _SECOND_API,
    "aten._scaled_addmm_.default": ((1, 2), ((3, "scale_a"), (4, "scale_b"))),
    "aten._scaled_addmm.default": ((1, 2), ((3, "scale_a"), (4, "scale_b"))),
}

#: The ops :func:`register_compute_op` declared, as their overloads.
_REGISTERED: dict[str, object] = {}
#: ``_OPERANDS``' entry (or None) of each call target seen: ``str(target)`` of an op is a
#: formatting call, and the passes ask it of every node, several times over. Emptied whenever
#: :func:`register_compute_op` declares an op.
_ENTRY_OF_TARGET: dict[object, tuple | None] = {}


def register_compute_op(op, *, operands: tuple[int, int] = (0, 1), scales=((2, "scale_a"), (3, "scale_b"))) -> None:
    """Declare a trainer's own op a scaled matmul: low-precision compute where its two matrix
    operands (the positions ``operands``) are both FP8 or packed FP4, and ``scales`` the
    ``(position, keyword)`` pairs of its scale arguments (a tensor or a list of them), which the
    regions keep with it. ``op`` is a ``torch._ops.OpOverload`` or, for every overload, its
    ``OpOverloadPacket`` (``torch.ops.mytrainer.scaled_addmm_``). Every pass of fp8conf then
    attributes, counts, tags and keeps it as it does torch's scaled matmuls; registering an op
    again replaces what it declared."""
    overloads = _overloads(op)
    if (
        not isinstance(operands, tuple) or len(operands) != 2 or not all(isinstance(i, int) and i >= 0 for i in operands)
        or operands[0] == operands[1]
    ):
        raise FP8ConfigError(f"register_compute_op(operands=...): expected two distinct argument positions, got {operands!r}")
    scales = tuple(scales)
    if not all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], int) and p[0] >= 0 and isinstance(p[1], str) for p in scales):
        raise FP8ConfigError(f"register_compute_op(scales=...): expected (position, keyword) pairs, got {scales!r}")
    for overload in overloads:
        _OPERANDS[str(overload)] = (operands, scales)
        _REGISTERED[str(overload)] = overload
    _ENTRY_OF_TARGET.clear()


def registered_compute_ops() -> tuple[tuple[object, tuple[int, int], tuple[int, ...]], ...]:
    """``(overload, operand positions, scale positions)`` of every op :func:`register_compute_op`
    declared, in registration order: what an adapter declares to the conformance suite."""
    return tuple((op, _OPERANDS[name][0], tuple(p for p, _ in _OPERANDS[name][1])) for name, op in _REGISTERED.items())


def _overloads(op) -> list:
    if isinstance(op, torch._ops.OpOverload):
        return [op]
    if isinstance(op, torch._ops.OpOverloadPacket):
        return [getattr(op, name) for name in op.overloads()]
    raise FP8ConfigError(
        f"register_compute_op(op=...): expected a torch._ops.OpOverload or OpOverloadPacket "
        f"(torch.ops.mylib.my_scaled_mm), got {type(op).__qualname__}"
    )

_AMAX_TARGETS = frozenset({"aten.abs.default", "aten.amax.default", "aten.max.default", "aten.max.dim"})


def _dtype(value) -> torch.dtype | None:
    if isinstance(value, torch.fx.Node):
        value = value.meta.get("val")
    return getattr(value, "dtype", None)


def is_fp8_dtype(dtype) -> bool:
    return dtype in FP8_DTYPES


def is_low_precision_dtype(dtype) -> bool:
    """An FP8 or packed FP4 dtype: an operand dtype of low-precision compute."""
    return dtype in FP8_DTYPES or dtype in FP4_DTYPES


_UNSEEN = object()


def _entry(target):
    """``_OPERANDS``' entry of a call target, None for any other op. (A graph's call targets are
    hashable: torch.fx files every node under its target in the graph's lookup table.)"""
    entry = _ENTRY_OF_TARGET.get(target, _UNSEEN)
    if entry is _UNSEEN:
        entry = _ENTRY_OF_TARGET[target] = _OPERANDS.get(str(target))
    return entry


def is_scaled_mm(node: torch.fx.Node) -> bool:
    """A call of one of the scaled matmuls, whatever its operands."""
    return node.op == "call_function" and _entry(node.target) is not None


def operand_positions(target: str) -> tuple[int, int] | None:
    """Positions of the two matrix operands of the scaled matmul ``target`` (as ``str(target)``),
    ``None`` for any other op."""
    entry = _OPERANDS.get(target)
    return None if entry is None else entry[0]


def matrix_operands(node: torch.fx.Node) -> tuple:
    """The two matrix operands of a scaled matmul (nodes or whatever the call holds there),
    ``()`` for any other node or a call too short to have them."""
    if not is_scaled_mm(node):
        return ()
    first, second = _entry(node.target)[0]
    if len(node.args) <= second:
        return ()
    return node.args[first], node.args[second]


def scale_operands(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The scales a scaled matmul reads: ``scale_a`` and ``scale_b``, two tensors for the first
    API, two lists of tensors for the second (see ``_OPERANDS``)."""
    if not is_scaled_mm(node):
        return []
    values = []
    for position, name in _entry(node.target)[1]:
        values.extend(_as_list(_argument(node, position, name)))
    return [v for v in values if isinstance(v, torch.fx.Node)]


def _argument(node: torch.fx.Node, position: int, name: str):
    return node.args[position] if len(node.args) > position else node.kwargs.get(name)


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def is_unjudged_scaled_mm(node: torch.fx.Node) -> bool:
    """A scaled matmul whose matrix operands record no dtype (no ``node.meta["val"]``): whether
    it computes in low precision cannot be told from the graph."""
    operands = matrix_operands(node)
    return bool(operands) and any(_dtype(a) is None for a in operands)


def compute_format(node: torch.fx.Node) -> str | None:
    """``"float8"`` or ``"float4"`` for a scaled matmul whose two matrix operands are both of
    that family (an FP8 and an FP4 operand together: ``"float4"``), ``None`` for anything else."""
    dtypes = [_dtype(a) for a in matrix_operands(node)]
    if len(dtypes) != 2 or not all(is_low_precision_dtype(d) for d in dtypes):
        return None
    return "float4" if any(d in FP4_DTYPES for d in dtypes) else "float8"


def is_fp8_compute(node: torch.fx.Node) -> bool:
    """A scaled matmul whose two matrix operands are both low precision (FP8 or packed FP4):
    the compute every pass of fp8conf keeps, attributes and counts."""
    require(node, "node", "is_fp8_compute", "node")
    return compute_format(node) is not None


def classify_node(node: torch.fx.Node) -> OpRole:
    """The role of ``node`` judged from itself alone (``scale`` needs the graph: see :func:`op_roles`)."""
    require(node, "node", "classify_node", "node")
    if node.op == "placeholder":
        return OpRole.INPUT_BOUNDARY if is_low_precision_dtype(_dtype(node)) else OpRole.OTHER
    if node.op != "call_function":
        return OpRole.OTHER
    if is_fp8_compute(node):
        return OpRole.COMPUTE
    if (
        is_low_precision_dtype(_dtype(node))
        and str(node.target) != "aten.view.dtype"
        and not any(is_low_precision_dtype(_dtype(i)) for i in node.all_input_nodes)
    ):
        return OpRole.CAST
    if str(node.target) in _AMAX_TARGETS and not is_fp8_dtype(_dtype(node)):
        return OpRole.AMAX
    return OpRole.OTHER


def op_roles(graph: torch.fx.Graph) -> dict[torch.fx.Node, OpRole]:
    """The role of every node; ``scale`` nodes lie between an amax and a compute's scale or a cast."""
    require(graph, "graph", "op_roles", "graph")
    roles = {node: classify_node(node) for node in graph.nodes}
    after_amax = set()
    for node in graph.nodes:
        if roles[node] is OpRole.AMAX or any(i in after_amax for i in node.all_input_nodes):
            after_amax.add(node)
    feeds_scale = set()
    for node in reversed(graph.nodes):
        if roles[node] is OpRole.COMPUTE:
            feeds_scale.update(scale_operands(node))
        elif roles[node] is OpRole.CAST or node in feeds_scale:
            feeds_scale.update(node.all_input_nodes)
    for node in graph.nodes:
        if roles[node] is OpRole.OTHER and node.op == "call_function" and node in after_amax and node in feeds_scale:
            roles[node] = OpRole.SCALE
    return roles
