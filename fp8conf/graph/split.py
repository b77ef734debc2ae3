"""GraphPP: cut a pipeline stage's joint graph into forward, backward-input and backward-weight.

Zero-bubble pipeline schedules run a stage's input-gradient work (dI) as soon as the gradient of
its output arrives, so that the previous stage can go on, and its weight-gradient work (dW)
later, in what would otherwise be a bubble. :func:`split_stage` makes the three callables from
the joint graph :func:`fp8conf.trace_joint` traced:

``forward(*primals) -> (*outputs, *saved)``
    ``primals`` are the joint graph's non-tangent placeholders in their order (parameters,
    buffers, inputs); ``saved`` are the values the backward needs from the forward.
``backward_input(*saved[saved_for_input], *tangents) -> (*input_grads, *carried)``
    ``tangents`` are the gradients of the outputs in the joint graph's order; ``input_grads``
    follow :attr:`StageSplit.input_grads`; ``carried`` are the values dW needs from dI.
``backward_weight(*saved[saved_for_weight], *carried) -> (*param_grads,)``
    ``param_grads`` follow :attr:`StageSplit.param_grads` (parameter FQNs).

dI holds every backward node an input gradient depends on; dW holds the rest of what the
parameter gradients need. A value made in dI and needed in dW is *carried*, never recomputed:
an FP8 tensor quantized once in dI (the gradient of the output, cast for both matmuls) crosses
as an FP8 placeholder of dW with its scale, and dW's matmul region starts at that placeholder
(which :func:`fp8conf.identify_fp8_regions` accepts as a complete boundary). A value dW uses
only for its size crosses as the size. A stage whose input needs no gradient (the first stage)
gets an empty dI that only carries the tangents; that split is degenerate but correct.

Strict validation runs on the whole stage graph before the cut. Each callable keeps the
provenance of every node, gets its own copy of the trace information, and records how much FP8
compute its siblings hold under validation's own key (``SIBLING_COMPUTE_META_KEY``), so that
validating one callable does not fail it for compute that lives in another. The calling
convention of the stage is read from its :class:`~fp8conf.JointSignature`.
"""

from __future__ import annotations

import collections
import dataclasses
import operator
from collections.abc import Callable, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree

from fp8conf.arguments import require
from fp8conf import errors
from fp8conf.graph.provenance import get_provenance, node_passes
from fp8conf.graph.roles import is_fp8_compute
from fp8conf.graph.trace import JOINT_SIGNATURE_META_KEY, JointSignature, collector_paused, joint_signature, trace_info
from fp8conf.graph.validate import SIBLING_COMPUTE_META_KEY, validate_fp8_graph

__all__ = ["SPLIT_META_KEY", "SplitPart", "StageSplit", "split_stage"]

#: Key of :class:`SplitPart` in a callable's ``gm.meta``.
SPLIT_META_KEY = "fp8conf_split"

_SIZE_QUERIES = ("aten.sym_size.int", "aten.sym_numel.default", "aten.sym_stride.int", "aten.sym_storage_offset.default")


@dataclasses.dataclass(frozen=True)
class SplitPart:
    """Which callable a graph is, and the FP8 compute its siblings hold per
    ``(module_fqn, call, pass)``."""

    name: str
    sibling_compute: dict[tuple[str, int, str], int]


@dataclasses.dataclass(frozen=True)
class StageSplit:
    """The three callables of a stage and how their inputs and outputs connect (see the module
    docstring for the calling convention)."""

    forward: torch.fx.GraphModule
    backward_input: torch.fx.GraphModule
    backward_weight: torch.fx.GraphModule
    num_outputs: int
    saved_for_input: tuple[int, ...]
    saved_for_weight: tuple[int, ...]
    input_grads: tuple[str, ...]
    param_grads: tuple[str, ...]
    #: For each flat output of the joint graph: ``("output" | "input_grad" | "param_grad", i)``,
    #: ``("primal", i)`` for a non-tensor attribute of a sharded parameter's gradient (its
    #: ``device_mesh``, the joint graph's primal ``i`` passed through), or None where the joint
    #: graph returns None (a primal without gradient).
    output_layout: tuple[tuple[str, int] | None, ...]

    @property
    def parts(self) -> dict[str, torch.fx.GraphModule]:
        return {"forward": self.forward, "backward_input": self.backward_input, "backward_weight": self.backward_weight}

    def run_forward(self, primals: Sequence, fn: Callable | None = None) -> tuple[tuple, tuple]:
        """``(outputs, saved)``."""
        result = tuple((fn or self.forward)(*primals))
        return result[: self.num_outputs], result[self.num_outputs :]

    def run_backward_input(self, saved: Sequence, tangents: Sequence, fn: Callable | None = None) -> tuple[tuple, tuple]:
        """``(input_grads, carried)``."""
        result = tuple((fn or self.backward_input)(*(saved[i] for i in self.saved_for_input), *tangents))
        return result[: len(self.input_grads)], result[len(self.input_grads) :]

    def run_backward_weight(self, saved: Sequence, carried: Sequence, fn: Callable | None = None) -> tuple:
        """``param_grads``."""
        return tuple((fn or self.backward_weight)(*(saved[i] for i in self.saved_for_weight), *carried))

    def run(self, primals: Sequence, tangents: Sequence, fns: dict[str, Callable] | None = None) -> list:
        """Forward, then dI, then dW; returns the joint graph's flat outputs, so that
        ``fp8conf.run_joint(gm, model, args, grads, fn=split.run)`` runs the split in place of
        ``gm``. ``fns`` may replace the callables (by part name) with compiled ones."""
        fns = fns or {}
        outputs, saved = self.run_forward(primals, fns.get("forward"))
        input_grads, carried = self.run_backward_input(saved, tangents, fns.get("backward_input"))
        param_grads = self.run_backward_weight(saved, carried, fns.get("backward_weight"))
        values = {"output": outputs, "input_grad": input_grads, "param_grad": param_grads, "primal": primals}
        return [None if slot is None else values[slot[0]][slot[1]] for slot in self.output_layout]


def split_stage(gm: torch.fx.GraphModule, *, strict: bool = True) -> StageSplit:
    """Cut the joint graph ``gm`` of one pipeline stage into forward, dI and dW callables.

    ``gm`` is validated first (strictly when ``strict``: an invalid stage raises its
    :class:`~fp8conf.errors.FP8ValidationError` before anything is cut) and is not changed.
    Raises :class:`~fp8conf.errors.FP8GraphSplitError` when the graph cannot be cut correctly.
    """
    require(gm, "graph module", "split_stage", "gm")
    validate_fp8_graph(gm, strict=strict)
    # The split makes a few objects per node, all of which live as long as the callables; a
    # paused collector doubled its speed per node on 100k-node graphs (benchmarks/bench_passes.py).
    with collector_paused():
        return _split(gm)


def _signature_of(gm) -> JointSignature:
    signature = joint_signature(gm)
    if signature is None:
        raise errors.FP8GraphSplitError(
            "split_stage needs the joint signature fp8conf.trace_joint records (gm.meta"
            f"[{JOINT_SIGNATURE_META_KEY!r}], one entry per placeholder); trace the stage with fp8conf.trace_joint "
            "and keep gm.meta in rewrites"
        )
    return signature


def _split(gm: torch.fx.GraphModule) -> StageSplit:
    signature = _signature_of(gm)
    passes = node_passes(gm.graph)
    placeholders = gm.graph.find_nodes(op="placeholder")
    tangents = [p for p, spec in zip(placeholders, signature.inputs) if spec.is_tangent]
    primals = [p for p, spec in zip(placeholders, signature.inputs) if not spec.is_tangent]
    layout, outputs, input_grads, param_grads = _classify_outputs(gm, signature)
    if not param_grads:
        raise errors.FP8GraphSplitError(
            f"the stage graph of {_model_name(gm)} returns no parameter gradient, so there is no "
            "backward-weight work to split off; run it unsplit (fp8conf.run_joint)"
        )
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    backward = {n for n in gm.graph.nodes if n.op == "call_function" and passes[n] == "backward"}
    forward = {n for n in gm.graph.nodes if n.op in ("call_function", "get_attr") and n not in backward}
    tangent_set = set(tangents)
    _check_forward_closed(forward, tangent_set, backward)

    d_i = _ancestors([v for _, v in input_grads], backward)
    needed_w = _ancestors([v for _, v in param_grads], backward)
    d_i |= _size_queries_carried_as_sizes(d_i, needed_w - d_i) | _getitems_of(d_i, needed_w - d_i)
    pulled = _getitems_of(forward, d_i | needed_w)  # a multi-output forward op crosses as its items
    forward |= pulled
    d_i -= pulled
    d_w = _weight_nodes(d_i, needed_w - pulled)
    inputs_of_forward = forward | set(primals)
    saved = sorted({i for n in d_i | d_w for i in n.all_input_nodes if i in inputs_of_forward}, key=order.__getitem__)
    saved += sorted({v for _, v in input_grads + param_grads if v in inputs_of_forward} - set(saved), key=order.__getitem__)
    saved_index = {n: i for i, n in enumerate(saved)}
    # dW receives from dI what it needs (tangents too: the output gradient arrives at dI).
    carried = sorted(
        {i for n in d_w for i in n.all_input_nodes if (i in d_i and i not in d_w) or i in tangent_set}
        | {v for _, v in param_grads if (v in d_i and v not in d_w) or v in tangent_set},
        key=order.__getitem__,
    )
    returned_i, returned_w = {v for _, v in input_grads}, {v for _, v in param_grads}
    saved_i = [n for n in saved if _used_by(n, d_i, returned_i)]
    saved_w = [n for n in saved if _used_by(n, d_w, returned_w)]

    parts = {
        "forward": _extract(gm, primals, forward, [v for _, v in outputs] + saved, order),
        "backward_input": _extract(gm, saved_i + tangents, d_i, [v for _, v in input_grads] + carried, order),
        "backward_weight": _extract(gm, saved_w + carried, d_w, [v for _, v in param_grads], order),
    }
    _record_siblings(parts)
    return StageSplit(
        forward=parts["forward"],
        backward_input=parts["backward_input"],
        backward_weight=parts["backward_weight"],
        num_outputs=len(outputs),
        saved_for_input=tuple(saved_index[n] for n in saved_i),
        saved_for_weight=tuple(saved_index[n] for n in saved_w),
        input_grads=tuple(k for k, _ in input_grads),
        param_grads=tuple(k for k, _ in param_grads),
        output_layout=layout,
    )


def _model_name(gm) -> str:
    info = trace_info(gm)
    return info.model_name if info is not None else "the graph"


def _classify_outputs(gm, signature):
    output_node = gm.graph.find_nodes(op="output")[0]
    flat, _ = pytree.tree_flatten(output_node.args[0], is_leaf=lambda x: x is None)
    if len(flat) != len(signature.outputs):
        raise errors.FP8GraphSplitError(
            f"the stage graph returns {len(flat)} values but its joint signature describes {len(signature.outputs)}: "
            "a rewrite changed the outputs; keep the graph's outputs as fp8conf.trace_joint made them"
        )
    layout, outputs, input_grads, param_grads = [], [], [], []
    slots = {"output": outputs, "input_grad": input_grads, "param_grad": param_grads}
    primals = [p for p, spec in zip(gm.graph.find_nodes(op="placeholder"), signature.inputs) if not spec.is_tangent]
    for spec, value in zip(signature.outputs, flat):
        if spec is None or value is None:
            layout.append(None)
            continue
        if spec.kind == "subclass_meta" and value in primals:
            layout.append(("primal", primals.index(value)))  # a sharded gradient's mesh, passed through
            continue
        if spec.kind not in slots:
            raise errors.FP8GraphSplitError(
                f"cannot split at output {getattr(value, 'name', value)!r} ({spec.kind}): only forward outputs, "
                "input gradients and parameter gradients are supported (no input mutations)",
                node_name=getattr(value, "name", None),
            )
        if not isinstance(value, torch.fx.Node):
            raise errors.FP8GraphSplitError(f"cannot split: the stage returns a constant {value!r}")
        found = slots[spec.kind]
        layout.append((spec.kind, len(found)))
        found.append((spec.index if spec.kind == "output" else spec.target, value))
    return tuple(layout), outputs, input_grads, param_grads


def _check_forward_closed(forward, tangents, backward):
    for node in forward:
        bad = [i for i in node.all_input_nodes if i in backward or i in tangents]
        if bad:
            raise errors.FP8GraphSplitError(
                f"forward node '{node.name}' ({node.target}) uses backward value '{bad[0].name}': the graph's "
                "forward/backward tags (meta['partitioner_tag']) are inconsistent, so it cannot be cut",
                node_name=node.name,
            )


def _ancestors(roots, within) -> set:
    found, stack = set(), [r for r in roots if r in within]
    while stack:
        node = stack.pop()
        if node in found:
            continue
        found.add(node)
        stack.extend(i for i in node.all_input_nodes if i in within)
    return found


def _size_queries_carried_as_sizes(d_i, d_w) -> set:
    # A dI tensor that dW needs only for its size should not be kept alive until dW runs: the
    # size query moves into dI and its result (an int) is carried instead.
    moved = set()
    for node in d_i:
        users = [u for u in node.users if u in d_w]
        if users and all(str(u.target) in _SIZE_QUERIES for u in users):
            moved.update(users)
    return moved


def _used_by(node, part, returned) -> bool:
    return node in returned or any(u in part for u in node.users)


def _weight_nodes(d_i, needed) -> set:
    """dW: the backward nodes the parameter gradients need that dI does not compute already.
    What dI computes is carried to dW, never computed again: recomputing a cast or an FP8 matmul
    there would quantize a tensor twice, or run FP8 compute twice."""
    return needed - d_i


def _getitems_of(producers, consumers) -> set:
    # Values cross the cut as tensors, never as the tuple a multi-output op returns: the items
    # taken from such a tuple move to the producer's side.
    return {n for n in consumers if n.target is operator.getitem and n.args[0] in producers}


def _extract(gm, inputs, nodes, outputs, order) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for value in inputs:
        placeholder = graph.placeholder(value.name)
        placeholder.meta = dict(value.meta)  # fake value, provenance, pass tag: a boundary keeps them
        placeholder.meta.pop("desc", None)
        env[value] = placeholder
    for node in sorted(nodes, key=order.__getitem__):
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[v] for v in outputs))
    # Python code for the callable is generated on its first call, not here (torch's lazy
    # graph module): the split itself stays a graph operation.
    from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module

    with _use_lazy_graph_module(True):
        part = _make_graph_module(gm, graph)
    part.meta.update({k: v for k, v in gm.meta.items()})
    return part


def _record_siblings(parts: dict[str, torch.fx.GraphModule]) -> None:
    counts = {name: _compute_per_call(part) for name, part in parts.items()}
    for name, part in parts.items():
        siblings: collections.Counter = collections.Counter()
        for other, count in counts.items():
            if other != name:
                siblings.update(count)
        part.meta[SPLIT_META_KEY] = SplitPart(name, dict(siblings))
        part.meta[SIBLING_COMPUTE_META_KEY] = dict(siblings)


def _compute_per_call(part) -> collections.Counter:
    passes = node_passes(part.graph)
    found: collections.Counter = collections.Counter()
    for node in part.graph.nodes:
        provenance = get_provenance(node)
        if is_fp8_compute(node) and node.op == "call_function" and provenance is not None:
            found[(provenance.module_fqn, provenance.call, passes[node])] += 1
    return found
