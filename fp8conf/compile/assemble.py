"""The last stage of a compile: the compiled graphs made one step, called like the graph they
were compiled from.

:func:`assemble` takes the :class:`~fp8conf.compile.units.CompiledUnits` and hands back the
:class:`CompiledJoint` that :func:`~fp8conf.compile.joint.compile_joint` returns: a partitioned
graph's forward and backward run one after the other (:func:`run_partitioned`, with the joint
graph's own flat convention), a regional backward regenerated to take its inputs boxed, so that
each saved value is freed once the last compiled call using it returns; on CUDA, with
``cudagraph=True``, the step captured in a CUDA graph and replayed, parameters and buffers being
static inputs; its inputs checked, and the whole called with the graph's own calling convention.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from fp8conf import errors
from fp8conf.compile.partition import PartitionedJoint
from fp8conf.compile.region_compile import pack_inputs
from fp8conf.compile.units import CompiledUnits, unboxed_fallback
from fp8conf.graph.call_inputs import input_check
from fp8conf.graph.regions import Region
from fp8conf.graph.trace import joint_signature, trace_info

__all__ = ["CompiledJoint", "assemble", "run_partitioned"]


@dataclasses.dataclass(frozen=True)
class CompiledJoint:
    """A compiled graph: call it like the graph it was compiled from.

    Attributes:
        fn: the compiled callable, with the graph's calling convention.
        mode: ``"full"`` or ``"regional"``.
        regions: the regions identified and tagged (``regional``).
        compiled_nodes / eager_nodes: names of the graph's nodes Inductor runs, and those left eager.
        artifact: what a precompiled artifact (:mod:`fp8conf.artifacts`) saves: torch's
            ``CompiledArtifact`` of a ``full`` compile, or for ``regional`` the flat graph that calls
            its regions' compiled code; a ``(forward, backward)`` pair when the joint graph was
            partitioned first (for ``full``, the two compiled halves, each called with the
            half's inputs as arguments); ``None`` when nothing was compiled.
        inductor_compiles: how many graphs Inductor compiled: 1 or 2 (forward, backward) for
            ``full``; for ``regional``, one per structurally distinct unit, region or remainder
            piece, however often it recurs.
        fallbacks: the fast paths this compile should have taken and did not, each as
            ``"path: reason"`` (a unit called through torch's wrappers, a backward that cannot
            free saved values as it goes, a unit whose C++ code was compiled again under other
            Inductor settings or that runs eagerly, :mod:`fp8conf.compile.unit_failures`; and
            tracing's, :class:`~fp8conf.graph.trace.TraceInfo` ``.fallbacks``: a container of
            equal blocks traced whole); each is also logged once through the ``fp8conf``
            logger. Empty on a torch whose internals fp8conf knows, for a graph Inductor compiles.
    """

    fn: Callable
    mode: str
    regions: tuple[Region, ...]
    compiled_nodes: frozenset[str]
    eager_nodes: frozenset[str]
    artifact: Any = None
    inductor_compiles: int = 1
    fallbacks: tuple[str, ...] = ()

    def __call__(self, *args):
        return self.fn(*args)


def assemble(units: CompiledUnits) -> CompiledJoint:
    """The last stage: the compiled graphs made one step, called like ``gm``: the halves run one
    after the other (a regional backward regenerated to take its inputs boxed), captured in a
    CUDA graph with ``cudagraph``, its inputs checked; tracing's fallbacks counted in."""
    partition, plan = units.partition, units.partition.plan
    parts, config, gm = partition.parts, plan.config, plan.gm
    compiled, fallbacks = units.compiled_names & plan.names, units.fallbacks
    if parts is None:
        (fn,) = units.fns
    elif config.mode == "full":
        fn = run_partitioned(parts, *units.fns, boxed_backward=units.boxed_backward)
    else:
        forward_fn, backward_fn = units.fns
        boxed = _boxed_graph(parts.backward)
        if boxed is None:
            fallbacks = (*fallbacks, unboxed_fallback("torch.fx's boxed code generator is missing"))
        fn = run_partitioned(parts, forward_fn, boxed or backward_fn, boxed_backward=boxed is not None)
        # A node merged into another runs where that one does.
        compiled |= {name for name, twin in parts.merged.items() if twin in compiled}
    if config.cudagraph:
        fn = _cuda_graphed(fn, _static_inputs(gm, plan.signature))
    check = input_check(gm, "compile_joint's callable", plan.example_inputs if config.mode == "full" else None, plan.signature)
    # The step's fast paths not taken include tracing's (an equal-blocks trace refused).
    info = trace_info(gm)
    traced = info.fallbacks if info is not None else ()
    return CompiledJoint(_with_convention(gm, fn, check), config.mode, units.regions, compiled, plan.names - compiled,
                         units.artifact, units.inductor_compiles, (*traced, *fallbacks))


def run_partitioned(partitioned: PartitionedJoint, forward_fn: Callable, backward_fn: Callable, *, boxed_backward: bool = False) -> Callable:
    """A flat callable (primals then tangents in, the joint graph's flat outputs out) that runs
    ``forward_fn`` and ``backward_fn``, the two graphs of ``partitioned`` compiled or not.

    With ``boxed_backward``, ``backward_fn`` takes its inputs as one list and empties it, as
    Inductor's compiled graphs do (the boxed calling convention ``torch.compile``'s backward
    uses): each saved value is then freed as soon as the backward has used it for the last
    time, instead of living until the whole backward returns."""
    num_primals, num_out, sources = partitioned.num_primals, partitioned.num_forward_outputs, partitioned.backward_sources

    def run(*flat):
        primals, tangents = flat[:num_primals], flat[num_primals:]
        forward_out = list(forward_fn(*primals))
        backward_in = [forward_out[i] if kind == "saved" else tangents[i] for kind, i in sources]
        outputs = forward_out[:num_out]
        del forward_out  # the saved values live on in backward_in only
        if boxed_backward:
            return outputs + list(backward_fn(backward_in))
        return outputs + list(backward_fn(*backward_in))

    return run


def _boxed_graph(gm: torch.fx.GraphModule) -> Callable | None:
    """``gm`` (a regionally compiled backward) regenerated to take its inputs as one list and
    empty it, as ``torch.compile``'s backward does, and to hand each compiled call its inputs
    as one list too (:func:`~fp8conf.compile.region_compile.pack_inputs`, the graph dropping its
    own references to the values it no longer needs before the call), so that Inductor's code
    frees each saved value after its last use inside the call; ``None`` (and ``gm`` unchanged)
    on a torch without FX's boxed code generator."""
    boxed_codegen = getattr(torch.fx.graph, "_BoxedCodeGen", None)
    if boxed_codegen is None or type(gm.graph._codegen) is not torch.fx.graph.CodeGen:
        return None
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and getattr(node.target, "boxed", None) is not None and not node.kwargs:
            with gm.graph.inserting_before(node):
                packed = gm.graph.call_function(pack_inputs, tuple(node.args))
            node.args, node.target = (packed,), node.target.boxed
    gm.graph.set_codegen(boxed_codegen())
    gm.recompile()
    return torch._dynamo.disable(gm.forward)


def _static_inputs(gm, signature) -> tuple[bool, ...]:
    """Which flat inputs keep their storage between steps: a joint graph's parameters and buffers
    (``signature``, ``gm``'s joint signature)."""
    count = len(gm.graph.find_nodes(op="placeholder"))
    if signature is None:
        return (False,) * count
    return tuple(spec.kind in ("param", "buffer") for spec in signature.inputs)


def _cuda_graphed(fn, static_inputs):
    """Capture ``fn`` (flat inputs) in a CUDA graph on first call; later calls copy fresh inputs
    and replay. Static inputs are captured as they are; the others are copied into the graph's
    own buffers before each replay."""
    state: dict = {}

    def run(*flat):
        if not all(isinstance(t, torch.Tensor) and t.is_cuda for t in flat):
            raise errors.FP8ConfigError("cudagraph=True needs every input of the compiled graph on a CUDA device")
        if "graph" not in state:
            static = [t if keep else t.clone() for t, keep in zip(flat, static_inputs)]
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up: compile, autotune and allocate outside the capture
                    fn(*static)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                state["out"] = fn(*static)
            state.update(graph=graph, static=static)
        for mine, given in zip(state["static"], flat):
            if mine is not given:
                mine.copy_(given)
        state["graph"].replay()
        return state["out"]

    return run


def _with_convention(gm, flat_fn, check=None) -> Callable:
    """``flat_fn`` (flat inputs, flat outputs) called like ``gm``, under ``no_grad``, its inputs
    first checked by ``check`` (:func:`~fp8conf.graph.call_inputs.input_check`): compiled code
    checks them only where it first reads them, in its own terms.

    The joint graph already computes the gradients: tracing autograd through it again (the
    parameters require grad) would ask for derivatives of _scaled_mm, which has none."""
    out_spec = getattr(getattr(gm.graph._codegen, "pytree_info", None), "out_spec", None)
    check = check or input_check(gm, "compiled joint graph", signature=joint_signature(gm))

    def run(*args):
        inputs = pytree.arg_tree_leaves(*args)
        check(inputs)
        with torch.no_grad():
            flat = flat_fn(*inputs)
        return pytree.tree_unflatten(list(flat), out_spec) if out_spec is not None else flat

    return run
