"""The make_fx trainer's regions and pipeline split.

* Regions: fp8conf's region growth and tagging (``fp8conf.identify_fp8_regions`` /
  ``tag_fp8_regions``), fed the trainer's own provenance and pass tags.
* Split (:func:`split_train_step`): the traced step cut into forward, backward-input (dI) and
  backward-weight (dW) graphs, run by :class:`StageRunner`. dI holds the backward ops the input
  gradients need; dW the rest of what the parameter gradients need, and the backward's in-place
  ops that no gradient needs (with what they read), which the joint step runs too. A value dI
  makes and dW uses is handed over, never recomputed, so an FP8 tensor quantized once in dI
  reaches dW as an FP8 input.

Its signature and artifact key live in :mod:`conformance.backends.makefx_fingerprint`.
"""

from __future__ import annotations

import collections
import dataclasses
import operator

import torch
import torch.fx
import torch.utils._pytree as pytree

from conformance.backends.makefx_trainer import (
    SIBLINGS_KEY, STEP_KEY, check_fp8_graph, is_fp8_matmul, module_call, module_provenance, phase_of,
)

__all__ = ["ModuleTag", "fp8_regions", "StageRunner", "split_train_step"]


@dataclasses.dataclass(frozen=True)
class ModuleTag:
    """The trainer's provenance as fp8conf's region growth reads it."""

    module_fqn: str
    kind: str
    emulate: bool
    call: int = 0


def _tag_of(node) -> ModuleTag | None:
    found = module_provenance(node)
    return None if found is None else ModuleTag(*found, module_call(node) or 0)


def fp8_regions(gm: torch.fx.GraphModule):
    """Identify the FP8 regions of ``gm`` and tag the complete ones for regional Inductor;
    incomplete ones are left untagged (with a warning)."""
    import fp8conf

    passes = {node: phase_of(node) for node in gm.graph.nodes}
    found = fp8conf.identify_fp8_regions(gm, provenance_of=_tag_of, passes=passes)
    return fp8conf.tag_fp8_regions(gm, found, strict=False)


@dataclasses.dataclass
class StageRunner:
    """Runs the three graphs of a split step the way the joint step is called:
    ``run(params, buffers, args, tangents) -> (outputs, param_grads, input_grads)``.

    Each ``*_io`` is ``(inputs, outputs)``: the joint graph's nodes each graph takes and returns.
    """

    forward: torch.fx.GraphModule
    backward_input: torch.fx.GraphModule
    backward_weight: torch.fx.GraphModule
    placeholders: list
    io: dict
    output_tree: object

    def run(self, params, buffers, args, tangents):
        values = dict(zip(self.placeholders, pytree.tree_leaves((params, buffers, tuple(args), tuple(tangents)))))
        for name in ("forward", "backward_input", "backward_weight"):
            inputs, outputs = self.io[name]
            results = getattr(self, name)(*(values[n] for n in inputs))
            values.update(zip(outputs, results))
        return pytree.tree_map(lambda n: values[n] if isinstance(n, torch.fx.Node) else n, self.output_tree)


def split_train_step(gm: torch.fx.GraphModule, *, strict: bool = True) -> StageRunner:
    """Cut the traced step ``gm`` into forward, dI and dW graphs; ``gm`` is not changed. The
    whole step is checked first (:func:`check_fp8_graph`), strictly when ``strict``."""
    check_fp8_graph(gm, strict=strict)
    step = gm.meta[STEP_KEY]
    # make_fx returns a flat output; its pytree codegen rebuilds (outputs, param_grads, input_grads).
    flat = gm.graph.find_nodes(op="output")[0].args[0]
    output_tree = pytree.tree_unflatten(list(flat), gm.graph._codegen.pytree_info.out_spec)
    outputs, param_grads, input_grads = output_tree
    roots_i = [n for n in pytree.tree_leaves(input_grads) if isinstance(n, torch.fx.Node)]
    roots_w = [n for n in pytree.tree_leaves(param_grads) if isinstance(n, torch.fx.Node)]
    if not roots_w:
        raise RuntimeError(f"job {step.job_name!r}: the step returns no parameter gradient, so there is no dW to split off")
    backward = {n for n in gm.graph.nodes if n.op == "call_function" and phase_of(n) == "backward"}
    forward = {n for n in gm.graph.nodes if n.op in ("call_function", "get_attr") and n not in backward}
    for node in forward:
        if any(i in backward or phase_of(i) == "backward" for i in node.all_input_nodes):
            raise RuntimeError(f"job {step.job_name!r}: forward node '{node.name}' uses a backward value; the step cannot be cut")
    d_i = _ancestors(roots_i, backward)
    # In-place ops no gradient needs (TorchAO's scaling of an unneeded grad_input) run too:
    # dW runs them, with what they need that dI does not make, as the joint step does.
    mutating = [n for n in backward if n.is_impure()]
    needed_w = _ancestors(roots_w + mutating, backward)
    # Items of a dI op's tuple are taken in dI: values cross as tensors, never as tuples.
    d_i |= {n for n in needed_w if n.target is operator.getitem and n.args[0] in d_i}
    d_w = needed_w - d_i
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    placeholders = gm.graph.find_nodes(op="placeholder")

    def inputs_of(nodes, returned):
        used = {i for n in nodes for i in n.all_input_nodes if i not in nodes} | {r for r in returned if r not in nodes}
        return sorted(used, key=order.__getitem__)

    returned_f = [n for n in pytree.tree_leaves(outputs) if isinstance(n, torch.fx.Node) and n in forward]
    in_i, in_w = inputs_of(d_i, roots_i), inputs_of(d_w, roots_w)
    saved = sorted({n for n in in_i + in_w if n in forward}, key=order.__getitem__)
    carried = [n for n in in_w if n in d_i]
    io = {
        "forward": (inputs_of(forward, returned_f + saved), returned_f + [n for n in saved if n not in returned_f]),
        "backward_input": (in_i, roots_i + [n for n in carried if n not in roots_i]),
        "backward_weight": (in_w, roots_w),
    }
    parts = {name: _extract(gm, inputs, nodes, outs, order)
             for name, nodes, (inputs, outs) in (("forward", forward, io["forward"]), ("backward_input", d_i, io["backward_input"]),
                                                 ("backward_weight", d_w, io["backward_weight"]))}
    _record_siblings(parts)
    return StageRunner(parts["forward"], parts["backward_input"], parts["backward_weight"], placeholders, io, output_tree)


def _ancestors(roots, within) -> set:
    found, stack = set(), [r for r in roots if r in within]
    while stack:
        node = stack.pop()
        if node not in found:
            found.add(node)
            stack.extend(i for i in node.all_input_nodes if i in within)
    return found


def _extract(gm, inputs, nodes, outputs, order) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    env = {}
    for value in inputs:
        placeholder = graph.placeholder(value.name)
        placeholder.meta = dict(value.meta)  # value, pass tag and provenance cross with it
        env[value] = placeholder
    for node in sorted(nodes, key=order.__getitem__):
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[v] for v in outputs))
    part = torch.fx.GraphModule(gm, graph)
    part.meta.update(gm.meta)
    return part


def _record_siblings(parts) -> None:
    # Each graph is checked alone later: it is owed the FP8 matmuls its siblings hold.
    counts = {}
    for name, part in parts.items():
        found = collections.Counter()
        for node in part.graph.nodes:
            tag = module_provenance(node)
            if is_fp8_matmul(node) and tag is not None:
                found[(tag[0], phase_of(node))] += 1
        counts[name] = found
    for name, part in parts.items():
        part.meta[SIBLINGS_KEY] = dict(sum((c for other, c in counts.items() if other != name), collections.Counter()))

