"""The eager remainder of a regionally compiled graph, grouped into pieces Inductor can compile.

Once its FP8 regions are cut out (:mod:`fp8conf.graph.region_compile`), what is left of a graph
(norms, activations, residual adds, attention layout copies) would run one eager kernel per
op, where ``torch.compile`` fuses them. :func:`remainder_pieces` groups those nodes into
acyclic pieces, so that each can be cut out with ``fuse_by_partitions`` and compiled like a
region, each structurally distinct piece once.

A piece never holds a node of an FP8 region, a value of an FP8 dtype, or the tuple a compiled
region returns (its ``getitem`` stays eager), so it can neither swallow nor split a region; nor
an op that draws random numbers, mutates an input, is not an ATen op, or makes a value that is
not a tensor (or a tuple of tensors), since Inductor would change what those do or cannot
take them as a graph of their own. A piece with fewer than two ops that compute (views do not)
gains nothing from Inductor and stays eager.

Pieces are grouped by **barrier level**: a node's level is the largest number of eager nodes
(those that have inputs) on a path to it, and a piece is a set of compilable nodes of one level
joined by direct edges. A path that leaves a piece through an eager node reaches only higher
levels, and one that leaves it through a compilable node of the same level would be an edge of
the piece, so no path leaves a piece and comes back: every piece can be cut out alone. On these
graphs it finds the pieces ``CapabilityBasedPartitioner`` (without horizontal fusion) finds, up to
where a few views and recomputed values fall, in one pass over the graph; the partitioner's
reachability sets grow with the square of the graph (2.3 s for the backward of a 16-block Llama
on CPU, against 0.02 s).
"""

from __future__ import annotations

import operator
from collections.abc import Collection

import torch
import torch.fx

from fp8conf.graph.roles import is_fp8_dtype

__all__ = ["remainder_pieces"]


def remainder_pieces(gm: torch.fx.GraphModule, keep_eager: Collection[str] = ()) -> list[list[torch.fx.Node]]:
    """The pieces of ``gm``'s eager nodes to compile, each a list of connected nodes in graph
    order, the pieces in graph order. Reads the graph only. ``keep_eager`` names nodes that must
    stay eager (those of FP8 regions left uncompiled)."""
    keep_eager = frozenset(keep_eager)
    level: dict[torch.fx.Node, int] = {}
    parent: dict[torch.fx.Node, torch.fx.Node] = {}  # union-find over the compilable nodes
    order = {}
    for i, node in enumerate(gm.graph.nodes):
        order[node] = i
        # Crossing an eager node with inputs raises the level: a path may leave a piece there.
        level[node] = max((level[n] + (n not in parent and bool(n.all_input_nodes)) for n in node.all_input_nodes), default=0)
        if not _may_compile(node, keep_eager, parent):
            continue
        parent[node] = node
        for n in node.all_input_nodes:
            if n in parent and level[n] == level[node]:
                parent[_root(parent, n)] = _root(parent, node)
    groups: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in parent:  # in graph order
        groups.setdefault(_root(parent, node), []).append(node)
    pieces = [group for group in groups.values() if sum(map(_computes, group)) >= 2]
    return sorted(pieces, key=lambda piece: order[piece[0]])


def _root(parent, node):
    while parent[node] is not node:
        parent[node] = parent[parent[node]]
        node = parent[node]
    return node


def _may_compile(node: torch.fx.Node, keep_eager: frozenset[str], compilable) -> bool:
    """Whether a piece may hold ``node``; ``compilable`` holds the earlier nodes that may."""
    if node.op != "call_function" or node.name in keep_eager:
        return False
    if node.target is operator.getitem:
        # Only of a tuple made inside a piece: a region's tuple output is not a tensor input.
        return node.args[0] in compilable and _is_tensor(node.meta.get("val"))
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
