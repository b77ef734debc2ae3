"""Cutting a flat joint graph into a forward and a backward graph the way ``torch.compile`` does.

``torch.compile`` never runs a joint graph as one piece: AOTAutograd hands it to the min-cut
rematerialisation partitioner, which decides which forward values the backward keeps and which it
recomputes (cheap pointwise chains, views), so that fewer activations stay alive between the
passes. :func:`partition_joint` calls that same partitioner
(``torch._functorch.partitioners.min_cut_rematerialization_partition``) on fp8conf's flat joint
graph, and the compiled step calls the two compiled halves with the joint graph's own flat
convention (:func:`~fp8conf.compile.assemble.run_partitioned`: primals then tangents in, forward
outputs then gradients out), so every caller of :func:`fp8conf.compile_joint` sees no difference
but the memory.

Two ways to cut, one per compile mode. For ``regional`` (the default), nodes keep their names
and meta (provenance, ``partitioner_tag``, annotations) in both graphs, a forward node the
backward recomputes appears in both, still tagged forward, and every FP8 region stays whole on
its side of the cut, its backward taking the scales the forward computed
(:mod:`fp8conf.compile.share_scales`, which rewrites the joint graph first); equal blocks are
then made to save and recompute the same values, where the partitioner broke a tie for one of
them another way (:mod:`fp8conf.compile.block_saves`). For
``full`` (``keep_fp8_regions=False``) the cut is the one ``torch.compile`` makes: the joint
graph is first rewritten into Inductor's decompositions, then handed to Inductor's own partition
function, which runs its joint-graph passes and the min-cut
partitioner with common-subexpression elimination, counting parameters and buffers as free to
keep. Merged subexpressions let the backward reuse the forward's FP8 scales and the three
projections of one input share one cast, so this cut saves fewer bytes and launches fewer
kernels; the graphs it makes have new node names, and their regions are not kept whole.

In a compile this is the second stage: :func:`partition_plan` takes the
:class:`~fp8conf.compile.plan.JointPlan` and hands on a :class:`JointPartition`, the plan's flat
graph cut (or whole, where it cannot be cut), to the compiling of its graphs
(:mod:`fp8conf.compile.units`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree

from fp8conf.compile.block_saves import align_block_saves
from fp8conf.compile.plan import JointPlan
from fp8conf.graph.lazy_code import graph_module
from fp8conf.compile.share_scales import share_forward_scales
from fp8conf.graph.regions import Region, identify_fp8_regions
from fp8conf.graph.trace import JointSignature, joint_signature
from fp8conf.log import warn_once

__all__ = ["JointPartition", "PartitionedJoint", "partition_plan", "partition_joint", "regions_in", "inductor_decomposed"]


@dataclasses.dataclass(frozen=True)
class PartitionedJoint:
    """A flat joint graph cut in two.

    Attributes:
        forward: takes the primals, returns the forward outputs then the values saved for the backward.
        backward: takes, in its placeholder order, saved values and tangents; returns one gradient per primal.
        num_primals / num_forward_outputs: how the joint graph's flat inputs and outputs divide.
        backward_sources: for each backward placeholder, ``("saved", i)`` (the forward graph's
            output ``i``) or ``("tangent", j)``.
        merged: the joint graph's nodes in neither graph because another computes their value
            (the backward's repeats of the forward's scales), each with that other's name.
    """

    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule
    num_primals: int
    num_forward_outputs: int
    backward_sources: tuple[tuple[str, int], ...]
    merged: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class JointPartition:
    """The second stage (:func:`partition_plan`): the plan's flat graph whole (``parts`` is ``None``),
    or cut into forward and backward by the min-cut partitioner.

    ``regions``: for each of :attr:`graphs`, its share of the plan's FP8 regions
    (:func:`regions_in`), which the compile of that graph tags."""

    plan: JointPlan
    parts: PartitionedJoint | None
    regions: tuple[list[Region], ...] = ()

    @property
    def graphs(self) -> list[torch.fx.GraphModule]:
        """The graphs compiled, in the order the compiled step runs them."""
        return [self.plan.flat] if self.parts is None else [self.parts.forward, self.parts.backward]


def partition_plan(plan: JointPlan) -> JointPartition:
    """The second stage: with ``config.partition``, a joint graph cut into forward and backward
    (:func:`~fp8conf.compile.partition.partition_joint`): the very cut ``torch.compile`` makes for
    ``full``, one that keeps every FP8 region whole for ``regional``; a graph the partitioner
    cannot cut stays whole. Each graph's share of the plan's regions is found by name (the cut
    keeps the nodes' names)."""
    if not plan.config.partition:
        partition = JointPartition(plan, None)
    elif plan.config.mode == "full":
        partition = JointPartition(plan, partition_joint(plan.flat, keep_fp8_regions=False, signature=plan.signature))
    else:
        partition = JointPartition(plan, partition_joint(plan.flat, keep_fp8_regions=True, signature=plan.signature, regions=plan.regions))
    return dataclasses.replace(partition, regions=tuple(regions_in(graph, plan.regions) for graph in partition.graphs))


def partition_joint(flat: torch.fx.GraphModule, *, keep_fp8_regions: bool = True, signature: JointSignature | None = None,
                    regions: list[Region] | None = None) -> PartitionedJoint | None:
    """Partition ``flat`` (a joint graph as :func:`fp8conf.graph.trace.flat_graph_module` makes
    it) with the min-cut partitioner; ``None`` when it is no joint graph the partitioner can
    read: the partitioner tells primals from tangents by placeholder name, as AOTAutograd names
    them, and a graph without tangents has no backward to cut off.

    ``keep_fp8_regions`` (for the regional mode) keeps nodes, names and FP8 regions whole;
    without it the cut is ``torch.compile``'s own (see the module's documentation), and ``None``
    also when the placeholders record no fake values to trace the decompositions with.

    ``signature`` (``flat``'s :class:`~fp8conf.JointSignature`) and ``regions`` (its FP8 regions,
    for ``keep_fp8_regions``) are what the compile already holds; each is read from ``flat``
    when omitted. The halves' regions are then ``regions_in(half, regions)``."""
    signature = signature if signature is not None else joint_signature(flat)
    placeholders = flat.graph.find_nodes(op="placeholder")
    primals = [p for p in placeholders if p.name.startswith("primals")]
    tangents = [p for p in placeholders if p.name.startswith("tangents")]
    if not tangents or len(primals) + len(tangents) != len(placeholders) or placeholders[: len(primals)] != primals:
        return None
    num_forward_outputs = _forward_output_count(flat, len(primals), signature)
    if num_forward_outputs is None:
        return None
    unknown = next((n for n in flat.graph.nodes if n.op in ("placeholder", "call_function") and "val" not in n.meta), None)
    if unknown is not None:
        # The partitioner sizes every value it might save from meta["val"].
        warn_once("uncut joint graph", f"{id(flat)}", f"compile_joint: node '{unknown.name}' records no meta['val'], so the joint graph "
                  "cannot be cut into forward and backward as torch.compile cuts it; it is compiled whole, keeping every "
                  "activation alive until the backward. Keep node.meta in rewrites")
        return None
    merged = {}
    if keep_fp8_regions:
        regions = identify_fp8_regions(flat) if regions is None else regions
        forward, backward, merged = _partition_keeping_regions(flat, num_forward_outputs, regions)
    else:
        cut = _partition_as_torch_compile(flat, num_forward_outputs, signature)
        if cut is None:
            return None
        forward, backward = cut
    saved = {node.name: i for i, node in enumerate(_output_nodes(forward))}
    tangent_index = {node.name: j for j, node in enumerate(tangents)}
    sources = []
    for node in backward.graph.find_nodes(op="placeholder"):
        if node.name in tangent_index:
            sources.append(("tangent", tangent_index[node.name]))
        elif node.name in saved and saved[node.name] >= num_forward_outputs:
            sources.append(("saved", saved[node.name]))
        else:
            return None  # a backward input the forward does not hand over: not a cut we can call
    forward.meta.update(flat.meta)
    backward.meta.update(flat.meta)
    return PartitionedJoint(forward, backward, len(primals), num_forward_outputs, tuple(sources), merged)


def _partition_keeping_regions(flat, num_forward_outputs, regions):
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    examples = [p.meta.get("val") for p in flat.graph.find_nodes(op="placeholder")]
    # The repeats that keep the regions whole are merged first (the forward's scales, the
    # output gradient's second cast); the partitioner's own common-subexpression pass would
    # merge a backward region's cast into the forward one it repeats, leaving the region
    # incomplete and its nodes neither compiled nor eager.
    merged = share_forward_scales(flat, regions)
    pinned = _pin_backward_regions(regions, merged)
    with torch._functorch.config.patch(cse=False):
        forward, backward = min_cut_rematerialization_partition(flat, examples, num_fwd_outputs=num_forward_outputs)
    for graph in (flat, forward, backward):
        for node in graph.graph.nodes:
            if node.name in pinned:
                node.meta["partitioner_tag"] = "is_backward"
    # Equal blocks cut alike, so that their backward is one unit compiled once.
    if align_block_saves(flat, forward, backward, num_forward_outputs):
        forward, backward = (_remade(gm) for gm in (forward, backward))
    return forward, backward, merged


def _remade(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A module of ``gm``'s graph, its code written when first called (the graph was rewritten)."""
    new = graph_module(gm, gm.graph)
    new.meta.update(gm.meta)
    return new


def _partition_as_torch_compile(flat, num_forward_outputs, signature):
    """The cut ``torch.compile`` makes of the same joint graph: AOTAutograd traces it in
    Inductor's decompositions, and Inductor's partition function runs the joint-graph pattern
    passes, then the min-cut partitioner, told which inputs (parameters, buffers) outlive the
    step so that keeping them for the backward costs nothing."""
    from torch._inductor.compile_fx import partition_fn

    decomposed = _decompose_for_inductor(flat)
    if decomposed is None:
        return None
    static = [i for i, spec in enumerate(signature.inputs) if spec.kind in ("param", "buffer")]
    examples = [p.meta["val"] for p in decomposed.graph.find_nodes(op="placeholder")]
    return partition_fn(decomposed, examples, num_fwd_outputs=num_forward_outputs, static_lifetime_input_indices=static)


def inductor_decomposed(gm: torch.fx.GraphModule, examples, fake_mode) -> torch.fx.GraphModule:
    """``gm`` retraced on ``examples`` (fake values of ``fake_mode``) into Inductor's decomposition
    table, as AOTAutograd decomposes a graph before Inductor compiles it."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    # preserve_node_meta carries each node's partitioner tag and stack trace to the nodes it becomes.
    with fake_mode, fx_traceback.preserve_node_meta():
        return make_fx(torch.fx.Interpreter(gm).run, decomposition_table=select_decomp_table())(*examples)


def _decompose_for_inductor(flat):
    """``flat`` retraced (on its own fake values) into Inductor's decomposition table; its
    placeholders keep their names, by which the partitioner tells primals from tangents."""
    from torch._guards import detect_fake_mode

    placeholders = flat.graph.find_nodes(op="placeholder")
    examples = [p.meta.get("val") for p in placeholders]
    fake_mode = detect_fake_mode(examples)
    if fake_mode is None or not all(isinstance(v, torch.Tensor) for v in examples):
        return None
    decomposed = inductor_decomposed(flat, examples, fake_mode)
    for new, old in zip(decomposed.graph.find_nodes(op="placeholder"), placeholders):
        new._rename(old.name)
        new.target = old.name
        if new.name != old.name:
            return None
    decomposed.recompile()
    decomposed.meta.update(flat.meta)
    return decomposed


def _forward_output_count(flat, num_primals, signature) -> int | None:
    """How many forward outputs precede the gradients, when the graph is a whole joint graph:
    AOTAutograd's joint returns the forward outputs, then one gradient (or None) per primal, as
    its :class:`~fp8conf.JointSignature` records. A GraphPP callable has primals and tangents
    too, but returns other things."""
    outputs = _output_nodes(flat)
    if signature is None or len(signature.outputs) != len(outputs) or len(outputs) < num_primals:
        return None
    count = len(outputs) - num_primals
    grads = ("param_grad", "input_grad")
    if any(o is not None and o.kind in grads for o in signature.outputs[:count]):
        return None
    if any(o is not None and o.kind not in grads for o in signature.outputs[count:]):
        return None
    return count


def _pin_backward_regions(regions: list[Region], merged: Mapping[str, str]) -> set[str]:
    """Keep the backward FP8 regions whole in the backward graph. Left to itself, the partitioner
    moves what does not depend on the tangents (the weight's amax, scale and cast) into the
    forward and saves its result, cutting the region in two; ``must_be_in_backward`` (a
    partitioner tag) forbids that. ``regions`` are the joint graph's, found before
    :func:`~fp8conf.compile.share_scales.share_forward_scales` removed the nodes in ``merged``.
    Returns the names pinned, to be tagged back ``is_backward``."""
    pinned = set()
    for region in regions:
        if region.complete and region.pass_name == "backward":
            for node in region.nodes:
                if node.name in merged:
                    continue  # no longer in the graph: its twin computes it
                node.meta = dict(node.meta, partitioner_tag="must_be_in_backward")
                pinned.add(node.name)
    return pinned


def regions_in(graph: torch.fx.GraphModule, regions: list[Region]) -> list[Region]:
    """``regions``, found on a joint graph, as they lie in ``graph``, that graph itself or one of
    its halves (nodes keep their names across the cut): those whose FP8 compute ``graph`` runs,
    with ``graph``'s nodes, less the nodes merged away (in neither half). The cut keeps every
    region whole on its side, so these are the regions identification would find in ``graph``,
    without walking it again."""
    # Only the nodes that compute: a value saved across the cut is a placeholder of the same
    # name on the other side (a boundary there, not part of the region).
    by_name = {node.name: node for node in graph.graph.nodes if node.op == "call_function"}
    found = []
    for region in regions:
        if not all(node.name in by_name for node in region.compute_nodes):
            continue
        nodes = tuple(by_name[node.name] for node in region.nodes if node.name in by_name)
        found.append(dataclasses.replace(region, nodes=nodes, compute_nodes=tuple(by_name[n.name] for n in region.compute_nodes)))
    return found


def _output_nodes(gm: torch.fx.GraphModule) -> list:
    return list(pytree.tree_leaves(gm.graph.find_nodes(op="output")[0].args[0], is_leaf=lambda x: x is None))
