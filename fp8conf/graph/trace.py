"""Tracing a training step into one joint forward+backward ``torch.fx`` graph.

``aot_export_joint_with_descriptors`` is used rather than ``make_fx`` because it is the entry
point graph trainers build on: it functionalises the step, tags every node forward/backward
(``partitioner_tag``), records autograd sequence numbers (``seq_nr``) that pair backward nodes
with forward ops, and describes every placeholder and output (parameter FQN, user input,
tangent, gradient), from which tracing computes the graph's :class:`JointSignature` once, for every later stage.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree

from fp8conf.arguments import require
from fp8conf.errors import FP8TraceError
from fp8conf.graph.auto_repeat import PROOF_BLOCKS, find_block_container, graph_difference, repeat_refusal
from fp8conf.graph.call_inputs import input_check
from fp8conf.graph.collectives import record_collectives
from fp8conf.graph.equal_blocks import TRACED_BLOCKS, check_equal_blocks, truncated
from fp8conf.graph.lazy_code import codegen_deferred, graph_module
from fp8conf.graph.provenance import CallRecord, node_passes, propagate_provenance, record_forward_provenance
from fp8conf.graph.repeat import RepeatRefused, repeat_blocks, repeat_calls
from fp8conf.log import fell_back, library_notices_quieted
from fp8conf.parallel.layout import ParallelLayout, layout_of
from fp8conf.quantized.protocol import QuantizationConfig, find_quantized_modules

__all__ = [
    "TRACE_META_KEY",
    "JOINT_SIGNATURE_META_KEY",
    "TraceInfo",
    "JointInput",
    "JointOutput",
    "JointSignature",
    "as_args",
    "trace_joint",
    "trace_info",
    "joint_signature",
    "run_joint",
    "joint_inputs",
    "copy_graph_module",
    "flat_graph_module",
]

#: Key of :class:`TraceInfo` in ``gm.meta``.
TRACE_META_KEY = "fp8conf_trace"
#: Key of :class:`JointSignature` in ``gm.meta``.
JOINT_SIGNATURE_META_KEY = "fp8conf_joint_signature"


@dataclasses.dataclass(frozen=True)
class TraceInfo:
    """What tracing learnt about the model, kept on the graph for the passes that follow."""

    model_name: str
    modules: dict[str, QuantizationConfig]
    calls: tuple[CallRecord, ...]
    #: How the model's parameters are laid out over ranks (None: unsharded).
    layout: ParallelLayout | None = None
    #: The container whose first blocks were traced and copied for the rest (None: every block traced).
    repeated: str | None = None
    #: The fast paths of tracing not taken, as ``"path: reason"`` (an equal-blocks trace refused).
    fallbacks: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class JointInput:
    """One flat input (placeholder) of a joint graph.

    Attributes:
        kind: ``"param"``, ``"buffer"``, ``"input"`` (a positional user input), ``"tangent"``
            (the gradient of a user output) or ``"other"`` (nothing fp8conf can feed).
        target: the parameter or buffer FQN (``param``, ``buffer``).
        index: the user input's position (``input``), the output a tangent belongs to
            (``tangent``), or the placeholder's position (``other``).
        attrs: for a parameter or buffer that is a tensor subclass (a ``DTensor`` shard), the
            attribute path to the inner value the placeholder takes (``("_local_tensor",)``).
    """

    kind: str
    target: str | None = None
    index: int | None = None
    attrs: tuple[str, ...] = ()

    @property
    def is_tangent(self) -> bool:
        return self.kind == "tangent"


@dataclasses.dataclass(frozen=True)
class JointOutput:
    """One flat output of a joint graph.

    Attributes:
        kind: ``"output"`` (a user output), ``"param_grad"`` (gradient of a parameter or buffer),
            ``"input_grad"`` (gradient of a positional input) or ``"other"`` (e.g. an input
            mutation).
        target: the gradient's key in :func:`run_joint`'s ``grads``: the parameter FQN, or
            ``"input.<i>"``.
        index: the user output's position (``output``), the input's (``input_grad``), or the
            output's own position (``other``).
        attrs: for the gradient of a tensor-subclass parameter, the attribute path of the inner
            value returned (``("_local_tensor",)``: the gradient of this rank's shard). A
            non-tensor attribute of such a gradient (its ``device_mesh``) is kind ``"subclass_meta"``.
    """

    kind: str
    target: str | None = None
    index: int | None = None
    attrs: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class JointSignature:
    """The calling convention of a joint graph, computed once when it is traced.

    ``inputs`` describe the placeholders in order (primals first, then tangents); ``outputs``
    the flat outputs in order, ``None`` where the graph returns ``None`` (the gradient of a
    primal that needs none). Every stage that calls or cuts the graph reads it from
    ``gm.meta`` (:func:`joint_signature`) rather than re-deriving it.
    """

    inputs: tuple[JointInput, ...]
    outputs: tuple[JointOutput | None, ...]

    @classmethod
    def of_traced(cls, gm: torch.fx.GraphModule) -> JointSignature:
        """Read a freshly traced graph's AOT descriptors."""
        from torch._functorch._aot_autograd import descriptors as d

        inputs = tuple(_describe_input(node.meta.get("desc"), i, d) for i, node in enumerate(gm.graph.find_nodes(op="placeholder")))
        output_node = gm.graph.find_nodes(op="output")[0]
        flat, _ = pytree.tree_flatten(output_node.args[0], is_leaf=lambda x: x is None)
        descs = output_node.meta.get("desc") or [None] * len(flat)
        outputs = tuple(None if value is None else _describe_output(desc, i, d, value) for i, (desc, value) in enumerate(zip(descs, flat)))
        return cls(inputs, outputs)

    @property
    def num_primals(self) -> int:
        return sum(not i.is_tangent for i in self.inputs)

    def feed(self, model: torch.nn.Module, args, grad_outputs) -> tuple[list, list]:
        """``(primals, tangents)`` for ``model``'s current parameters and buffers, the positional
        ``args`` and the gradients of the outputs, in placeholder order."""
        args, grad_outputs = as_args(args), as_args(grad_outputs)
        for kind, given, what in (("input", args, "args"), ("tangent", grad_outputs, "grad_outputs")):
            needed = 1 + max((spec.index for spec in self.inputs if spec.kind == kind), default=-1)
            if len(given) < needed:
                raise FP8TraceError(
                    f"the joint graph takes {needed} {what} (one {'gradient per output of the step' if kind == 'tangent' else 'per positional input'}), "
                    f"{len(given)} given; pass {what} as the step was traced"
                )
        state = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
        primals, tangents = [], []
        for i, spec in enumerate(self.inputs):
            if spec.kind in ("param", "buffer"):
                if spec.target not in state:
                    raise FP8TraceError(
                        f"joint graph input {i} is {spec.kind} {spec.target!r}, which {type(model).__qualname__} lacks; "
                        "call the graph with the model it was traced from"
                    )
                value = state[spec.target]
                for attr in spec.attrs:  # a sharded parameter: the placeholder takes its local tensor
                    value = getattr(value, attr)
                primals.append(value)
            elif spec.kind == "input":
                primals.append(args[spec.index])
            elif spec.kind == "tangent":
                tangents.append(grad_outputs[spec.index])
            else:
                raise FP8TraceError(f"joint graph input {i} is not a parameter, buffer, input or tangent; call the graph with flat inputs")
        return primals, tangents

    def results(self, returned) -> tuple[tuple, dict]:
        """``(outputs, grads)`` from what the graph (or a callable with its convention) returned."""
        flat, _ = pytree.tree_flatten(returned, is_leaf=lambda x: x is None)
        outputs, grads = {}, {}
        for spec, value in zip(self.outputs, flat):
            if spec is None or value is None:
                continue
            if spec.kind == "output":
                outputs[spec.index] = value
            elif spec.kind in ("param_grad", "input_grad") and (not spec.attrs or isinstance(value, torch.Tensor)):
                grads[spec.target] = value
        return tuple(outputs[i] for i in sorted(outputs)), grads


def _subclass_path(desc, wrapper):
    """``(base descriptor, attribute path)`` of a descriptor of a tensor subclass's inner value."""
    attrs = []
    while isinstance(desc, wrapper):
        attrs.append(desc.attr)
        desc = desc.base
    return desc, tuple(reversed(attrs))


def _describe_input(desc, position, d) -> JointInput:
    desc, attrs = _subclass_path(desc, d.SubclassGetAttrAOTInput)
    if isinstance(desc, d.ParamAOTInput):
        return JointInput("param", target=desc.target, attrs=attrs)
    if isinstance(desc, d.BufferAOTInput):
        return JointInput("buffer", target=desc.target, attrs=attrs)
    if attrs:
        return JointInput("other", index=position)
    if isinstance(desc, d.PlainAOTInput):
        return JointInput("input", index=desc.idx)
    if isinstance(desc, d.TangentAOTInput) and isinstance(desc.output, d.PlainAOTOutput):
        return JointInput("tangent", index=desc.output.idx)
    return JointInput("other", index=position)


def _describe_output(desc, position, d, value=None) -> JointOutput:
    desc, attrs = _subclass_path(desc, d.SubclassGetAttrAOTOutput)
    if attrs:
        if not (isinstance(desc, d.GradAOTOutput) and isinstance(desc.grad_of, (d.ParamAOTInput, d.BufferAOTInput))):
            return JointOutput("other", index=position)
        if not isinstance(getattr(value, "meta", {}).get("val"), torch.Tensor):
            return JointOutput("subclass_meta", target=desc.grad_of.target, index=position, attrs=attrs)
        return JointOutput("param_grad", target=desc.grad_of.target, attrs=attrs)
    if isinstance(desc, d.PlainAOTOutput):
        return JointOutput("output", index=desc.idx)
    if isinstance(desc, d.GradAOTOutput) and isinstance(desc.grad_of, d.PlainAOTInput):
        return JointOutput("input_grad", target=f"input.{desc.grad_of.idx}", index=desc.grad_of.idx)
    if isinstance(desc, d.GradAOTOutput) and isinstance(desc.grad_of, (d.ParamAOTInput, d.BufferAOTInput)):
        return JointOutput("param_grad", target=desc.grad_of.target)
    return JointOutput("other", index=position)


def as_args(args) -> tuple:
    """Positional arguments as a tuple: a lone tensor (or ``None``) becomes a 1-tuple."""
    if isinstance(args, (tuple, list)):
        return tuple(args)
    return (args,)


def trace_info(gm: torch.fx.GraphModule) -> TraceInfo | None:
    require(gm, "graph module", "trace_info", "gm")
    return gm.meta.get(TRACE_META_KEY)


def joint_signature(gm: torch.fx.GraphModule) -> JointSignature | None:
    """The :class:`JointSignature` :func:`trace_joint` stored on ``gm`` (``None`` when the graph
    was not traced by it or a rewrite dropped ``gm.meta``, or it no longer fits the placeholders)."""
    require(gm, "graph module", "joint_signature", "gm")
    signature = gm.meta.get(JOINT_SIGNATURE_META_KEY)
    if signature is None or len(signature.inputs) != len(gm.graph.find_nodes(op="placeholder")):
        return None
    return signature


def _require_signature(gm, what: str) -> JointSignature:
    signature = joint_signature(gm)
    if signature is None:
        raise FP8TraceError(
            f"{what} needs the joint signature of the graph (gm.meta[{JOINT_SIGNATURE_META_KEY!r}], matching its "
            "placeholders); trace it with fp8conf.trace_joint and keep gm.meta when a rewrite makes a new GraphModule"
        )
    return signature


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector paused inside the block, and left as it was found after.

    Tracing and compiling a joint graph allocate millions of objects that stay alive (nodes, their
    meta, fake tensors). Each full collection those allocations trigger scans all of them and
    finds almost no garbage, and there are more collections the larger the graph: the collector's
    share grew with depth, to 12 % of a 16-block cold start (benchmarks/bench_coldstart.py). The
    little cyclic garbage made meanwhile is collected after the block, as always.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def with_collector_paused(fn):
    """``fn`` run under :func:`collector_paused` and :func:`~fp8conf.graph.lazy_code.codegen_deferred`."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with collector_paused(), codegen_deferred():
            return fn(*args, **kwargs)

    return run


@with_collector_paused
def trace_joint(model: torch.nn.Module, args, *, repeat: str | bool | None = None, per_block: tuple[str, ...] = ()) -> torch.fx.GraphModule:
    """Trace ``model(*args)`` plus its backward into one joint graph with provenance on it.

    ``args`` is a tuple of example inputs (a single tensor is accepted too). The returned
    graph module takes, in placeholder order, the parameters and buffers, the inputs and one
    tangent per output; :func:`run_joint` calls it for you. Works for CPU and CUDA models alike:
    the graph runs on the device of the example inputs and parameters.

    A deep model's blocks are traced once: only four blocks of its container of equal blocks are
    traced and the graph of the others is copied from them (:mod:`fp8conf.graph.repeat`), so that
    tracing costs what tracing four blocks does. ``repeat`` says how:

    * ``None`` (the default): trace_joint finds the container itself and proves on the model that
      copying gives what tracing every block would (:mod:`fp8conf.graph.auto_repeat`: a container
      of at least :data:`~fp8conf.graph.auto_repeat.AUTO_REPEAT_MIN_BLOCKS` equal blocks, the
      graph at five blocks the graph at four with a block copied). Where no container pays, the
      model is traced whole; where one would but cannot be repeated, too, and the reason is logged
      through the ``fp8conf`` logger and kept in :class:`TraceInfo` ``.fallbacks``.
    * a container's name (``"layers"``): the caller vouches that its blocks compute the same
      function of their parameters, at any depth; they are repeated from five blocks on, unproven.
      The blocks must be one class with equal attributes (checked; :class:`FP8TraceError` names
      what differs), attributes named in ``per_block`` aside (ones the forward never reads, such as
      a ``layer_id`` used to initialise weights).
    * ``False``: every block is traced.
    """
    args = _check_inputs(model, args)
    if repeat is True or not isinstance(repeat, (str, bool, type(None))):
        raise FP8TraceError(f"trace_joint(repeat={repeat!r}): name the container of equal blocks, pass False to trace every block, "
                            "or leave repeat out for trace_joint to find it")
    if per_block and not isinstance(repeat, str):
        raise FP8TraceError("trace_joint(per_block=...) names attributes of repeated blocks: give repeat= too")
    if isinstance(repeat, str):
        if layout_of(model) is not None:
            raise FP8TraceError(
                f"trace_joint(repeat={repeat!r}) of a sharded model: the copied blocks would carry block 1's collective "
                "records (which parameter each gather moves); trace the sharded model without repeat="
            )
        blocks = check_equal_blocks(model, repeat, per_block)
        if len(blocks) > TRACED_BLOCKS:
            return _finish(model, *_trace(model, args, repeat), blocks=blocks, repeated=repeat)
        return _finish(model, *_trace(model, args))
    found = find_block_container(model) if repeat is None else None
    if found is None:
        return _finish(model, *_trace(model, args))
    container, blocks = found
    why = repeat_refusal(model, container)
    if why is None:
        gm, why = _trace_proven(model, args, container, blocks)
        if gm is not None:
            return gm
    line = fell_back("equal-blocks trace", f"{type(model).__qualname__}.{container} is traced whole: {why}",
                     f"all its {len(blocks)} blocks are traced, not {TRACED_BLOCKS}")
    return _finish(model, *_trace(model, args), fallbacks=(line,))


def _trace(model, args, container: str | None = None, blocks: int = TRACED_BLOCKS) -> tuple[torch.fx.GraphModule, list[CallRecord]]:
    """The joint graph of ``model`` and the calls of its quantized modules, with ``container``
    cut to its first ``blocks`` blocks where one is named."""
    calls: list[CallRecord] = []
    with truncated(model, container, blocks) if container is not None else contextlib.nullcontext():
        traced_modules = find_quantized_modules(model)
        gm = _aot_trace(model, args, traced_modules, calls)
        gm = propagate_provenance(gm, traced_modules)
        record_collectives(gm, node_passes(gm.graph))
    return gm, calls


def _trace_proven(model, args, container: str, blocks: list[str]) -> tuple[torch.fx.GraphModule | None, str | None]:
    """``(graph, None)``: the graph of ``model`` with ``container``'s blocks repeated, once the
    proof holds (:mod:`fp8conf.graph.auto_repeat`); else ``(None, why not)``."""
    try:
        four, four_calls = _trace(model, args, container, TRACED_BLOCKS)
        five, five_calls = _trace(model, args, container, PROOF_BLOCKS)
        copied = repeat_blocks(four, blocks[:PROOF_BLOCKS])
        why = graph_difference(five, copied)
        if why is None and list(repeat_calls(four_calls, blocks[:PROOF_BLOCKS])) != five_calls:
            why = "its quantized modules are called otherwise"
    except RepeatRefused as exc:  # what the graph shows: said as the fallback's reason, not as the advice to a repeat= caller
        return None, f"its blocks cannot be traced four and copied ({exc.why})"
    except Exception as exc:  # whatever the cut model or the copy fails on, the whole model is traced instead
        return None, f"its blocks cannot be traced four and copied ({type(exc).__name__}: {exc})"
    if why is not None:
        return None, (f"copying a block of the {TRACED_BLOCKS}-block trace does not give the {PROOF_BLOCKS}-block trace ({why}); "
                      "the forward depends on the depth or on which block runs")
    return _finish(model, four, four_calls, blocks=blocks, repeated=container), None


def _finish(model, gm, calls, *, blocks: list[str] | None = None, repeated: str | None = None, fallbacks: tuple[str, ...] = ()) -> torch.fx.GraphModule:
    """``gm`` traced with the first blocks of ``repeated`` (if any) made the graph of all
    ``blocks``, with the trace's :class:`TraceInfo` and :class:`JointSignature` on it."""
    if repeated is not None:
        gm = repeat_blocks(gm, blocks)
        calls = list(repeat_calls(calls, blocks))
    modules = find_quantized_modules(model)
    gm.meta[TRACE_META_KEY] = TraceInfo(type(model).__name__, modules, tuple(calls), layout_of(model), repeated, fallbacks)
    gm.meta[JOINT_SIGNATURE_META_KEY] = JointSignature.of_traced(gm)
    return gm


def _aot_trace(model, args, modules, calls) -> torch.fx.GraphModule:
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
    return joint.graph_module


def _check_inputs(model, args) -> tuple:
    if not isinstance(model, torch.nn.Module):
        raise FP8TraceError(f"trace_joint expects a torch.nn.Module, got {type(model).__qualname__}")
    if not isinstance(args, (tuple, list, torch.Tensor)):
        raise FP8TraceError(f"trace_joint expects a tuple of example inputs, got {type(args).__qualname__}")
    return as_args(args)


def run_joint(gm: torch.fx.GraphModule, model: torch.nn.Module, args, grad_outputs, *, fn=None) -> tuple[tuple, dict]:
    """Execute a joint graph made by :func:`trace_joint` with ``model``'s current parameters.

    ``fn`` runs instead of ``gm`` when given: a compiled version of it with the same calling
    convention (see :mod:`fp8conf.compile.joint`). Returns ``(outputs, grads)``: the forward outputs
    as a tuple, and gradients keyed by parameter FQN plus ``"input.<i>"`` for positional inputs
    that receive one.

    The graph runs under ``torch.no_grad()``: it computes the gradients itself, and recording
    autograd through its nodes (the parameters require grad) would keep every intermediate the
    recorded ops save alive until the results die, several times the step's own memory.
    """
    require(gm, "graph module", "run_joint", "gm")
    require(model, "model", "run_joint", "model")
    signature = _require_signature(gm, "run_joint")
    primals, tangents = signature.feed(model, args, grad_outputs)
    input_check(gm, "run_joint", signature=signature)([*primals, *tangents])
    with torch.no_grad():
        returned = (fn or gm)(primals, tangents)
    return signature.results(returned)


def joint_inputs(gm: torch.fx.GraphModule, model: torch.nn.Module, args, grad_outputs) -> tuple[list, list]:
    """The ``(primals, tangents)`` lists a joint graph is called with, in placeholder order."""
    require(gm, "graph module", "joint_inputs", "gm")
    require(model, "model", "joint_inputs", "model")
    return _require_signature(gm, "joint_inputs").feed(model, args, grad_outputs)


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` whose graph and per-node meta dicts a pass may rewrite freely.

    Values in meta (fake tensors, provenance) are shared, not copied; ``gm.meta`` is copied.
    """
    require(gm, "graph module", "copy_graph_module", "gm")
    graph = torch.fx.Graph()
    with library_notices_quieted():  # torch deprecates a check its own TreeSpec copy makes
        graph._codegen = copy.deepcopy(gm.graph._codegen)  # keeps the pytree calling convention
    value, old_output = graph.graph_copy(gm.graph, {}, return_output_node=True)
    new_output = graph.output(value)
    new_output.meta = dict(old_output.meta)
    new = graph_module(gm, graph)
    new.meta.update(gm.meta)
    return new


def flat_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` called with its placeholders positionally and returning one flat list,
    whatever calling convention ``gm`` has (the form Inductor's compile entry points take).

    Like :func:`copy_graph_module`, node meta dicts are copied, their values shared."""
    graph = torch.fx.Graph()
    value, old_output = graph.graph_copy(gm.graph, {}, return_output_node=True)
    flat, _ = pytree.tree_flatten(value, is_leaf=lambda x: x is None)
    new_output = graph.output(list(flat))
    new_output.meta = dict(old_output.meta)
    new = graph_module(gm, graph, class_name="FP8ConfFlatGraph")
    new.meta.update(gm.meta)
    return new
