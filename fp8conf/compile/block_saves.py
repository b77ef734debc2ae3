"""Equal blocks saving equal values: the min-cut partitioner's ties broken one way for all of them.

The min-cut partitioner (:mod:`fp8conf.compile.partition`) decides for every block of a model on
its own which forward values the backward keeps and which it recomputes. Where two choices cost
the same it breaks the tie by where the block sits in the graph, so a block can come out of the
cut unlike its equals. In a Llama the first block is fed by the embedding, which the backward
keeps anyway: the partitioner keeps the attention output and recomputes the residual sum from it
for that block, where for every other block it keeps the sum. That block's backward is then a
unit of its own, and regional compilation (:mod:`fp8conf.compile.region_compile`) compiles one
more Inductor graph as large as a block's backward: seconds of the first step, at any depth.

:func:`align_block_saves` rewrites the two graphs of such a cut so that each block that differs
from the pattern most of its equals follow saves and recomputes what they do: a value they keep
is handed over from the forward (which computes it anyway) instead of recomputed, and the values
only that recomputation read are handed over no more. It does so only where the result is exactly
the common pattern and keeps no more bytes than before; otherwise the block is left as cut.
Blocks are equal when their forward ops, in graph order, are the same ops; a node's place in its
block's forward is what names it across blocks.
"""

from __future__ import annotations

import collections

import torch
import torch.fx
import torch.utils._pytree as pytree

from fp8conf.graph.provenance import get_block

__all__ = ["align_block_saves"]


def align_block_saves(flat: torch.fx.GraphModule, forward: torch.fx.GraphModule, backward: torch.fx.GraphModule,
                      num_forward_outputs: int) -> list[str]:
    """Rewrite the graphs of ``forward`` and ``backward`` (the min-cut partitioner's cut of
    ``flat``, node names kept) in place so that equal blocks save and recompute equal values;
    returns the blocks rewritten. Where it rewrote any, the modules' code is stale: make new
    modules of the graphs (generating the code of a deep model's backward takes a second)."""
    place = _forward_places(flat)
    if not place:
        return []
    forward_nodes = {n.name: n for n in forward.graph.nodes}
    output = forward.graph.find_nodes(op="output")[0]
    outputs = list(pytree.tree_leaves(output.args[0], is_leaf=lambda x: x is None))
    saved = {n.name for n in outputs[num_forward_outputs:] if n is not None}
    placeholders = {p.name: p for p in backward.graph.find_nodes(op="placeholder")}
    recomputed = {n.name: n for n in backward.graph.nodes
                  if n.op == "call_function" and n.name in place and n.meta.get("partitioner_tag") != "is_backward"}
    pattern = collections.defaultdict(lambda: (set(), set()))
    for name in saved:
        if name in place and name in placeholders:
            block, i = place[name]
            pattern[block][0].add(i)
    for name in recomputed:
        block, i = place[name]
        pattern[block][1].add(i)
    names_of = _names_by_place(place)
    rewritten = []
    for equals in _equal_blocks(flat, place):
        keys = {b: (frozenset(pattern[b][0]), frozenset(pattern[b][1])) for b in equals}
        counts = collections.Counter(keys.values())
        # The pattern most blocks follow; between equally many, that of the block latest in the
        # graph (the first block, fed by the embedding, is the one unlike the others).
        latest = {key: i for i, key in enumerate(keys[b] for b in equals)}
        common = max(counts, key=lambda key: (counts[key], latest[key]))
        for block in equals:
            if keys[block] != common and _align(block, keys[block], common, names_of[block], forward_nodes,
                                                placeholders, recomputed, backward):
                rewritten.append(block)
    if rewritten:
        kept = set(placeholders) & {p.name for p in backward.graph.find_nodes(op="placeholder")}
        fresh = outputs[:num_forward_outputs] + [n for n in outputs[num_forward_outputs:] if n is None or n.name in kept]
        fresh += [forward_nodes[p.name] for p in backward.graph.find_nodes(op="placeholder")
                  if p.name not in saved and p.name in forward_nodes]
        output.args = (type(output.args[0])(fresh),)
    return rewritten


def _forward_places(flat) -> dict[str, tuple[str, int]]:
    """Each forward op of a repeated block: its block and its place among the block's forward ops."""
    place, counts = {}, collections.Counter()
    for node in flat.graph.nodes:
        if node.op != "call_function" or node.meta.get("partitioner_tag") == "is_backward":
            continue
        block = get_block(node)
        if block:
            place[node.name] = (block, counts[block])
            counts[block] += 1
    return place


def _names_by_place(place) -> dict[str, list[str]]:
    names = collections.defaultdict(list)
    for name, (block, _) in place.items():  # in graph order, so index i is at position i
        names[block].append(name)
    return names


def _equal_blocks(flat, place) -> list[list[str]]:
    """The blocks grouped by their forward ops (targets in order)."""
    ops = collections.defaultdict(list)
    nodes = {n.name: n for n in flat.graph.nodes}
    for name, (block, _) in place.items():
        ops[block].append(nodes[name].target)
    groups = collections.defaultdict(list)
    for block, targets in ops.items():
        groups[tuple(targets)].append(block)
    return [blocks for blocks in groups.values() if len(blocks) > 1]


def _align(block, have, want, names, forward_nodes, placeholders, recomputed, backward) -> bool:
    """Make ``block`` save and recompute as ``want`` (places: saved, recomputed), when that is
    reached exactly by handing values over instead of recomputing them; ``False`` (nothing
    changed) otherwise."""
    (saves, recomputes), (want_saves, want_recomputes) = have, want
    if not want_recomputes <= recomputes:
        return False  # the block would have to recompute what it now keeps
    hand_over = [names[i] for i in sorted(want_saves - saves)]
    if not all(n in forward_nodes and n in recomputed for n in hand_over):
        return False
    dropped = {names[i] for i in recomputes - want_recomputes} | set(hand_over)
    # Every recomputed node given up must lose all its users, and every value no longer saved too.
    for name in dropped - set(hand_over):
        if any(u.name not in dropped for u in recomputed[name].users):
            return False
    unsaved = [names[i] for i in sorted(saves - want_saves)]
    if any(u.name not in dropped for name in unsaved for u in placeholders[name].users):
        return False
    if sum(_bytes(forward_nodes[n]) for n in hand_over) > sum(_bytes(placeholders[n]) for n in unsaved):
        return False
    graph = backward.graph
    first_tangent = next((p for p in graph.find_nodes(op="placeholder") if p.name.startswith("tangents")), None)
    for name in hand_over:
        node = recomputed[name]
        with graph.inserting_before(first_tangent) if first_tangent is not None else graph.inserting_before(next(iter(graph.nodes))):
            handed = graph.placeholder(name + "_saved")
        handed.meta = dict(forward_nodes[name].meta)
        node.replace_all_uses_with(handed)
        graph.erase_node(node)
        # The forward output and the backward input it feeds share one name (how the cut pairs
        # them); an erased node's name stays taken in the graph's namespace, so it is set as is.
        handed.name = handed.target = name
        graph._graph_namespace._rename_object(handed, name)
    for node in reversed(list(graph.nodes)):
        if node.name in dropped and node.op == "call_function" and not node.users:
            graph.erase_node(node)
    for name in unsaved:
        if not placeholders[name].users:
            graph.erase_node(placeholders[name])
    return True


def _bytes(node) -> int:
    value = node.meta.get("val")
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0
