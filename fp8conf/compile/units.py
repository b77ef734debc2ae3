"""The third stage of a compile: each graph of the partition compiled by Inductor.

:func:`compile_full` (``full``) and :func:`compile_units` (``regional``) take the
:class:`~fp8conf.compile.partition.JointPartition` and hand on :class:`CompiledUnits`: one flat
callable per graph, with the names of the nodes Inductor now runs. ``full`` compiles each graph
whole, as ``torch.compile`` compiles the halves of its cut: Inductor's inner compiler on the graph
as cut, for the fake values it records (``torch._inductor.standalone_compile`` when
``example_inputs`` are given, or for a graph that was not cut), the backward taking its inputs
boxed. ``regional`` tags the complete FP8 regions of each graph (:mod:`fp8conf.graph.regions`)
and compiles them as ``remainder`` says, each structurally distinct unit once
(:mod:`fp8conf.compile.remainder`, :mod:`fp8conf.compile.region_compile`). What Inductor
rejects becomes an error naming the op, region or piece. The last stage,
:func:`~fp8conf.compile.assemble.assemble`, makes the compiled graphs one step.
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

from fp8conf import errors
from fp8conf.compile.partition import JointPartition
from fp8conf.compile.region_compile import cut_pieces, cut_regions, tracing_fake_mode
from fp8conf.compile.remainder import blocks_from_regions, remainder_pieces
from fp8conf.graph.provenance import BLOCK_META_KEY, get_block, get_provenance, repeated_block
from fp8conf.graph.regions import Region, tag_fp8_regions
from fp8conf.log import fell_back

__all__ = ["CompiledUnits", "compile_full", "compile_units", "unboxed_fallback"]


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
        artifact / inductor_compiles: as :class:`~fp8conf.compile.assemble.CompiledJoint` has them.
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
    fallbacks = () if boxed is not None or not stateless else (
        unboxed_fallback("no function down the compiled artifact's __wrapped__ chain takes one list"),)
    return CompiledUnits(partition, (forward, boxed or backward), (), names, (forward, backward), 2, fallbacks,
                         boxed_backward=boxed is not None)


def unboxed_fallback(reason: str) -> str:
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


def compile_units(partition: JointPartition, compiler) -> CompiledUnits:
    """The third stage of a ``regional`` compile: the complete FP8 regions of each graph of
    ``partition`` tagged (each graph's share of the plan's regions, as the partition hands it
    on) and compiled as ``remainder`` says, each structurally distinct unit once, with
    ``compiler`` (here, or in worker processes side by side: :mod:`fp8conf.compile.workers`).
    Every graph's units are cut and submitted before any is bound, so that a pool compiles the
    forward's and the backward's together."""
    plan, graphs = partition.plan, partition.graphs
    config = plan.config
    strict, remainder, fast_calls = config.strict, config.remainder, config.fast_calls
    regions, cuts, compiled_names, cache = [], [], set(), {}
    bound = []  # cuts bound on the way (remainder="pieces": the regions, before the pieces around them)
    for graph, share in zip(graphs, partition.regions, strict=True):
        # Attribution was checked on the joint graph, before the cut.
        found = tag_fp8_regions(graph, share, strict=strict)
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
