"""Rewrites the suite itself performs on a backend's graph to break an FP8 rule on purpose.

Each models a real way FP8 gets lost in a graph trainer: a lowering that turns a scaled matmul
into a high-precision one, a pass that rebuilds a node without its metadata, a rewrite that
feeds a scaled op a high-precision operand, a rewrite that runs a matmul twice. New nodes get fake values computed in the graph's
own fake mode, so dtypes and shapes stay truthful for every reader.
"""

from __future__ import annotations

import torch
import torch.fx

from conformance.observe.graphs import copy_codegen, grouped_offsets

__all__ = [
    "lower_to_high_precision", "lower_grouped_to_high_precision", "rebuild_without_meta", "rebuild_chain_without_meta", "upcast_operand",
    "duplicate_compute", "eliminate_common_subexpressions",
]

aten = torch.ops.aten


def _fake(node: torch.fx.Node, target, *args, **kwargs) -> None:
    val = next(a.meta["val"] for a in node.all_input_nodes if "val" in a.meta)
    fake_args = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
    with val.fake_mode:
        node.meta["val"] = target(*fake_args, **kwargs)


def _insert(graph, before, meta_from, target, *args, **kwargs) -> torch.fx.Node:
    with graph.inserting_before(before):
        node = graph.call_function(target, args, kwargs)
    node.meta.update({k: v for k, v in meta_from.meta.items() if k != "val"})
    _fake(node, target, *args, **kwargs)
    return node


def _finish(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    gm.graph.lint()
    gm.recompile()
    return gm


def lower_to_high_precision(gm: torch.fx.GraphModule, node: torch.fx.Node) -> torch.fx.GraphModule:
    """Replace a scaled matmul by ``mm`` of its up-cast operands, keeping the node's metadata.

    Provenance is kept on purpose: the module is still known, only its FP8 compute is gone.
    """
    out_dtype = node.meta["val"].dtype
    a = _insert(gm.graph, node, node, aten._to_copy.default, node.args[0], dtype=out_dtype)
    b = _insert(gm.graph, node, node, aten._to_copy.default, node.args[1], dtype=out_dtype)
    mm = _insert(gm.graph, node, node, aten.mm.default, a, b)
    node.replace_all_uses_with(mm)
    gm.graph.erase_node(node)
    return _finish(gm)


def lower_grouped_to_high_precision(gm: torch.fx.GraphModule, node: torch.fx.Node) -> torch.fx.GraphModule:
    """Replace an FP8 grouped GEMM (``_scaled_grouped_mm`` or the second API's
    ``_scaled_grouped_mm_v2``) by ``_grouped_mm`` of its operands up-cast to bfloat16 with the
    same token-group offsets, keeping the node's metadata (as :func:`lower_to_high_precision`
    does for a matmul)."""
    a = _insert(gm.graph, node, node, aten._to_copy.default, node.args[0], dtype=torch.bfloat16)
    b = _insert(gm.graph, node, node, aten._to_copy.default, node.args[1], dtype=torch.bfloat16)
    offs = grouped_offsets(node)
    grouped = _insert(gm.graph, node, node, aten._grouped_mm.default, a, b, offs)
    out_dtype = node.meta["val"].dtype
    if grouped.meta["val"].dtype != out_dtype:
        grouped = _insert(gm.graph, node, node, aten._to_copy.default, grouped, dtype=out_dtype)
    node.replace_all_uses_with(grouped)
    gm.graph.erase_node(node)
    return _finish(gm)


def rebuild_without_meta(gm: torch.fx.GraphModule, node: torch.fx.Node) -> torch.fx.GraphModule:
    """Replace ``node`` by an identical call whose meta holds only ``val``, as careless passes do."""
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(node.target, node.args, node.kwargs)
    new.meta = {"val": node.meta["val"]}
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    return _finish(gm)


def rebuild_chain_without_meta(gm: torch.fx.GraphModule, cast: torch.fx.Node, same_issuer) -> list[str]:
    """Rebuild without metadata ``cast`` and its whole quantization chain: every call_function
    ancestor that ``same_issuer(node)`` says the cast's module call issued in the cast's pass
    (its amax, scale, scaling and clamping), reached without leaving that call. As a pass that
    re-traces one module's quantization does; returns the rebuilt nodes' original names."""
    chain, stack = {cast}, [cast]
    while stack:
        for parent in stack.pop().all_input_nodes:
            if parent not in chain and parent.op == "call_function" and same_issuer(parent):
                chain.add(parent)
                stack.append(parent)
    names = []
    for node in [n for n in gm.graph.nodes if n in chain]:  # in graph order: inputs first
        names.append(node.name)
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(node.target, node.args, node.kwargs)
        new.meta = {"val": node.meta["val"]}
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    _finish(gm)
    return names


def upcast_operand(gm: torch.fx.GraphModule, node: torch.fx.Node, index: int = 0) -> torch.fx.GraphModule:
    """Feed the scaled op a float32 copy of its argument ``index``, a matrix operand (the op
    stays, FP8 is gone)."""
    operand = node.args[index]
    upcast = _insert(gm.graph, node, operand, aten._to_copy.default, operand, dtype=torch.float32)
    node.args = tuple(upcast if i == index else a for i, a in enumerate(node.args))
    return _finish(gm)


def duplicate_compute(gm: torch.fx.GraphModule, node: torch.fx.Node) -> torch.fx.Node:
    """Compute ``node`` twice, both results needed: a twin of ``node`` (its metadata copied) is
    added with factor zero into what ``node``'s users read, ``add(node, twin, alpha=0)``. The
    values stay those of the graph; the twin reaches every output ``node`` reaches, so it counts
    (a dead copy would not: SPEC.md, "Counting what the outputs need"). Returns the twin."""
    users = list(node.users)
    with gm.graph.inserting_after(node):
        twin = gm.graph.node_copy(node)
    with gm.graph.inserting_after(twin):
        joined = gm.graph.call_function(aten.add.Tensor, (node, twin), {"alpha": 0})
    joined.meta.update({k: v for k, v in node.meta.items() if k != "val"})
    _fake(joined, aten.add.Tensor, node, twin, alpha=0)
    for user in users:
        user.replace_input_with(node, joined)
    _finish(gm)
    return twin


def eliminate_common_subexpressions(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """torch's own joint-graph CSE (what graph trainers run before partitioning). On a
    tensorwise ``Float8Linear`` it merges the two identical casts of the output gradient into one
    FP8 tensor shared by the input-gradient and weight-gradient matmuls. Node meta is kept."""
    import copy

    from torch._functorch.compile_utils import fx_graph_cse

    graph = fx_graph_cse(gm.graph)
    graph._codegen = copy_codegen(gm.graph._codegen)  # keeps the (primals, tangents) convention
    new = torch.fx.GraphModule(gm, graph)
    new.meta.update(gm.meta)
    return new
