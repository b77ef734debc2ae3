"""A joint graph as rows that two traces of one model share node for node, whatever their node
names: what each node computes, for which block and module, from which nodes (by position)."""

from __future__ import annotations

import torch

import fp8conf
from fp8conf.graph.trace import run_joint, trace_info


def joint_shape(gm) -> list:
    """Every node as what it computes, for whom and from which nodes (by position, names aside);
    sequence numbers relative to the first op's, gradient accumulation's as such."""
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    base = min(n.meta["seq_nr"] for n in ops)
    forward = {n.meta["seq_nr"] for n in ops if n.meta.get("partitioner_tag") == "is_forward"}

    def arg(a):
        return ("node", position[a]) if isinstance(a, torch.fx.Node) else a

    rows = []
    for n in gm.graph.nodes:
        seq = n.meta.get("seq_nr")
        provenance = n.meta.get("fp8conf_provenance")
        val = n.meta.get("val")
        rows.append((
            n.op, str(n.target), n.meta.get("fp8conf_block"), n.meta.get("fp8conf_owner"), n.meta.get("partitioner_tag"),
            (seq - base if seq in forward else "accumulation") if n.op == "call_function" else None,
            provenance, torch.utils._pytree.tree_map(arg, (n.args, n.kwargs)),
            (tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else None,
        ))
    return rows


def assert_same_joint(model, args, whole, seen, what: str) -> None:
    """``seen`` is ``whole``, the graph of every block traced, node for node (ops, wiring, blocks,
    owners, provenance, sequence-number pairing, shapes), with the same signature and module
    calls, and gives bit-equal results: a copy wired to the wrong neighbour, or numbered apart
    from its backward, fails here, naming the node and ``what`` was traced."""
    assert len(seen.graph.nodes) == len(whole.graph.nodes), f"{what} has {len(seen.graph.nodes)} nodes, the whole trace {len(whole.graph.nodes)}"
    for i, (a, b) in enumerate(zip(joint_shape(whole), joint_shape(seen))):
        assert a == b, f"node {i} of {what} differs from the whole trace's: {b} against {a}"
    assert fp8conf.joint_signature(seen) == fp8conf.joint_signature(whole)
    assert trace_info(seen).calls == trace_info(whole).calls and trace_info(seen).modules == trace_info(whole).modules
    out = next(n for n in whole.graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")).meta["val"]
    grad = (torch.randn(out.shape, dtype=out.dtype),)
    (expected,), expected_grads = run_joint(whole, model, args, grad)
    (result,), grads = run_joint(seen, model, args, grad)
    assert torch.equal(result, expected), f"the output of {what} differs from the whole trace's"
    assert grads.keys() == expected_grads.keys()
    for key, value in expected_grads.items():
        assert (value is None and grads[key] is None) or torch.equal(grads[key], value), f"gradient of {key} differs ({what})"
