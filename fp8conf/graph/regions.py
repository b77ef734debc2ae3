"""FP8 regions: the quantization chains and FP8 matmuls of one module call in one pass.

A region is grown from each FP8 compute node backwards through its inputs that carry the same
provenance (same module, same call) in the same pass; regions sharing nodes are one region.
It is then closed under paths (every node on a path between two region nodes joins it) so that
it can be cut out of the graph as one piece. A region is **complete** when every FP8 operand and
scale of its compute nodes is made inside it from high-precision values, or enters it at a
boundary: a placeholder, or a value saved by the other pass (which becomes a placeholder once
the joint graph is partitioned). Only complete regions are tagged for regional Inductor, each
under its own region id, in ``node.meta["custom"]["compile_with_inductor"]``.

A region never spans a collective (:mod:`fp8conf.graph.collectives`): growth stops at one, and
where a region consumes what a collective delivers (a weight gathered as FP8 bytes) the nodes
upstream of that collective (the weight's amax, scale and cast, done on the rank's shard before
the gather) leave the region; their values enter it as boundaries, as values from the other
pass do, so the region holds the FP8 matmul and what it does with the gathered bytes.

Region ids are built from the module FQN, the pass, the call and the region's rank in graph
order, never from node names, so identification is deterministic.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch.fx

from fp8conf.arguments import require
from fp8conf import errors
from fp8conf.graph.collectives import is_collective
from fp8conf.graph.provenance import get_provenance, node_passes, unattributed_fp8_compute
from fp8conf.log import warn_once
from fp8conf.graph.roles import is_fp8_compute, is_fp8_dtype, scale_operands

__all__ = ["REGION_META_KEY", "Region", "identify_fp8_regions", "tag_fp8_regions", "check_attributed"]

#: Key of the region id fp8conf puts inside ``compile_with_inductor``.
REGION_META_KEY = "inductor_region"


@dataclasses.dataclass(frozen=True)
class Region:
    """One FP8 region. ``reason`` says why an incomplete region is incomplete."""

    id: str
    module_fqn: str
    pass_name: str
    call: int
    nodes: tuple[torch.fx.Node, ...]
    compute_nodes: tuple[torch.fx.Node, ...]
    complete: bool
    reason: str | None = None


def identify_fp8_regions(gm: torch.fx.GraphModule, *, provenance_of=None, passes=None) -> list[Region]:
    """Find the FP8 regions of ``gm``. Reads the graph only; FP8 compute that fp8conf's
    provenance cannot place in a region (none recorded, or operands without ``meta["val"]``) is
    in none, and logged as a warning through the ``fp8conf`` logger, once per node.

    A trainer that records provenance its own way passes ``provenance_of(node)`` (an object with
    ``module_fqn`` and, optionally, ``call``; equal for nodes of one module call, None for none)
    and ``passes`` (node -> ``"forward"`` / ``"backward"``); fp8conf's own are the default.
    """
    require(gm, "graph module", "identify_fp8_regions", "gm")
    if provenance_of is None:
        # What fp8conf's provenance cannot place (no provenance, no recorded dtype) is skipped
        # below: said through the fp8conf logger, once per node, never dropped without a word.
        check_attributed(gm, strict=False)
    provenance_of = provenance_of or get_provenance
    passes = passes if passes is not None else node_passes(gm.graph)
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    groups: list[set[torch.fx.Node]] = []
    owner: dict[torch.fx.Node, int] = {}
    upstream: dict[torch.fx.Node, set[torch.fx.Node]] = {}
    crossed: list[set[torch.fx.Node]] = []
    for node in gm.graph.nodes:
        if not is_fp8_compute(node) or provenance_of(node) is None:
            continue
        grown, across = _grow(node, provenance_of(node), passes, provenance_of, upstream)
        merged = {owner[n] for n in grown if n in owner}
        for index in merged:
            grown |= groups[index]
            across |= crossed[index]
            groups[index] = set()
        grown -= across
        groups.append(grown)
        crossed.append(across)
        for n in grown:
            owner[n] = len(groups) - 1
    regions = []
    counters: dict[tuple, int] = {}
    for index in sorted((i for i, g in enumerate(groups) if g), key=lambda i: min(order[n] for n in groups[i])):
        regions.append(_make_region(groups[index], passes, order, counters, provenance_of, crossed[index]))
    return regions


def _grow(compute: torch.fx.Node, provenance, passes, provenance_of, upstream) -> set[torch.fx.Node]:
    pass_name = passes[compute]
    grown, stack, collectives = {compute}, [compute], set()
    while stack:
        for parent in stack.pop().all_input_nodes:
            if parent in grown or parent.op != "call_function" or passes[parent] != pass_name:
                continue
            if is_collective(parent):
                collectives.add(parent)
            elif provenance_of(parent) == provenance:
                grown.add(parent)
                stack.append(parent)
    across = set()
    for collective in collectives:
        across |= _upstream_of(collective, passes, upstream)
    return grown - across, across


def _upstream_of(collective, passes, memo) -> set[torch.fx.Node]:
    """The nodes of ``collective``'s pass that its result depends on (memoised per collective)."""
    if collective not in memo:
        pass_name, found, stack = passes[collective], set(), [collective]
        while stack:
            for parent in stack.pop().all_input_nodes:
                if parent not in found and parent.op == "call_function" and passes[parent] == pass_name:
                    found.add(parent)
                    stack.append(parent)
        memo[collective] = found
    return memo[collective]


def _make_region(group, passes, order, counters, provenance_of, across=frozenset()) -> Region:
    nodes = sorted(group, key=order.__getitem__)
    provenance = provenance_of(next(n for n in nodes if is_fp8_compute(n)))
    call = getattr(provenance, "call", 0)
    pass_name = passes[nodes[0]]
    key = (provenance.module_fqn, pass_name, call)
    rank = counters[key] = counters.get(key, -1) + 1
    region_id = f"{provenance.module_fqn}/{pass_name}/call{call}/{rank}"
    computes = tuple(n for n in nodes if is_fp8_compute(n))
    reason = _non_convex(group, order) or _incomplete(group, computes, passes, pass_name, provenance_of, across)
    return Region(region_id, provenance.module_fqn, pass_name, call, tuple(nodes), computes, reason is None, reason)


def _non_convex(group, order) -> str | None:
    # A path that leaves the region and comes back would force the cut-out piece to call the
    # rest of the graph; such a region cannot be compiled alone.
    first = min(order[n] for n in group)
    outside_descendants = set()
    for node in sorted(group, key=order.__getitem__):
        for user in node.users:
            if user not in group and order[user] > first:
                outside_descendants.add(user)
    frontier = sorted(outside_descendants, key=order.__getitem__)
    seen = set(frontier)
    last = max(order[n] for n in group)
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user in group:
                return f"not convex: the path through '{node.name}' leaves the region and re-enters at '{user.name}'"
            if user not in seen and order[user] < last:
                seen.add(user)
                frontier.append(user)
    return None


def _incomplete(group, computes, passes, pass_name, provenance_of=get_provenance, across=frozenset()) -> str | None:
    # Every FP8 value must be made inside the region or enter at a boundary, and so must the
    # scales the matmuls consume; high-precision inputs (activations, weights) may come from
    # anywhere.
    entering = [(node, i) for node in group for i in node.all_input_nodes if i not in group]
    entering += [(c, a) for c in computes for a in scale_operands(c) if a not in group]
    for consumer, value in entering:
        fp8 = is_fp8_dtype(getattr(value.meta.get("val"), "dtype", None))
        if consumer in computes and value in scale_operands(consumer):
            kind = "scale"
        elif fp8:
            kind = "FP8 value"
        else:
            continue
        if value.op == "placeholder" or passes[value] != pass_name or value in across:
            continue  # a boundary: an input, a value saved by the other pass, or made before a collective
        return (
            f"incomplete: the {kind} '{value.name}' used by '{consumer.name}' is made outside the region "
            f"({value.target}, provenance {provenance_of(value)}), so the region does not hold its whole "
            "quantization chain"
        )
    return None


def tag_fp8_regions(gm: torch.fx.GraphModule, regions: list[Region] | None = None, *, strict: bool = True) -> list[Region]:
    """Tag every complete region for regional Inductor; report incomplete ones.

    Strict mode raises :class:`~fp8conf.errors.MissingProvenanceError` for FP8 compute no region
    can hold (no provenance, or operands that record no ``meta["val"]``), as validation does, and
    :class:`~fp8conf.errors.IncompleteRegionError` for the first incomplete region, before tagging
    anything; otherwise each is a warning (the former through the ``fp8conf`` logger) and stays
    untagged. Annotations already in ``node.meta["custom"]`` are kept.
    """
    require(gm, "graph module", "tag_fp8_regions", "gm")
    if regions is None:
        # Regions a caller identified with provenance of its own are its account; fp8conf's
        # identification skips what fp8conf's provenance cannot place, and must say so.
        check_attributed(gm, strict=strict)
        regions = identify_fp8_regions(gm)
    incomplete = [r for r in regions if not r.complete]
    if incomplete and strict:
        region = incomplete[0]
        raise errors.IncompleteRegionError(
            f"FP8 region {region.id} of module '{region.module_fqn}' ({region.pass_name} pass) is {region.reason}; "
            "it would be compiled without its quantization. Keep the provenance of the nodes your rewrite creates, "
            "or run with strict=False to leave the region eager",
            module_fqn=region.module_fqn,
            pass_name=region.pass_name,
            node_name=region.compute_nodes[0].name,
        )
    for region in incomplete:
        warnings.warn(f"[REG-004] FP8 region {region.id} left eager: {region.reason}", errors.FP8ValidationWarning, stacklevel=2)
    for region in regions:
        if region.complete:
            for node in region.nodes:
                _tag(node, region.id)
    return regions


def check_attributed(gm: torch.fx.GraphModule, *, strict: bool = True) -> None:
    """FP8 compute no region can hold (no provenance, or no recorded dtype): identification skips
    it, so a strict pass that went on would compile none of it as FP8 and say nothing. Strict
    tagging refuses it as validation does; otherwise each is logged, once per node."""
    unattributed = unattributed_fp8_compute(gm.graph)
    if unattributed and strict:
        first = unattributed[0]
        more = f" ({len(unattributed) - 1} more like it)" if len(unattributed) > 1 else ""
        raise errors.MissingProvenanceError(
            f"FP8 region tagging: {first.message}{more}. Strict tagging refuses FP8 compute it cannot attribute; "
            "strict=False leaves it eager with a warning",
            pass_name=first.pass_name,
            node_name=first.node_name,
            findings=tuple(unattributed),
        )
    for finding in unattributed:
        warn_once("unattributed FP8 compute", f"{id(gm)}:{finding.node_name}", f"[VAL-003] left eager, in no FP8 region: {finding.message}")


def _tag(node: torch.fx.Node, region_id: str) -> None:
    custom = dict(node.meta.get("custom") or {})
    existing = custom.get("compile_with_inductor")
    value = dict(existing) if isinstance(existing, dict) else {}
    value[REGION_META_KEY] = region_id
    custom["compile_with_inductor"] = value
    node.meta["custom"] = custom
