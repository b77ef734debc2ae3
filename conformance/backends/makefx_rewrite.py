"""The trainer's post-trace pass: common-subexpression elimination, then dead-code elimination.

A ``make_fx`` trace repeats work autograd's formulas do again: a quantized linear's backward
casts the weight its forward cast, with the same amax and scale, and the output gradient once
per matmul. :func:`eliminate_common_subexpressions` merges each such repeat into the first node
that computes the value, as a trainer runs after ``make_fx`` (``torch.compile``'s partitioner
does the same on AOTAutograd's graphs), then removes what no output needs and no side effect
keeps.

The traced step is not functional: TorchAO scales a rowwise matmul's result in place. A value
that an op writes, directly or through a view, is never merged, neither into another nor another
into it: its readers would see the write at another place in the step. Ops that draw random
numbers or have other side effects are never merged either. Nor are the nodes of two module calls:
a linear and the adapter nested in it compute the same weight-gradient matmul, and merged, one
module would issue both modules' FP8 compute, which the trainer's check counts per module. The
node kept is the earlier one, with its metadata (pass tag, provenance): a backward repeat of a
forward cast becomes the forward cast, read by the backward, as a saved value is.
"""

from __future__ import annotations

import torch
import torch.fx

from conformance.backends.makefx_trainer import module_call, module_provenance

__all__ = ["eliminate_common_subexpressions"]


def eliminate_common_subexpressions(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Merge, in place, every node of ``gm`` that computes what an earlier node computes (the same
    op on the same inputs and arguments) into that earlier node, then eliminate dead code;
    returns ``gm``."""
    written = _written(gm.graph)
    first: dict[tuple, torch.fx.Node] = {}
    for node in list(gm.graph.nodes):
        if not _mergeable(node, written):
            continue
        key = _key(node)
        if key is None:
            continue
        twin = first.setdefault(key, node)
        if twin is not node:
            node.replace_all_uses_with(twin)
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def _mergeable(node: torch.fx.Node, written: set[torch.fx.Node]) -> bool:
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload) or node in written:
        return False
    if node.target._schema.is_mutable or torch.Tag.nondeterministic_seeded in node.target.tags:
        return False
    return not node.is_impure()


def _written(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Nodes whose value some op of ``graph`` writes: the argument it writes and, through the
    views it was made by, their bases."""
    found: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        schema = node.target._schema
        if not schema.is_mutable:
            continue
        for i, argument in enumerate(schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
            for target in value if isinstance(value, (list, tuple)) else (value,):
                while isinstance(target, torch.fx.Node) and target not in found:
                    found.add(target)
                    is_view = isinstance(target.target, torch._ops.OpOverload) and target.target.is_view
                    target = target.args[0] if is_view and target.args else None
    return found


def _key(node: torch.fx.Node) -> tuple | None:
    """The module call that issued ``node``, its op, inputs and arguments, hashable; None where
    an argument is not."""

    def hashable(a):
        if isinstance(a, torch.fx.Node):
            return a
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, *map(hashable, a))
        if isinstance(a, dict):
            return ("dict", *((k, hashable(v)) for k, v in sorted(a.items())))
        # A float by its repr: -0.0 is not 0.0.
        return (type(a).__name__, repr(a) if isinstance(a, float) else a)

    key = (module_provenance(node), module_call(node), node.target, hashable(node.args), hashable(node.kwargs))
    try:
        hash(key)
    except TypeError:
        return None
    return key
