"""Tracing a training step into one joint forward+backward ``torch.fx`` graph.

``aot_export_joint_with_descriptors`` is used rather than ``make_fx`` because it is the entry
point graph trainers build on: it functionalises the step, tags every node forward/backward
(``partitioner_tag``), records autograd sequence numbers (``seq_nr``) that pair backward nodes
with forward ops, and describes every placeholder and output (parameter FQN, user input,
tangent, gradient), which lets :func:`run_joint` call the graph without guessing an order.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree

from fp8conf.errors import FP8TraceError
from fp8conf.provenance import CallRecord, propagate_provenance, record_forward_provenance
from fp8conf.quantized import QuantizationConfig, find_quantized_modules

__all__ = ["TRACE_META_KEY", "TraceInfo", "trace_joint", "trace_info", "run_joint", "joint_inputs", "joint_results", "copy_graph_module"]

#: Key of :class:`TraceInfo` in ``gm.meta``.
TRACE_META_KEY = "fp8conf_trace"


@dataclasses.dataclass(frozen=True)
class TraceInfo:
    """What tracing learnt about the model, kept on the graph for the passes that follow."""

    model_name: str
    modules: dict[str, QuantizationConfig]
    calls: tuple[CallRecord, ...]


def trace_info(gm: torch.fx.GraphModule) -> TraceInfo | None:
    return gm.meta.get(TRACE_META_KEY)


def trace_joint(model: torch.nn.Module, args) -> torch.fx.GraphModule:
    """Trace ``model(*args)`` plus its backward into one joint graph with provenance on it.

    ``args`` is a tuple of example inputs (a single tensor is accepted too). The returned
    graph module takes, in placeholder order, the parameters and buffers, the inputs and one
    tangent per output; :func:`run_joint` calls it for you. Works for CPU and CUDA models alike:
    the graph runs on the device of the example inputs and parameters.
    """
    args = _check_inputs(model, args)
    modules = find_quantized_modules(model)
    calls: list[CallRecord] = []
    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors

    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(fx_traceback.preserve_node_meta())
            with record_forward_provenance(model, modules, calls):
                joint = aot_export_joint_with_descriptors(stack, model, args)
    except Exception as exc:
        shapes = ", ".join(str(tuple(a.shape)) if isinstance(a, torch.Tensor) else type(a).__name__ for a in args)
        raise FP8TraceError(
            f"could not trace {type(model).__qualname__} on inputs of shapes [{shapes}]: "
            f"{type(exc).__name__}: {exc}. Check that the inputs fit the model by calling it eagerly first."
        ) from exc
    gm = joint.graph_module
    gm.meta[TRACE_META_KEY] = TraceInfo(type(model).__name__, modules, tuple(calls))
    return propagate_provenance(gm, modules)


def _check_inputs(model, args) -> tuple:
    if not isinstance(model, torch.nn.Module):
        raise FP8TraceError(f"trace_joint expects a torch.nn.Module, got {type(model).__qualname__}")
    if isinstance(args, torch.Tensor):
        args = (args,)
    if not isinstance(args, (tuple, list)):
        raise FP8TraceError(f"trace_joint expects a tuple of example inputs, got {type(args).__qualname__}")
    return tuple(args)


def run_joint(gm: torch.fx.GraphModule, model: torch.nn.Module, args, grad_outputs, *, fn=None) -> tuple[tuple, dict]:
    """Execute a joint graph made by :func:`trace_joint` with ``model``'s current parameters.

    ``fn`` runs instead of ``gm`` when given: a compiled version of it with the same calling
    convention (see :mod:`fp8conf.compile`). Returns ``(outputs, grads)``: the forward outputs
    as a tuple, and gradients keyed by parameter FQN plus ``"input.<i>"`` for positional inputs
    that receive one.
    """
    primals, tangents = joint_inputs(gm, model, args, grad_outputs)
    return joint_results(gm, (fn or gm)(primals, tangents))


def joint_inputs(gm: torch.fx.GraphModule, model: torch.nn.Module, args, grad_outputs) -> tuple[list, list]:
    """The ``(primals, tangents)`` lists a joint graph is called with, in placeholder order."""
    from torch._functorch._aot_autograd import descriptors as d

    args = tuple(args) if not isinstance(args, torch.Tensor) else (args,)
    state = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    primals, tangents = [], []
    for node in gm.graph.find_nodes(op="placeholder"):
        values = tangents if isinstance(node.meta.get("desc"), d.TangentAOTInput) else primals
        desc = node.meta.get("desc")
        if isinstance(desc, (d.ParamAOTInput, d.BufferAOTInput)):
            values.append(state[desc.target])
        elif isinstance(desc, d.PlainAOTInput):
            values.append(args[desc.idx])
        elif isinstance(desc, d.TangentAOTInput) and isinstance(desc.output, d.PlainAOTOutput):
            values.append(grad_outputs[desc.output.idx])
        else:
            raise FP8TraceError(f"run_joint cannot feed placeholder {node.name} described as {desc!r}")
    return primals, tangents


def joint_results(gm: torch.fx.GraphModule, returned) -> tuple[tuple, dict]:
    """Split what a joint graph returned into ``(outputs, grads)`` using its output descriptors."""
    from torch._functorch._aot_autograd import descriptors as d

    # The graph returns (outputs, gradients) as a pytree; the output node's descriptors are flat.
    results, _ = pytree.tree_flatten(returned, is_leaf=lambda x: x is None)
    outputs, grads = {}, {}
    output_node = gm.graph.find_nodes(op="output")[0]
    for desc, value in zip(output_node.meta["desc"], results):
        if isinstance(desc, d.PlainAOTOutput):
            outputs[desc.idx] = value
        elif isinstance(desc, d.GradAOTOutput) and value is not None:
            grads[_grad_key(desc.grad_of, d)] = value
    return tuple(outputs[i] for i in sorted(outputs)), grads


def _grad_key(grad_of, d) -> str:
    if isinstance(grad_of, d.PlainAOTInput):
        return f"input.{grad_of.idx}"
    return grad_of.target


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` whose graph and per-node meta dicts a pass may rewrite freely.

    Values in meta (fake tensors, provenance) are shared, not copied; ``gm.meta`` is copied.
    """
    graph = torch.fx.Graph()
    graph._codegen = copy.deepcopy(gm.graph._codegen)  # keeps the pytree calling convention
    value, old_output = graph.graph_copy(gm.graph, {}, return_output_node=True)
    new_output = graph.output(value)
    new_output.meta = dict(old_output.meta)
    new = torch.fx.GraphModule(gm, graph)
    new.meta.update(gm.meta)
    return new
