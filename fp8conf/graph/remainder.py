"""The eager remainder of a regionally compiled graph, grouped into pieces Inductor can compile.

Once its FP8 regions are cut out (:mod:`fp8conf.graph.region_compile`), what is left of a graph
(norms, activations, residual adds, attention layout copies) would run one eager kernel per
op, where ``torch.compile`` fuses them. :func:`remainder_pieces` groups those nodes into maximal
acyclic pieces with torch's own ``CapabilityBasedPartitioner`` (which regional_inductor also
builds on), so that each piece can be cut out and compiled like a region, and each structurally
distinct piece compiled once.

A piece never holds a node of an FP8 region, a value of an FP8 dtype, or the tuple a compiled
region returns (its ``getitem`` stays eager), so it can neither swallow nor split a region; nor
an op that draws random numbers, mutates an input, is not an ATen op, or makes a value that is
not a tensor (or a tuple of tensors), since Inductor would change what those do or cannot
take them as a graph of their own. A piece with fewer than two ops that compute (views do not)
gains nothing from Inductor and stays eager.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Collection

import torch
import torch.fx
from torch.fx.passes.operator_support import OperatorSupportBase

from fp8conf.graph.roles import is_fp8_dtype

__all__ = ["remainder_pieces"]


def remainder_pieces(gm: torch.fx.GraphModule, keep_eager: Collection[str] = ()) -> list[list[torch.fx.Node]]:
    """The pieces of ``gm``'s eager nodes to compile, each a list of nodes in graph order and
    connected, the pieces in graph order. Reads the graph only. ``keep_eager`` names nodes that
    must stay eager (those of FP8 regions left uncompiled)."""
    from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner

    support = _RemainderSupport(frozenset(keep_eager))
    options = {}
    if "skip_horizontal_fusion" in inspect.signature(CapabilityBasedPartitioner.__init__).parameters:
        # Merging independent nodes (weight transposes of every block) into whichever piece
        # comes first would make the pieces of repeated blocks differ, and compiles grow with depth.
        options["skip_horizontal_fusion"] = True
    partitioner = CapabilityBasedPartitioner(gm, support, allows_single_node_partition=True, **options)
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    pieces = []
    for partition in partitioner.propose_partitions():
        # A torch that fuses independent nodes anyway: keep each connected component on its own
        # (a component of an acyclic piece is acyclic too).
        for component in _components(set(partition.nodes)):
            if sum(_computes(n) for n in component) >= 2:
                pieces.append(sorted(component, key=order.__getitem__))
    return sorted(pieces, key=lambda piece: order[piece[0]])


class _RemainderSupport(OperatorSupportBase):
    """Which nodes a piece may hold."""

    def __init__(self, keep_eager: frozenset[str]):
        self.keep_eager = keep_eager

    def is_node_supported(self, submodules, node: torch.fx.Node) -> bool:
        if node.op != "call_function" or node.name in self.keep_eager:
            return False
        if node.target is operator.getitem:
            # Only of a tuple made inside the piece: a region's tuple output is not a tensor input.
            source = node.args[0]
            return isinstance(source, torch.fx.Node) and self.is_node_supported(submodules, source) and _is_tensor(node.meta.get("val"))
        if not isinstance(node.target, torch._ops.OpOverload):
            return False
        if node.target._schema.is_mutable or torch.Tag.nondeterministic_seeded in node.target.tags:
            return False
        value = node.meta.get("val")
        values = value if isinstance(value, (tuple, list)) else (value,)
        inputs = [i.meta.get("val") for i in node.all_input_nodes]
        if not values or not all(_is_tensor(v) for v in [*values, *inputs]):
            return False
        return not any(is_fp8_dtype(v.dtype) for v in [*values, *inputs])


def _is_tensor(value) -> bool:
    return isinstance(value, torch.Tensor)


def _computes(node: torch.fx.Node) -> bool:
    """Whether ``node`` does work a fused kernel saves: not a view, not a ``getitem``."""
    if node.target is operator.getitem:
        return False
    returns = node.target._schema.returns
    return not (len(returns) == 1 and returns[0].alias_info is not None)


def _components(nodes: set[torch.fx.Node]) -> list[set[torch.fx.Node]]:
    components, seen = [], set()
    for start in nodes:
        if start in seen:
            continue
        component, stack = set(), [start]
        while stack:
            node = stack.pop()
            if node in component:
                continue
            component.add(node)
            stack += [n for n in (*node.all_input_nodes, *node.users) if n in nodes and n not in component]
        seen |= component
        components.append(component)
    return components
