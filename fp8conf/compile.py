"""Compiling a joint graph with Inductor: whole (``full``) or only its FP8 regions (``regional``).

Both modes use torch's own machinery: ``full`` hands the joint graph to ``torch.compile`` with
the Inductor backend; ``regional`` tags the complete FP8 regions (:mod:`fp8conf.regions`) and
runs ``torch.fx.passes.regional_inductor``, which cuts each tagged region out, compiles it with
``standalone_compile`` and leaves everything else eager. On CUDA, ``cudagraph=True`` captures
the compiled callable in a CUDA graph and replays it, parameters being static inputs.

The result is a :class:`CompiledJoint` with the joint graph's calling convention
(``fn(primals, tangents)``), so :func:`fp8conf.run_joint` runs it too, and the names of the
joint-graph nodes Inductor now runs versus those left eager, so that nothing is compiled or left
eager silently.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.fx

from fp8conf import errors
from fp8conf.regions import Region, tag_fp8_regions
from fp8conf.trace import copy_graph_module

__all__ = ["CompiledJoint", "compile_joint"]


@dataclasses.dataclass(frozen=True)
class CompiledJoint:
    """A compiled joint graph: call it like the joint graph, ``fn(primals, tangents)``."""

    fn: Callable
    mode: str
    regions: tuple[Region, ...]
    compiled_nodes: frozenset[str]
    eager_nodes: frozenset[str]

    def __call__(self, primals, tangents):
        return self.fn(primals, tangents)


def compile_joint(gm: torch.fx.GraphModule, *, mode: str = "regional", strict: bool = True, cudagraph: bool = False) -> CompiledJoint:
    """Compile a joint graph made by :func:`fp8conf.trace_joint`; ``gm`` itself is not changed."""
    if mode not in ("full", "regional"):
        raise errors.FP8ConfigError(f"compile_joint(mode={mode!r}): choose 'full' or 'regional'")
    names = frozenset(n.name for n in gm.graph.nodes if n.op == "call_function")
    if mode == "full":
        compiled = CompiledJoint(_no_grad(torch.compile(copy_graph_module(gm), backend="inductor", fullgraph=True)), "full", (), names, frozenset())
    else:
        compiled = _compile_regions(gm, names, strict)
    if cudagraph:
        compiled = dataclasses.replace(compiled, fn=_cuda_graphed(compiled.fn, gm))
    return compiled


def _compile_regions(gm, names, strict) -> CompiledJoint:
    compiled, regions, eager, boxed = _regional(gm, names, strict)
    return CompiledJoint(_unboxed(compiled) if boxed else compiled, "regional", regions, names - eager, eager)


def _regional(gm, names, strict):
    """Tag ``gm``'s complete FP8 regions on a copy and run ``regional_inductor`` on it; returns
    ``(compiled, regions, eager_names, boxed)``."""
    from torch.fx.passes.regional_inductor import regional_inductor

    work = copy_graph_module(gm)
    regions = tuple(tag_fp8_regions(work, strict=strict))
    fake_mode = next(n.meta["val"].fake_mode for n in work.graph.nodes if n.op == "placeholder")
    try:
        # regional_inductor compiles under the tracing context the compile-joint APIs set up.
        with torch._guards.tracing(torch._guards.TracingContext(fake_mode)):
            compiled = regional_inductor(work)
    except Exception as exc:
        raise _region_error(gm, regions, exc) from exc
    eager = frozenset(n.name for n in compiled.graph.nodes if n.op == "call_function" and n.name in names)
    tagged = {n.name for r in regions if r.complete for n in r.nodes}
    left_eager = tagged & eager
    if left_eager and strict:
        region = next(r for r in regions if any(n.name in left_eager for n in r.nodes))
        raise errors.RegionCompileError(
            f"FP8 region {region.id} of module '{region.module_fqn}' was tagged but runs eagerly "
            f"(nodes {sorted(left_eager)[:5]}); regional_inductor did not cut it out",
            module_fqn=region.module_fqn,
            pass_name=region.pass_name,
        )
    # Newer torch returns a boxed graph module (one flat list in); older keeps the graph's convention.
    boxed = isinstance(compiled.graph._codegen, getattr(torch.fx.graph, "_BoxedCodeGen", ()))
    return compiled, regions, eager, boxed


def compile_callable(gm: torch.fx.GraphModule, *, mode: str = "regional", strict: bool = True) -> Callable:
    """Compile a graph called with flat positional tensors, ``gm(*args)`` (a GraphPP callable):
    all of it (``"full"``) or its complete FP8 regions (``"regional"``). Returns a callable with
    the same convention; ``gm`` is not changed."""
    if mode == "full":
        compiled = torch.compile(copy_graph_module(gm), backend="inductor", fullgraph=True)

        def run_full(*args):
            with torch.no_grad():
                return compiled(*args)

        return run_full
    if mode != "regional":
        raise errors.FP8ConfigError(f"compile_callable(mode={mode!r}): choose 'full' or 'regional'")
    if not any(n.op == "placeholder" for n in gm.graph.nodes):
        return gm
    names = frozenset(n.name for n in gm.graph.nodes if n.op == "call_function")
    compiled, _, _, boxed = _regional(gm, names, strict)
    return (lambda *args: compiled(list(args))) if boxed else compiled


def _no_grad(fn):
    # The joint graph already computes the gradients: tracing autograd through it again (the
    # parameters require grad) would ask for derivatives of _scaled_mm, which has none.
    def run(primals, tangents):
        with torch.no_grad():
            return fn(primals, tangents)

    return run


def _unboxed(boxed):
    def run(primals, tangents):
        return boxed([*primals, *tangents])

    return run


def _region_error(gm, regions, exc) -> errors.RegionCompileError:
    # Inductor's error names a submodule, not a module: find the region it fails on alone.
    from torch.fx.passes.regional_inductor import regional_inductor

    fake_mode = next(n.meta["val"].fake_mode for n in gm.graph.nodes if n.op == "placeholder")
    for region in (r for r in regions if r.complete):
        alone = copy_graph_module(gm)
        tag_fp8_regions(alone, [_same_region(alone, region)], strict=False)
        try:
            with torch._guards.tracing(torch._guards.TracingContext(fake_mode)):
                regional_inductor(alone)
        except Exception as culprit:
            return errors.RegionCompileError(
                f"Inductor rejected FP8 region {region.id} of module '{region.module_fqn}' "
                f"({region.pass_name} pass): {type(culprit).__name__}: {culprit}",
                module_fqn=region.module_fqn,
                pass_name=region.pass_name,
            )
    return errors.RegionCompileError(f"regional Inductor compilation failed: {type(exc).__name__}: {exc}")


def _same_region(gm, region: Region) -> Region:
    by_name = {n.name: n for n in gm.graph.nodes}
    nodes = tuple(by_name[n.name] for n in region.nodes)
    computes = tuple(by_name[n.name] for n in region.compute_nodes)
    return dataclasses.replace(region, nodes=nodes, compute_nodes=computes)


def _cuda_graphed(fn, gm):
    """Capture ``fn`` in a CUDA graph on first call; later calls copy fresh inputs and replay.

    Parameters keep their storage between steps, so they are captured as static inputs; the
    user inputs and tangents are copied into the graph's own buffers before each replay.
    """
    from torch._functorch._aot_autograd import descriptors as d

    kinds = [type(n.meta.get("desc")) for n in gm.graph.find_nodes(op="placeholder")]
    state: dict = {}

    def run(primals, tangents):
        flat = list(primals) + list(tangents)
        if not all(t.is_cuda for t in flat):
            raise errors.FP8ConfigError("cudagraph=True needs every input of the joint graph on a CUDA device")
        if "graph" not in state:
            static = [t if k in (d.ParamAOTInput, d.BufferAOTInput) else t.clone() for t, k in zip(flat, kinds)]
            split = len(primals)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up: compile, autotune and allocate outside the capture
                    fn(static[:split], static[split:])
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                state["out"] = fn(static[:split], static[split:])
            state.update(graph=graph, static=static)
        for mine, given in zip(state["static"], flat):
            if mine is not given:
                mine.copy_(given)
        state["graph"].replay()
        return state["out"]

    return run
