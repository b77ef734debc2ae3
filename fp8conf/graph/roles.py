"""What each node of a joint graph does for FP8: the op roles.

A role is decided by the node's target *and* the dtypes of its operands, never by its name:

* ``compute``: a scaled matmul (``aten._scaled_mm``, ``_scaled_mm_v2``, ``_scaled_grouped_mm``,
  ``fp8conf.scaled_mm_e8m0``) whose two matrix operands both have an FP8 dtype. A scaled op
  fed a high-precision operand, or merely carrying an FP8 scale, is not FP8 compute;
* ``cast``: a node that makes an FP8 tensor from non-FP8 tensors (a dtype view, ``view(dtype)``,
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

__all__ = ["OpRole", "FP8_DTYPES", "SCALED_MM_TARGETS", "is_fp8_dtype", "is_fp8_compute", "scale_operands", "classify_node", "op_roles"]


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

#: Targets (as ``str(node.target)``) of the scaled matmuls that can be FP8 compute.
SCALED_MM_TARGETS = frozenset(
    {
        "aten._scaled_mm.default",
        "aten._scaled_mm_v2.default",
        "aten._scaled_grouped_mm.default",
        "aten._scaled_grouped_mm_v2.default",
        "fp8conf.scaled_mm_e8m0.default",
    }
)

_AMAX_TARGETS = frozenset({"aten.abs.default", "aten.amax.default", "aten.max.default", "aten.max.dim"})


def _dtype(value) -> torch.dtype | None:
    if isinstance(value, torch.fx.Node):
        value = value.meta.get("val")
    return getattr(value, "dtype", None)


def is_fp8_dtype(dtype) -> bool:
    return dtype in FP8_DTYPES


def is_scaled_mm(node: torch.fx.Node) -> bool:
    """A call of one of the scaled matmuls, whatever its operands."""
    return node.op == "call_function" and str(node.target) in SCALED_MM_TARGETS


def scale_operands(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The scales a scaled matmul reads: ``scale_a`` and ``scale_b``, two tensors for the first
    API (``_scaled_mm``, ``_scaled_grouped_mm``, fp8conf's e8m0 op), two lists of tensors for the
    second (``_scaled_mm_v2``, ``_scaled_grouped_mm_v2``: what ``F.scaled_mm`` and
    ``F.scaled_grouped_mm`` lower to, ``(a, b, scale_a[], recipe_a[], swizzle_a[], scale_b[], ...)``)."""
    if str(node.target).endswith("_v2.default"):
        values = [*_as_list(_argument(node, 2, "scale_a")), *_as_list(_argument(node, 5, "scale_b"))]
    else:
        values = [_argument(node, 2, "scale_a"), _argument(node, 3, "scale_b")]
    return [v for v in values if isinstance(v, torch.fx.Node)]


def _argument(node: torch.fx.Node, position: int, name: str):
    return node.args[position] if len(node.args) > position else node.kwargs.get(name)


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def is_unjudged_scaled_mm(node: torch.fx.Node) -> bool:
    """A scaled matmul whose matrix operands record no dtype (no ``node.meta["val"]``): whether
    it computes in FP8 cannot be told from the graph."""
    return is_scaled_mm(node) and len(node.args) >= 2 and (_dtype(node.args[0]) is None or _dtype(node.args[1]) is None)


def is_fp8_compute(node: torch.fx.Node) -> bool:
    """A scaled matmul whose two matrix operands are both FP8."""
    require(node, "node", "is_fp8_compute", "node")
    if not is_scaled_mm(node) or len(node.args) < 2:
        return False
    return is_fp8_dtype(_dtype(node.args[0])) and is_fp8_dtype(_dtype(node.args[1]))


def classify_node(node: torch.fx.Node) -> OpRole:
    """The role of ``node`` judged from itself alone (``scale`` needs the graph: see :func:`op_roles`)."""
    require(node, "node", "classify_node", "node")
    if node.op == "placeholder":
        return OpRole.INPUT_BOUNDARY if is_fp8_dtype(_dtype(node)) else OpRole.OTHER
    if node.op != "call_function":
        return OpRole.OTHER
    if is_fp8_compute(node):
        return OpRole.COMPUTE
    if is_fp8_dtype(_dtype(node)) and str(node.target) != "aten.view.dtype" and not any(is_fp8_dtype(_dtype(i)) for i in node.all_input_nodes):
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
