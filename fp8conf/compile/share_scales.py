"""Backward FP8 regions that take the scales their forward already computed.

A Float8Linear's backward casts again what its forward cast: the weight, with the same amax and
the same scale, and the output gradient twice (once per matmul, same amax, same scale, same
cast). ``torch.compile`` merges such repeats (common-subexpression elimination) before it cuts
the joint graph; the regional cut cannot run that pass as it stands, since it would merge a
backward region's whole cast into the forward's and leave the backward region without its
quantization chain. :func:`share_forward_scales` merges what keeps every region whole:

* two equal nodes of one backward region become one (the output gradient's second amax, scale
  and cast); an amax is equal to one of the same values through a reshape or transpose;
* a node of a backward region equal to a forward node (on these graphs, one of its module's
  forward region) is replaced by it, where what the backward then reads from the forward is
  small: fewer elements than any FP8 operand of the region's matmuls (a scale, an amax),
  never a cast tensor. The region's cast stays in the backward and takes its scale from the
  forward, a value the other pass saves, which leaves the region complete
  (:mod:`fp8conf.graph.regions`).

Equal means the same ATen op on the same inputs and arguments; the ops merged draw no random
numbers and mutate nothing, so every value is the one the repeat computed, bit for bit.
"""

from __future__ import annotations

import torch
import torch.fx

from fp8conf.graph.provenance import node_passes
from fp8conf.graph.regions import Region, identify_fp8_regions
from fp8conf.graph.roles import is_fp8_dtype

__all__ = ["share_forward_scales"]


def share_forward_scales(gm: torch.fx.GraphModule, regions: list[Region] | None = None) -> dict[str, str]:
    """Merge the repeats of ``gm``'s (a joint graph's) backward FP8 regions as the module's
    documentation says; rewrites ``gm``'s graph and returns, for each node it removed, the name
    of the node that now computes its value. Only complete regions are touched. ``regions`` are
    ``gm``'s as :func:`fp8conf.identify_fp8_regions` found them (identified here when omitted)."""
    passes = node_passes(gm.graph)
    forward: dict[tuple, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        if passes[node] == "forward" and _pure(node):
            forward.setdefault(_key(node, {}), node)
    replace: dict[torch.fx.Node, torch.fx.Node] = {}
    dead: dict[torch.fx.Node, torch.fx.Node] = {}  # left without users, with the twin that took their work
    for region in identify_fp8_regions(gm) if regions is None else regions:
        if region.complete and region.pass_name == "backward":
            _share_in(region, forward, replace, dead)
    for node in replace:
        node.replace_all_uses_with(replace[node])
    merged = {node.name: twin.name for node, twin in [*replace.items(), *dead.items()]}
    for node in [*replace, *dead]:  # the dead were found users first
        gm.graph.erase_node(node)
    if replace:
        gm.recompile()
    return merged


def _share_in(region, forward, replace, dead) -> None:
    seen: dict[tuple, torch.fx.Node] = {}
    taken = {}  # node -> the forward twin it takes
    for node in region.nodes:  # graph order: inputs first
        if not _pure(node):
            continue
        key = _key(node, replace)
        twin = seen.get(key)
        if twin is not None:
            replace[node] = twin
            continue
        twin = forward.get(key)
        if twin is not None and not _fp8(node):
            replace[node] = taken[node] = twin
        else:
            seen[key] = node
    # What the backward goes on reading from the forward must be small; a twin that is not
    # stays a node of the backward, and its own inputs are then read in its place.
    operands = [a.meta.get("val") for c in region.compute_nodes for a in c.args[:2] if isinstance(a, torch.fx.Node)]
    limit = min((v.numel() for v in operands if isinstance(v, torch.Tensor)), default=0)
    changed = True
    while changed:
        changed = False
        for node in list(taken):
            if _numel(node) >= limit and any(u not in replace for u in node.users):
                del replace[node], taken[node]
                changed = True
    # What only merged nodes read (the absolute values of a view whose amax the forward took).
    for node in reversed(region.nodes):
        if node not in replace and _pure(node) and node.users and all(u in replace or u in dead for u in node.users):
            user = next(iter(node.users))
            dead[node] = replace.get(user) or dead[user]


def _pure(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    return not node.target._schema.is_mutable and torch.Tag.nondeterministic_seeded not in node.target.tags


#: Views that keep every element once: an amax through them is the amax of their base.
_ELEMENT_KEEPING_VIEWS = frozenset(
    getattr(torch.ops.aten, name).default for name in ("view", "reshape", "_unsafe_view", "t", "permute")
) | {torch.ops.aten.transpose.int}


def _key(node: torch.fx.Node, replace) -> tuple:
    """What makes ``node`` equal to another: its op, inputs and arguments. A whole-tensor amax
    (``max(abs(x))``) is keyed by the tensor its absolute values come from, looked through views
    that keep every element: torchao's backward takes the amax of the input reshaped to 2-D,
    where the forward took that of the input itself."""
    mapped = lambda a: replace.get(a, a)  # noqa: E731
    if node.target is torch.ops.aten.max.default and len(node.args) == 1 and not node.kwargs:
        inner = mapped(node.args[0])
        if isinstance(inner, torch.fx.Node) and inner.target is torch.ops.aten.abs.default:
            base = mapped(inner.args[0])
            while isinstance(base, torch.fx.Node) and base.target in _ELEMENT_KEEPING_VIEWS:
                base = mapped(base.args[0])
            return "amax", base

    def hashable(a):
        if isinstance(a, torch.fx.Node):
            return mapped(a)
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, *map(hashable, a))
        if isinstance(a, dict):
            return ("dict", *((k, hashable(v)) for k, v in sorted(a.items())))
        return (type(a).__name__, a)

    return node.target, hashable(node.args), hashable(node.kwargs)


def _fp8(node: torch.fx.Node) -> bool:
    return is_fp8_dtype(getattr(node.meta.get("val"), "dtype", None))


def _numel(node: torch.fx.Node) -> int:
    value = node.meta.get("val")
    return value.numel() if isinstance(value, torch.Tensor) else 0
