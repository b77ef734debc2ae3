"""Compiling a joint graph with Inductor: whole (``full``) or only its FP8 regions (``regional``).

:func:`compile_joint` is fp8conf's one way to compile: GraphPP (:func:`fp8conf.compile_split`)
compiles each callable with it and precompiled artifacts (:mod:`fp8conf.artifacts.store`) save
what its unpartitioned ``full`` mode made. Both modes work on a flat copy of the graph
(placeholders in, a flat list out) with torch's own machinery. A whole joint graph is first cut
into forward and backward by the min-cut partitioner, as ``torch.compile`` does
(:mod:`fp8conf.compile.partition`): for ``full`` the very cut ``torch.compile`` makes (Inductor's
decompositions and partition function), for ``regional`` one that keeps every FP8 region whole.
``full`` then compiles each half as ``torch.compile`` does, with Inductor's inner compiler
on the graph as cut (for the fake values it records; ``torch._inductor.standalone_compile``
when ``example_inputs`` are given, or for a graph that cannot be cut), and calls the compiled
backward with its inputs boxed, so that saved values are freed as the backward consumes them;
``regional`` tags the complete FP8 regions of each
(:mod:`fp8conf.graph.regions`) and compiles them, each structurally distinct unit once
(:mod:`fp8conf.compile.region_compile`): with ``remainder="inductor"`` (the default) each region
together with the rest of the graph around it, in units that stop at the ops that must stay
eager and at the edge of a repeated block (:mod:`fp8conf.compile.remainder`); with
``remainder="pieces"`` each region alone, then the pieces of the rest between them; with
``remainder="eager"`` the regions alone and everything else eagerly. The regional backward
graph too takes its inputs boxed, so that each saved value is freed once the last compiled call
using it returns. On CUDA, ``cudagraph=True``
captures the compiled callable in a CUDA graph and replays it, parameters and buffers being
static inputs.

A compile runs as stages, each taking the one before's result and returning the next, so that
what the graph is, is read once and handed on: :func:`plan_compile` (validation, the joint
signature, the flat copy, the FP8 regions: a :class:`JointPlan`), :func:`partition_plan` (the cut:
a :class:`JointPartition`), :func:`compile_units` or, for ``full``, :func:`compile_full` (each
graph compiled: :class:`CompiledUnits`) and :func:`assemble` (the compiled step).

The result is a :class:`CompiledJoint` called like the graph it was made from (a joint graph:
``fn(primals, tangents)``, so :func:`fp8conf.run_joint` runs it too; a GraphPP callable:
``fn(*args)``), with the names of the nodes Inductor now runs versus those left eager, so that
nothing is compiled or left eager silently.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from fp8conf import errors
from fp8conf.arguments import require
from fp8conf.graph.call_inputs import input_check
from fp8conf.compile.config import MODES, REMAINDERS, CompileConfig
from fp8conf.compile.partition import PartitionedJoint, partition_joint, regions_in, run_partitioned
from fp8conf.graph.provenance import BLOCK_META_KEY, get_block, get_provenance, repeated_block
from fp8conf.compile.workers import unit_compiler
from fp8conf.compile.region_compile import cut_pieces, cut_regions, pack_inputs, tracing_fake_mode
from fp8conf.graph.regions import Region, check_attributed, identify_fp8_regions, tag_fp8_regions
from fp8conf.compile.remainder import blocks_from_regions, remainder_pieces
from fp8conf.graph.trace import flat_graph_module, joint_signature, trace_info, with_collector_paused
from fp8conf.graph.validate import validate_fp8_graph
from fp8conf.log import fell_back, library_notices_quieted

__all__ = ["MODES", "REMAINDERS", "CompileConfig", "CompiledJoint", "compile_joint"]



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


@with_collector_paused  # see fp8conf.graph.trace.collector_paused
def compile_joint(gm: torch.fx.GraphModule, config: CompileConfig | None = None, *, mode: str | None = None, strict: bool | None = None,
                  cudagraph: bool | None = None, example_inputs=None, partition: bool | None = None, remainder: str | None = None,
                  workers: int | None = None) -> CompiledJoint:
    """Compile ``gm``, a joint graph made by :func:`fp8conf.trace_joint` or a graph cut from one
    (a GraphPP callable); ``gm`` itself is not changed.

    The settings are ``config`` (a :class:`~fp8conf.CompileConfig`, whose fields document
    them), or the keywords of the same names, which make one (defaults: ``mode="regional"``,
    ``strict=True``, ``cudagraph=False``, ``partition=True``, ``remainder="inductor"``,
    ``workers=0``); not both.

    ``mode="full"`` compiles every node, ``"regional"`` only the complete FP8 regions. Strict
    compilation of either mode first validates a graph fp8conf traced (:func:`~fp8conf.validate_fp8_graph`,
    raising its errors: a graph strict validation refuses is never compiled); regionally, an
    incomplete region is an :class:`~fp8conf.errors.IncompleteRegionError` and a tagged region
    left eager a :class:`~fp8conf.errors.RegionCompileError`. ``example_inputs`` (flat, in
    placeholder order) are what ``full`` specializes to; by default, tensors like the traced ones.
    With ``partition`` (the default), a joint graph is first cut into forward and backward by the
    min-cut partitioner, as ``torch.compile`` does (:mod:`fp8conf.compile.partition`); graphs
    without tangents are compiled whole either way.

    ``remainder`` (``regional`` only) is what becomes of the nodes outside the FP8 regions:
    ``"inductor"`` (the default, the fast one) compiles each region together with the nodes
    around it, in units that never split a region, stop at the ops that must stay eager and never
    span two repeated blocks (the outermost modules at an index of a container, ``layers.3``, as
    :func:`fp8conf.trace_joint` records them per node), so
    that identical blocks compile once and Inductor fuses each FP8 cast with the norm or
    activation making its input, as ``torch.compile`` does; ``"pieces"`` compiles each region as
    an Inductor graph of its own and the rest in pieces between them; ``"eager"`` runs the rest
    eagerly, so that exactly the tagged regions are compiled. Ops Inductor would change or
    cannot take alone (random, in-place, non-tensor values, FP8 values outside a region) stay
    eager either way and are named in ``eager_nodes``.

    ``workers`` (``regional`` only) is how many helper processes compile distinct units beside
    this one (:mod:`fp8conf.compile.workers`): the units are shared out, largest first,
    between the helpers and this process, which compiles its share while the helpers compile
    theirs; ``0`` (the default) compiles them one after the other here. Either way the same units
    are compiled the same way.

    With ``cudagraph=True`` every call replays one captured graph and returns the same output
    tensors, which the next call overwrites: clone what a step must keep (its gradients, say)
    before calling again.
    """
    require(gm, "graph module", "compile_joint", "gm")
    config = CompileConfig.of(config, "compile_joint", mode=mode, strict=strict, cudagraph=cudagraph, partition=partition,
                              remainder=remainder, workers=workers)
    mode = config.mode
    if config.cudagraph and not torch.cuda.is_available():
        raise errors.FP8ConfigError("compile_joint(cudagraph=True) needs a CUDA device; this torch sees none")
    ignored = config.ignored_by_mode()
    if ignored:
        from fp8conf.log import logger

        logger.warning("fp8conf: compile_joint(mode=%r) ignores %s: regional compile reads them, full compile does not",
                       mode, ", ".join(ignored))
    # The engine's stages, each taking the one before's result: the plan (what the graph is),
    # the cut, the compiled units, the assembled step.
    plan = plan_compile(gm, config, example_inputs)
    if not plan.takes_inputs:
        # Nothing flows in (an empty part of a split): there is nothing for Inductor to specialize on.
        return CompiledJoint(gm, mode, (), frozenset(), plan.names, inductor_compiles=0)
    if mode == "full":
        return assemble(compile_full(partition_plan(plan)))
    # Workers start before the cut, so that their start overlaps it.
    compiler = unit_compiler(config.workers, saveable=config.saveable_units)
    try:
        units = compile_units(partition_plan(plan), compiler)
    finally:
        compiler.close()
    return assemble(units)


@dataclasses.dataclass(frozen=True)
class JointPlan:
    """The first stage of a compile (:func:`plan_compile`): what compiling ``gm`` takes, read from
    it once and handed on.

    Attributes:
        gm: the graph compiled (never changed).
        config: the compile's settings.
        example_inputs: what ``full`` specializes to (``None``: the traced values).
        signature: ``gm``'s :class:`~fp8conf.JointSignature` (``None`` for a graph fp8conf did not
            trace): the cut, the compiled halves and the input check all read it.
        names: the names of ``gm``'s op nodes, each compiled or left eager.
        flat: a flat copy of ``gm`` (:func:`~fp8conf.graph.trace.flat_graph_module`), what the
            later stages cut and compile.
        regions: the FP8 regions of ``flat`` (``regional``), identified once: the cut keeps them
            whole, and each half is tagged with its share of them.
    """

    gm: torch.fx.GraphModule
    config: CompileConfig
    example_inputs: Any
    signature: Any
    names: frozenset[str]
    flat: torch.fx.GraphModule
    regions: list[Region] = dataclasses.field(default_factory=list)

    @property
    def takes_inputs(self) -> bool:
        return bool(self.flat.graph.find_nodes(op="placeholder"))


@dataclasses.dataclass(frozen=True)
class JointPartition:
    """The second stage (:func:`partition_plan`): the plan's flat graph whole (``parts`` is ``None``),
    or cut into forward and backward by the min-cut partitioner."""

    plan: JointPlan
    parts: PartitionedJoint | None

    @property
    def graphs(self) -> list[torch.fx.GraphModule]:
        """The graphs compiled, in the order the compiled step runs them."""
        return [self.plan.flat] if self.parts is None else [self.parts.forward, self.parts.backward]


@dataclasses.dataclass(frozen=True)
class CompiledUnits:
    """The third stage (:func:`compile_units`, :func:`compile_full`): each graph of the partition
    compiled.

    Attributes:
        partition: the stage before.
        fns: one flat callable per graph of ``partition.graphs``; a partitioned backward's takes
            its inputs as one list where ``boxed_backward`` says so.
        regions: the regions tagged (``regional``).
        compiled_names: names of the nodes Inductor runs.
        artifact / inductor_compiles: as :class:`CompiledJoint` has them.
        fallbacks: the compile's fast paths not taken (tracing's are added when assembled).
        boxed_backward: whether ``fns[1]`` takes its inputs as one list.
    """

    partition: JointPartition
    fns: tuple[Callable, ...]
    regions: tuple[Region, ...]
    compiled_names: frozenset[str]
    artifact: Any
    inductor_compiles: int
    fallbacks: tuple[str, ...] = ()
    boxed_backward: bool = False


def plan_compile(gm: torch.fx.GraphModule, config: CompileConfig, example_inputs=None) -> JointPlan:
    """The first stage: ``gm`` validated (strict compilation compiles only what strict validation
    accepts), its signature read, its flat copy made and, for ``regional``, its FP8 compute
    checked for attribution and its regions identified; for ``full``, a sharded step refused."""
    if config.strict:
        _validate_first(gm)
    _warm_compile_pool()
    signature = joint_signature(gm)
    names = frozenset(n.name for n in gm.graph.nodes if n.op == "call_function")
    plan = JointPlan(gm, config, example_inputs, signature, names, flat_graph_module(gm))
    if not plan.takes_inputs:
        return plan
    if config.mode == "full":
        _refuse_collectives(plan.flat)
        return plan
    # Before the cut: FP8 compute no region can hold would otherwise be compiled as no region
    # at all, and the partitioner cannot read nodes without meta["val"].
    check_attributed(plan.flat, strict=config.strict)
    return dataclasses.replace(plan, regions=identify_fp8_regions(plan.flat))


def partition_plan(plan: JointPlan) -> JointPartition:
    """The second stage: with ``config.partition``, a joint graph cut into forward and backward
    (:func:`~fp8conf.compile.partition.partition_joint`): the very cut ``torch.compile`` makes for
    ``full``, one that keeps every FP8 region whole for ``regional``; a graph the partitioner
    cannot cut stays whole."""
    if not plan.config.partition:
        return JointPartition(plan, None)
    if plan.config.mode == "full":
        return JointPartition(plan, partition_joint(plan.flat, keep_fp8_regions=False, signature=plan.signature))
    return JointPartition(plan, partition_joint(plan.flat, keep_fp8_regions=True, signature=plan.signature, regions=plan.regions))


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
            fallbacks = (*fallbacks, _unboxed("torch.fx's boxed code generator is missing"))
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


def _validate_first(gm: torch.fx.GraphModule) -> None:
    """Strict compilation compiles only what strict validation accepts. A graph without fp8conf's
    trace information (built or cut by someone else) cannot be validated; its FP8 compute is still
    checked for attribution (regions) and the skipped validation is said."""
    if trace_info(gm) is not None:
        validate_fp8_graph(gm, strict=True)
    else:
        from fp8conf.log import logger

        logger.info("fp8conf: compile_joint(strict=True) of a graph without fp8conf trace information (gm.meta['fp8conf_trace']): "
                    "validation skipped; only the attribution of its FP8 compute is checked")


def _warm_compile_pool() -> None:
    """Start Inductor's pool of kernel-compiling processes now, as ``torch.compile`` does when it
    first hands a graph to Inductor. Left alone, the pool starts at the first Triton kernel, and
    until its processes have imported torch, Inductor compiles the kernels one by one in this
    process (7 s of a regional first step on an H200). The processes start while the joint graph
    is cut and its regions tagged. Without Triton (on CPU) there is no pool and this does nothing."""
    from torch._inductor.async_compile import maybe_warm_pool

    maybe_warm_pool()
    with library_notices_quieted():  # Inductor's first import meets torch.jit's deprecation
        import torch._inductor.compile_fx  # noqa: F401


def compile_full(partition: JointPartition) -> CompiledUnits:
    """The third stage of a ``full`` compile: each graph of ``partition`` compiled whole
    (:func:`_full`), with what Inductor raises turned into a :class:`GraphCompileError` naming
    the op it could not lower (fp8conf's own errors pass as they are)."""
    flat = partition.plan.flat
    try:
        return _full(partition)
    except errors.FP8Error:
        raise
    except Exception as exc:
        target = _failed_target(exc)
        nodes = [n.name for n in flat.graph.nodes if n.op == "call_function" and str(n.target) == target] if target else []
        where = f" at {target} (node{'s' if len(nodes) > 1 else ''} {', '.join(nodes[:3])})" if nodes else ""
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise errors.GraphCompileError(
            f"compile_joint(mode='full'): Inductor could not compile the joint graph{where}: {type(exc).__name__}: {first}. "
            "Compile it regionally (mode='regional', which names the region that fails) or run it eagerly",
            node_name=nodes[0] if nodes else None,
            target=target,
        ) from exc


def _failed_target(exc: BaseException) -> str | None:
    """The op Inductor's lowering failed on, from its ``LoweringException`` (``target: aten.x.y``)."""
    while exc is not None:
        found = re.search(r"target: (\S+)", str(exc))
        if found:
            return found.group(1)
        exc = exc.__cause__ or exc.__context__
    return None


def _full(partition: JointPartition) -> CompiledUnits:
    plan, parts = partition.plan, partition.parts
    flat, names, example_inputs, signature = plan.flat, plan.names, plan.example_inputs, plan.signature
    if parts is None:
        artifact = _standalone_compile(flat, example_inputs)
        return CompiledUnits(partition, (artifact,), (), names, artifact, 1)
    if example_inputs is None and _records_fakes(parts.forward) and _records_fakes(parts.backward):
        # As torch.compile compiles the two halves of its cut: Inductor's inner compiler on each
        # graph as it stands. standalone_compile would trace each again through AOTAutograd,
        # decomposing it a second time and running the joint-graph passes on it once more, after
        # which Inductor groups its kernels differently (on an H200, the backward then made every
        # layer's FP8 weight and activation casts up front and held them all at its peak).
        params = [i for i, spec in enumerate(signature.inputs) if spec.kind in ("param", "buffer")]
        forward_code = _inner_compile(parts.forward, static=params, backward=False)
        tangents = sum(1 for p in parts.backward.graph.find_nodes(op="placeholder") if p.name.startswith("tangents"))
        saved = len(parts.backward.graph.find_nodes(op="placeholder")) - tangents
        backward_code = _inner_compile(parts.backward, static=range(saved), backward=True)

        def forward(*primals):
            return forward_code(list(primals))

        def backward(*inputs):
            return backward_code(list(inputs))

        # Inductor's code takes its inputs as one list and empties it: each saved value is freed
        # after its last use.
        return CompiledUnits(partition, (forward, backward_code), (), names, (forward, backward), 2, boxed_backward=True)
    forward = _standalone_compile(parts.forward, None if example_inputs is None else _examples(flat, example_inputs)[: parts.num_primals])
    backward = _standalone_compile(parts.backward, None)
    # The wrappers above the boxed function put a module's parameters and buffers in front of the
    # inputs; only a graph with none (a joint graph's halves take them as inputs) can skip them.
    stateless = not any(True for _ in parts.backward.parameters()) and not any(True for _ in parts.backward.buffers())
    boxed = _boxed_entry(backward) if stateless else None
    fallbacks = () if boxed is not None or not stateless else (_unboxed("no function down the compiled artifact's __wrapped__ chain takes one list"),)
    return CompiledUnits(partition, (forward, boxed or backward), (), names, (forward, backward), 2, fallbacks,
                         boxed_backward=boxed is not None)


def _unboxed(reason: str) -> str:
    return fell_back("boxed backward", reason, "the compiled backward keeps every saved value alive until it returns (a higher peak)")


def _records_fakes(graph: torch.fx.GraphModule) -> bool:
    values = [p.meta.get("val") for p in graph.graph.find_nodes(op="placeholder")]
    return bool(values) and all(isinstance(v, torch._subclasses.FakeTensor) for v in values)


def _inner_compile(graph: torch.fx.GraphModule, *, static, backward: bool) -> Callable:
    """``graph`` compiled by Inductor's inner compiler for the fake values its placeholders
    record; the result takes its inputs as one list. ``static``: the inputs that outlive a call
    (parameters, or the saved values of a backward), as torch.compile marks them."""
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.utils import BoxedBool

    fakes = [p.meta["val"] for p in graph.graph.find_nodes(op="placeholder")]
    with tracing_fake_mode(graph):
        return compile_fx_inner(graph, fakes, static_input_idxs=list(static), cudagraphs=BoxedBool(False), is_backward=backward)


def _boxed_entry(artifact) -> Callable | None:
    """The function inside ``artifact`` (a ``CompiledArtifact``) that takes the graph's inputs as
    one list and empties it, so that Inductor's code frees each input after its last use, as
    ``torch.compile``'s backward does with the saved values; ``None`` where there is none.

    ``CompiledArtifact.__call__(*args)`` and the AOTAutograd wrappers above the boxed runtime
    wrapper take the inputs as separate arguments, whose tuple keeps every input alive for the
    whole call; they are ``functools.wraps`` wrappers, so the boxed function is the first one
    down the ``__wrapped__`` chain that takes a single positional argument."""
    fn = getattr(artifact, "_compiled_fn", None)
    while fn is not None:
        code = getattr(fn, "__code__", None)
        if code is not None and code.co_argcount == 1 and not code.co_flags & inspect.CO_VARARGS:
            return fn
        fn = getattr(fn, "__wrapped__", None)
    return None


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


def _refuse_collectives(gm: torch.fx.GraphModule) -> None:
    """A sharded step (collectives in the graph, a process group among its inputs) is not compiled
    whole: say so, and what works, before Inductor meets its process-group inputs."""
    from fp8conf.graph.collectives import is_collective

    found = [n for n in gm.graph.nodes if is_collective(n)]
    if found:
        kinds = sorted({str(n.target).split(".")[-2] if "." in str(n.target) else str(n.target) for n in found})
        raise errors.FP8ConfigError(
            f"compile_joint(mode='full'): the graph is a sharded step ({len(found)} collectives: {', '.join(kinds)}; "
            f"first {found[0].name!r}), and a fully compiled sharded step is not supported; compile it with "
            "mode='regional', where the collectives run between the compiled FP8 regions"
        )


def _standalone_compile(graph: torch.fx.GraphModule, example_inputs) -> Callable:
    """``graph`` compiled by Inductor for ``example_inputs``, or, without them, for the fake
    values its placeholders record (as ``torch.compile`` compiles: nothing is allocated for the
    inputs, whose real counterparts, as large as the parameters or the saved activations, would
    otherwise sit beside the model's own while the graph compiles)."""
    if example_inputs is None and _records_fakes(graph):
        fakes = [p.meta["val"] for p in graph.graph.find_nodes(op="placeholder")]
        with tracing_fake_mode(graph):
            return torch._inductor.standalone_compile(graph, fakes, dynamic_shapes="from_tracing_context")
    return torch._inductor.standalone_compile(graph, list(_examples(graph, example_inputs)), dynamic_shapes="from_example_inputs")


def _examples(flat, example_inputs) -> list:
    placeholders = flat.graph.find_nodes(op="placeholder")
    if example_inputs is not None:
        example_inputs = [v.detach() if isinstance(v, torch.Tensor) else v for v in example_inputs]
        if len(example_inputs) != len(placeholders):
            raise errors.FP8ConfigError(f"compile_joint: the graph takes {len(placeholders)} inputs, {len(example_inputs)} example inputs given")
        return example_inputs
    examples = []
    for node in placeholders:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            # The traced layout: Inductor specializes to the strides of its example inputs.
            examples.append(torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype, device=val.device))
        elif isinstance(val, (int, float, bool)):
            examples.append(val)
        else:
            raise errors.FP8ConfigError(
                f"compile_joint: placeholder '{node.name}' records no example value (node.meta['val']); "
                "pass example_inputs, or keep node.meta in rewrites"
            )
    return examples


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


def compile_units(partition: JointPartition, compiler) -> CompiledUnits:
    """The third stage of a ``regional`` compile: the complete FP8 regions of each graph of
    ``partition`` tagged (the plan's regions, each graph's share found by name) and compiled as
    ``remainder`` says, each structurally distinct unit once, with ``compiler`` (here, or in
    worker processes side by side: :mod:`fp8conf.compile.workers`). Every graph's units are cut
    and submitted before any is bound, so that a pool compiles the forward's and the backward's
    together."""
    plan, graphs = partition.plan, partition.graphs
    config = plan.config
    strict, remainder, fast_calls = config.strict, config.remainder, config.fast_calls
    regions, cuts, compiled_names, cache = [], [], set(), {}
    bound = []  # cuts bound on the way (remainder="pieces": the regions, before the pieces around them)
    for graph in graphs:
        # Attribution was checked on the joint graph, before the cut.
        found = tag_fp8_regions(graph, regions_in(graph, plan.regions), strict=strict)
        regions += found
        complete = [r for r in found if r.complete]
        # Those left uncompiled (incomplete, strict=False) stay eager whole.
        uncompiled = {n.name for r in found if not r.complete for n in r.nodes}
        if remainder == "inductor":
            # Each region compiled together with the remainder around it, up to the ops that
            # must stay eager: one Inductor graph fuses a cast with the op making its input.
            units = remainder_pieces(graph, keep_eager=uncompiled, regions=[r.nodes for r in complete], blocks=_blocks(graph, complete))
            cut = cut_pieces(graph, units, cache, functools.partial(_unit_error, complete), compiler)
        elif remainder == "eager":
            cut = cut_regions(graph, complete, cache, _region_error, compiler)
        else:
            regions_cut = cut_regions(graph, complete, cache, _region_error, compiler)
            regions_cut.bind(fast_calls=fast_calls, strict=strict)
            compiled_names |= regions_cut.names
            bound.append(regions_cut)
            # Regions are single calls by now, so no piece can reach into one.
            cut = cut_pieces(graph, remainder_pieces(graph, keep_eager=uncompiled), cache, _piece_error, compiler)
        cuts.append(cut)
    # One dynamo-disable frame per graph: the regions called straight through Inductor's code
    # (fp8conf.compile.fast_call) no longer pass through the artifact's own.
    fns = tuple(torch._dynamo.disable(cut.bind(fast_calls=fast_calls, strict=strict)) for cut in cuts)
    # Once bound: a unit Inductor could not compile (strict=False) runs eagerly, its nodes too.
    compiled_names |= {name for cut in cuts for name in cut.names}
    fallbacks = tuple(dict.fromkeys(line for cut in bound + cuts for line in cut.fallbacks))
    tagged = {n.name for r in regions if r.complete for n in r.nodes}
    left_eager = tagged - compiled_names
    if left_eager and strict:
        region = next(r for r in regions if any(n.name in left_eager for n in r.nodes))
        raise errors.RegionCompileError(
            f"FP8 region {region.id} of module '{region.module_fqn}' was tagged but runs eagerly "
            f"(nodes {sorted(left_eager)[:5]}); it could not be cut out of the graph",
            module_fqn=region.module_fqn,
            pass_name=region.pass_name,
        )
    # The graphs now call their regions' compiled code: what a regional artifact saves.
    artifact = graphs[0] if len(graphs) == 1 else tuple(graphs)
    return CompiledUnits(partition, fns, tuple(regions), frozenset(compiled_names), artifact, len(cache), fallbacks)


def _region_error(region: Region, exc: Exception) -> errors.RegionCompileError:
    return errors.RegionCompileError(
        f"Inductor rejected FP8 region {region.id} of module '{region.module_fqn}' "
        f"({region.pass_name} pass): {type(exc).__name__}: {exc}",
        module_fqn=region.module_fqn,
        pass_name=region.pass_name,
    )


def _blocks(graph, regions) -> dict:
    """The repeated block of each node: recorded while tracing (:func:`fp8conf.trace_joint`), or,
    in a graph that records none, guessed from the regions' module FQNs."""
    if any(BLOCK_META_KEY in n.meta for n in graph.graph.nodes):
        return {n: get_block(n) for n in graph.graph.nodes}
    return blocks_from_regions(graph, [r.nodes for r in regions], [repeated_block(r.module_fqn) for r in regions])


def _unit_error(regions: list[Region], unit, exc: Exception) -> errors.RegionCompileError:
    inside = set(unit)
    held = [r for r in regions if r.nodes[0] in inside]
    if not held:
        return _piece_error(unit, exc)
    region = held[0]
    return errors.RegionCompileError(
        f"Inductor rejected FP8 region {region.id} of module '{region.module_fqn}' ({region.pass_name} pass), compiled "
        f"with {len(held) - 1} other region(s) and {len(unit) - sum(len(r.nodes) for r in held)} remainder node(s) around it: "
        f"{type(exc).__name__}: {exc}. compile_joint(..., remainder='pieces') compiles each region alone",
        module_fqn=region.module_fqn,
        pass_name=region.pass_name,
        node_name=unit[0].name,
    )


def _piece_error(piece, exc: Exception) -> errors.RegionCompileError:
    provenance = next((p for p in map(get_provenance, piece) if p is not None), None)
    module_fqn = getattr(provenance, "module_fqn", None)
    return errors.RegionCompileError(
        f"Inductor rejected the piece of the eager remainder of {len(piece)} nodes from '{piece[0].name}' to "
        f"'{piece[-1].name}'{f' (module {module_fqn!r})' if module_fqn else ''}: {type(exc).__name__}: {exc}. "
        "compile_joint(..., remainder='eager') leaves everything outside the FP8 regions eager",
        module_fqn=module_fqn,
        node_name=piece[0].name,
    )


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
