"""The rest of a regionally compiled graph, grouped into pieces Inductor can compile.

Outside its FP8 regions a graph has norms, activations, residual adds and attention layout
copies, which would run one eager kernel per op where ``torch.compile`` fuses them.
:func:`remainder_pieces` groups those nodes into acyclic pieces, so that each can be cut out with
``fuse_by_partitions`` and compiled like a region, each structurally distinct piece once. Given
the regions themselves (still in the graph), it groups each region with the nodes around it,
taking the region whole as if it were one node: one Inductor graph then fuses an FP8 cast with
the norm or SiLU product that makes its input, and a block is a few compiled calls instead of
one per region and one per piece between them.

A piece never holds part of a region, nor, outside a region, a value of an FP8 dtype or the
tuple a compiled region returns (its ``getitem`` stays eager); nor an op that draws random
numbers, mutates an input, is not an ATen op, or makes a value that is not a tensor (or a tuple
of tensors), since Inductor would change what those do or cannot take them as a graph of their
own. Attention (SDPA) is held: its ops are tagged as seeded, but draw nothing without dropout,
and the numbers among its results (sequence lengths) reach no node. A piece without a region
and with fewer than two ops that compute (views do not) gains nothing from Inductor and stays
eager, unless its op's eager CUDA kernel waits for the device (the embedding's backward).

Pieces are grouped by **barrier level**: a node's level is the largest number of barriers on a
path to it, a barrier being an eager node with inputs, or an edge from one repeated block into
another (a piece never spans two blocks, so the pieces of identical blocks are identical). A
piece is a set of compilable nodes of one level joined by direct edges. A path that leaves a
piece through a barrier reaches only higher levels, and one that leaves it through a compilable
node of the same level would be an edge of the piece, so no path leaves a piece and comes back:
every piece can be cut out alone. A region taken whole is convex, so the graph with each region
drawn as one node is still acyclic and the argument holds there. Last, a piece whose values all
go to one other piece of its block joins that piece (what a block's backward recomputes from the
values its forward saved: one compile and one call fewer, and no buffer written out between
them). Before that join, on these graphs it finds the
pieces ``CapabilityBasedPartitioner`` (without horizontal fusion) finds, up to where a few views
and recomputed values fall, in one pass over the graph; the partitioner's reachability sets grow
with the square of the graph (2.3 s for the backward of a 16-block Llama on CPU, against 0.02 s).
"""

from __future__ import annotations

import heapq
import operator
from collections.abc import Collection, Hashable, Mapping, Sequence

import torch
import torch.fx

from fp8conf.graph.roles import is_fp8_dtype

__all__ = ["remainder_pieces", "blocks_from_regions"]


def remainder_pieces(gm: torch.fx.GraphModule, keep_eager: Collection[str] = (),
                     regions: Sequence[Collection[torch.fx.Node]] = (),
                     blocks: Mapping[torch.fx.Node, Hashable | None] | None = None) -> list[list[torch.fx.Node]]:
    """The pieces of ``gm``'s eager nodes to compile, each a list of connected nodes in graph
    order, the pieces in graph order. Reads the graph only. ``keep_eager`` names nodes that must
    stay eager (those of FP8 regions left uncompiled).

    ``regions`` are node groups still in ``gm`` (complete FP8 regions, each convex) to be
    compiled together with the remainder around them: each is taken whole, as if it were one
    node, and lands in exactly one piece, which is then returned however little else it holds.
    Without them, FP8 values keep a node out of every piece (the regions were cut out before).
    ``blocks`` names the repeated block of each node (``"layers.3"``, see
    :func:`fp8conf.graph.provenance.get_block`; a region's is that of its nodes): a piece never
    spans two blocks, so that the pieces of identical blocks are identical and compile once. A
    node of unknown block (``None``, or missing) goes with its input of the highest level.
    :func:`blocks_from_regions` makes such a map for a graph that records none."""
    keep_eager = frozenset(keep_eager)
    nodes = list(gm.graph.nodes)
    order = {node: i for i, node in enumerate(nodes)}
    atom_of: dict[torch.fx.Node, Hashable] = {}  # a region's nodes share one atom; others are their own
    for index, region in enumerate(regions):
        atom_of.update(dict.fromkeys(region, ("region", index)))
    members: dict[Hashable, list[torch.fx.Node]] = {}
    for node in nodes:
        members.setdefault(atom_of.get(node, node), []).append(node)
    preds: dict[Hashable, set] = {atom: set() for atom in members}
    for node in nodes:
        atom = atom_of.get(node, node)
        preds[atom].update(atom_of.get(i, i) for i in node.all_input_nodes if atom_of.get(i, i) != atom)

    region_atoms = set(atom_of.values())
    block = _atom_blocks(members, blocks)
    level: dict[Hashable, int] = {}
    parent: dict[Hashable, Hashable] = {}  # union-find over the compilable atoms
    compilable: set[torch.fx.Node] = set()
    for atom in _topological(members, preds, order):
        # Crossing an eager atom with inputs raises the level: a path may leave a piece there;
        # so does passing from one block into another.
        here = block[atom]
        if here is None:  # unknown: the block of the input reached last
            here = max(((level[b], block[b]) for b in preds[atom] if b in parent), default=(0, None), key=lambda t: t[0])[1]
            block[atom] = here
        level[atom] = max((level[b] + (_has_inputs(members[b]) if b not in parent else block[b] != here)
                           for b in preds[atom]), default=0)
        if atom not in region_atoms and not _may_compile(atom, keep_eager, compilable):
            continue
        compilable.update(members[atom])
        parent[atom] = atom
        for b in preds[atom]:
            if b in parent and level[b] == level[atom]:
                parent[_root(parent, b)] = _root(parent, atom)
    groups: dict[Hashable, list[torch.fx.Node]] = {}
    for atom in parent:
        groups.setdefault(_root(parent, atom), []).extend(members[atom])
    pieces = [group for group in groups.values()
              if any(n in atom_of for n in group) or sum(_computes(n) for n in group if n not in atom_of) >= 2
              or any(map(_waits_for_the_device, group))]
    pieces = _merge_into_consumers(pieces, blocks)
    _attach_input_views(pieces, compilable, atom_of, nodes, blocks)
    return sorted((sorted(piece, key=order.__getitem__) for piece in pieces), key=lambda piece: order[piece[0]])


def _topological(members, preds, order):
    """The atoms in an order where each follows its predecessors, ties broken by graph order."""
    waiting = {atom: len(p) for atom, p in preds.items()}
    succs: dict[Hashable, list] = {atom: [] for atom in preds}
    for atom, p in preds.items():
        for b in p:
            succs[b].append(atom)
    first = {atom: order[m[0]] for atom, m in members.items()}
    ready = [(first[a], i, a) for i, a in enumerate(preds) if not waiting[a]]
    heapq.heapify(ready)
    counter = len(ready)
    while ready:
        _, _, atom = heapq.heappop(ready)
        yield atom
        for s in succs[atom]:
            waiting[s] -= 1
            if not waiting[s]:
                counter += 1
                heapq.heappush(ready, (first[s], counter, s))


def _atom_blocks(members, blocks) -> dict[Hashable, Hashable | None]:
    """Each atom's block: a node's own, a region's that of its first node that has one."""
    if blocks is None:
        return dict.fromkeys(members, "")
    return {atom: next((blocks[n] for n in nodes if blocks.get(n) is not None), None) for atom, nodes in members.items()}


def blocks_from_regions(gm: torch.fx.GraphModule, regions: Sequence[Collection[torch.fx.Node]],
                        region_blocks: Sequence[Hashable]) -> dict[torch.fx.Node, Hashable | None]:
    """A block for each node of a graph that records none, from its regions' blocks
    (``region_blocks``, say :func:`~fp8conf.graph.provenance.repeated_block` of each region's
    module): a region's nodes are in its block, every other node in that of the next region in
    graph order (the residual add and the norm before a block's first projection belong to that
    block); nodes after the last region are of unknown block."""
    owner = {n: block for region, block in zip(regions, region_blocks, strict=True) for n in region}
    out, following = {}, None
    for node in reversed(gm.graph.nodes):
        following = owner.get(node, following)
        out[node] = following
    return out


def _has_inputs(nodes) -> bool:
    return any(n.all_input_nodes for n in nodes)


def _merge_into_consumers(pieces, blocks) -> list[list[torch.fx.Node]]:
    """Each piece whose values are all used in one other piece of its block, joined to that piece.

    In a backward such pieces are what a block recomputes from the values its forward saved (a
    norm's statistics, the SiLU product a projection's weight gradient reads): they depend on
    graph inputs only, so they sit below the barrier the gradient from the next block raises.
    Apart, each is a compiled call and an Inductor compile of its own, and its output (as large
    as the FFN's hidden activation) is written out, held and read back; joined, Inductor fuses it
    into the consumer's kernels. Joining keeps every piece one that can be cut out alone: a
    piece's consumer is of a higher level (a direct edge between pieces of one level and block
    would have joined them), so no path leads from the consumer back to it; and a joined group's
    values leave it only from its consumer, the member of the highest level, so the argument
    holds again for a piece that feeds any of its members (a chain of pieces ends in one),
    whatever order they are taken in.
    """
    blocks = blocks or {}
    piece_of = {n: i for i, piece in enumerate(pieces) for n in piece}
    block_of = [next((blocks[n] for n in piece if blocks.get(n) is not None), None) for piece in pieces]
    into = list(range(len(pieces)))  # the piece each has joined (itself when none)
    for i, piece in enumerate(pieces):
        inside = set(piece)
        homes = {piece_of.get(u) for n in piece for u in n.users if u not in inside}
        if len(homes) == 1 and None not in homes:
            (target,) = homes
            if block_of[target] == block_of[i]:
                into[i] = target

    def home(i):
        while into[i] != i:
            i = into[i]
        return i

    joined: dict[int, list[torch.fx.Node]] = {}
    for i, piece in enumerate(pieces):
        joined.setdefault(home(i), []).extend(piece)
    return list(joined.values())


def _attach_input_views(pieces, compilable, atom_of, nodes, blocks) -> None:
    """Put each compilable node made from graph inputs alone (a weight's transpose, a saved
    value's power), where all its users are in one piece of its own block, into that piece: no
    path from a piece can reach such a node, so the piece stays one that can be cut out alone."""
    piece_of = {n: i for i, piece in enumerate(pieces) for n in piece}
    blocks = blocks or {}
    piece_block = [next((blocks[n] for n in piece if blocks.get(n) is not None), None) for piece in pieces]
    sources: set[torch.fx.Node] = set()  # made from graph inputs alone, through compilable nodes outside every piece
    for node in nodes:
        if node in compilable and node not in piece_of and node not in atom_of and all(
                i.op in ("placeholder", "get_attr") or i in sources for i in node.all_input_nodes):
            sources.add(node)
    for node in reversed(nodes):  # users first, so that a chain of them moves in whole
        if node not in sources or not node.users:
            continue
        homes = {piece_of.get(u) for u in node.users}
        if len(homes) == 1 and None not in homes:
            (home,) = homes
            if blocks.get(node) not in (None, piece_block[home]):
                continue
            pieces[home].append(node)
            piece_of[node] = home


def _root(parent, node):
    while parent[node] is not node:
        parent[node] = parent[parent[node]]
        node = parent[node]
    return node


def _may_compile(node: torch.fx.Node, keep_eager: frozenset[str], compilable) -> bool:
    """Whether a piece may hold ``node`` outside a region; ``compilable`` holds the earlier nodes that may."""
    if node.op != "call_function" or node.name in keep_eager:
        return False
    if node.target is operator.getitem:
        # Only of a tuple made inside a piece: a region's tuple output is not a tensor input.
        # One that picks something else (a number) may join only when nothing reads it.
        return node.args[0] in compilable and (_is_tensor(node.meta.get("val")) or not node.users)
    if not isinstance(node.target, torch._ops.OpOverload):
        return False
    if node.target._schema.is_mutable or (torch.Tag.nondeterministic_seeded in node.target.tags and not _without_dropout(node)):
        return False
    value = node.meta.get("val")
    values = value if isinstance(value, (tuple, list)) else (value,)
    inputs = [i.meta.get("val") for i in node.all_input_nodes]
    tensors = [v for v in values if _is_tensor(v)]
    if not tensors or not all(_is_tensor(v) for v in inputs) or not _others_unread(node, values):
        return False
    return not any(is_fp8_dtype(v.dtype) for v in [*tensors, *inputs])


def _without_dropout(node: torch.fx.Node) -> bool:
    """Whether a seeded op draws no random numbers: it has a ``dropout_p`` argument (the
    attention ops) and that is 0, a number in the graph."""
    for index, argument in enumerate(node.target._schema.arguments):
        if argument.name == "dropout_p":
            if argument.name in node.kwargs:
                p = node.kwargs[argument.name]
            elif index < len(node.args):
                p = node.args[index]
            else:
                p = argument.default_value if argument.has_default_value() else None
            return isinstance(p, (int, float)) and p == 0
    return False


def _others_unread(node: torch.fx.Node, values) -> bool:
    """Whether the results of ``node`` that are not tensors are ``None`` or plain ints that no
    node reads (a ``getitem`` that picks one has no users): an attention op's sequence offsets
    (``None`` for dense inputs) and its maximum lengths (fixed with static shapes, handed on as
    numbers in the graph, not as nodes)."""
    if all(_is_tensor(v) for v in values):
        return True
    if not all(v is None or type(v) is int for v in values if not _is_tensor(v)):
        return False
    return all(user.target is operator.getitem and (_is_tensor(values[user.args[1]]) or not user.users) for user in node.users)


#: Ops whose eager CUDA kernel reads a result back to the host before it returns, stalling the
#: launches that follow (the embedding's backward sorts the indices and reads how many distinct
#: ones there are); Inductor makes them without (a scatter-add).
_WAITING_OPS = frozenset({torch.ops.aten.embedding_dense_backward.default})


def _waits_for_the_device(node: torch.fx.Node) -> bool:
    value = node.meta.get("val")
    return node.target in _WAITING_OPS and _is_tensor(value) and value.device.type == "cuda"


def _is_tensor(value) -> bool:
    return isinstance(value, torch.Tensor)


def _computes(node: torch.fx.Node) -> bool:
    """Whether ``node`` does work a fused kernel saves: not a view, not a ``getitem``."""
    if node.target is operator.getitem:
        return False
    returns = node.target._schema.returns
    return not (len(returns) == 1 and returns[0].alias_info is not None)
