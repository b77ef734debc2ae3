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

A compile runs as stages, each in a module of its own, taking the one before's result and
returning the next, so that what the graph is, is read once and handed on:
:func:`~fp8conf.compile.plan.plan_compile` (validation, the joint signature, the flat copy, the FP8
regions: a :class:`~fp8conf.compile.plan.JointPlan`),
:func:`~fp8conf.compile.partition.partition_plan` (the cut: a
:class:`~fp8conf.compile.partition.JointPartition`), :func:`~fp8conf.compile.units.compile_units`
or, for ``full``, :func:`~fp8conf.compile.units.compile_full` (each graph compiled:
:class:`~fp8conf.compile.units.CompiledUnits`) and :func:`~fp8conf.compile.assemble.assemble`
(the compiled step).

The result is a :class:`CompiledJoint` called like the graph it was made from (a joint graph:
``fn(primals, tangents)``, so :func:`fp8conf.run_joint` runs it too; a GraphPP callable:
``fn(*args)``), with the names of the nodes Inductor now runs versus those left eager, so that
nothing is compiled or left eager silently.
"""

from __future__ import annotations

import torch
import torch.fx

from fp8conf import errors
from fp8conf.arguments import require
from fp8conf.compile.assemble import CompiledJoint, assemble
from fp8conf.compile.config import MODES, REMAINDERS, CompileConfig
from fp8conf.compile.partition import partition_plan
from fp8conf.compile.plan import plan_compile
from fp8conf.compile.units import compile_full, compile_units
from fp8conf.compile.workers import unit_compiler
from fp8conf.graph.trace import with_collector_paused

__all__ = ["MODES", "REMAINDERS", "CompileConfig", "CompiledJoint", "compile_joint"]


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
    # A regional compile's workers start before the cut, so that their start overlaps it.
    compiler = None if mode == "full" else unit_compiler(config.workers, saveable=config.saveable_units)
    try:
        cut = partition_plan(plan)
        units = compile_full(cut) if compiler is None else compile_units(cut, compiler)
    finally:
        if compiler is not None:
            compiler.close()
    return assemble(units)
