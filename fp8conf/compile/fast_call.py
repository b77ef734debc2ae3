"""The cheapest safe way to call a compiled region or remainder piece.

A regionally compiled graph calls each of its regions and pieces once per step, dozens of calls
for a small model, and each call of torch's ``CompiledArtifact`` passes through a stack of
Python layers: the artifact, its serializable callable, a dynamo-disable frame, AOTAutograd's
``forward`` (which prepends parameters), its runtime wrapper (grad mode, input mutations, output
aliases) and Inductor's ``CompiledFxGraph.__call__``, before Inductor's generated ``call(args)``
runs the kernels. When the graph is called with gradients off (the regional callable runs under
one ``no_grad``) and AOTAutograd recorded nothing for its wrappers to do, every layer above
``call`` only forwards the arguments, and calling ``call`` directly computes the same values
with none of that host time.

:func:`fast_entry` finds that function, or ``None`` wherever a layer might matter or is not one
it recognises (another torch version's wrappers, say): callers then keep calling the artifact,
so a torch that wraps differently is slower, never wrong. The artifact itself, what a regional
artifact saves, is not changed.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.fx

from fp8conf.compile.compiled_unit import CompiledUnit

__all__ = ["fast_entry", "fast_entry_or_reason", "graph_allows_fast_call", "wrapper_work"]

#: Names the runtime wrapper's generated code binds only when it has work of its own to do:
#: write back mutated inputs, bump their versions, regenerate aliased outputs, mark dynamic
#: dimensions, turn autocast off.
_WRAPPER_WORK = frozenset({"_apply_mutations_", "_increment_version_", "_replay_aliases_", "_mark_dynamic_", "_DisableAutocast_"})
#: Attributes a joint (training) runtime wrapper's code reads, and an inference one's does not.
_JOINT_WRAPPER = frozenset({"_is_view_replay_enabled", "enable_grad"})
#: Closure cells through which a recognised wrapper function calls the next layer down.
_NEXT_CELLS = ("fn", "compiled_fn", "_inner_compiled_fn")


def fast_entry(artifact) -> Callable | None:
    """A function called like ``artifact`` (positional tensors in, a sequence of tensors out) that
    calls Inductor's generated code directly, or ``None`` when a layer in between might do work.
    Its ``boxed`` attribute takes the inputs as one list instead and empties it, so that a caller
    holding no other reference lets Inductor's code free each input after its last use."""
    return fast_entry_or_reason(artifact)[0]


def fast_entry_or_reason(artifact) -> tuple[Callable | None, str | None]:
    """:func:`fast_entry`, and when there is none, why: the layer of torch's wrappers that
    might do work or that this walk does not know (another torch's layout, say)."""
    try:
        from torch._inductor.output_code import CompiledFxGraph
    except ImportError:
        return None, "torch._inductor.output_code.CompiledFxGraph is gone"
    layer = artifact
    try:
        for _ in range(16):
            if isinstance(layer, CompiledFxGraph):
                direct = _direct_call(layer)
                return (direct, None) if direct is not None else (None, "Inductor's compiled graph has no current_callable")
            following = _next_layer(layer)
            if following is None:
                return None, f"a wrapper layer it cannot see through or that has work to do ({_name_of(layer)})"
            layer = following
    except Exception as exc:  # noqa: BLE001 - a layout this walk does not know: the artifact call is always right
        return None, f"walking torch's wrappers failed at {_name_of(layer)}: {type(exc).__name__}: {exc}"
    return None, "more than 16 wrapper layers above Inductor's code"


def _name_of(layer) -> str:
    code = getattr(layer, "__code__", None)
    return f"function {code.co_name}" if code is not None else type(layer).__qualname__


def _direct_call(graph) -> Callable | None:
    if getattr(graph, "current_callable", None) is None:
        return None

    def region(*args):
        # Inductor's code takes its inputs as one list and empties it; the attribute is read per
        # call since torch may replace the callable after the first run (CUDA graph trees).
        return graph.current_callable(list(args))

    def boxed(args: list):
        # The caller's own list, emptied here: each input is freed after its last use inside.
        return graph.current_callable(args)

    region.boxed = boxed
    return region


def _next_layer(layer):
    """The layer ``layer`` calls, when ``layer`` is known to only forward its arguments to it."""
    if isinstance(layer, CompiledUnit):  # one of the engine's own units
        return layer.compiled_fn
    name = type(layer).__name__
    if name == "AOTCompiledArtifact":
        return getattr(layer, "inner_fn", None)
    if name in ("BundledAOTAutogradSerializableCallable", "SerializableCompiledFunction"):
        return getattr(layer, "compiled_fn", None)
    code = getattr(layer, "__code__", None)
    if code is None or layer.__closure__ is None:
        return None
    cells = {name: value for name, value in zip(code.co_freevars, map(_cell_value, layer.__closure__)) if value is not _EMPTY}
    if cells.get("params_buffers_flat"):
        return None  # AOTAutograd's forward puts a module's parameters in front of the inputs
    if "_codegen_runtime_wrapper" in cells and not _plain_runtime_wrapper(cells["_codegen_runtime_wrapper"]):
        return None
    if code.co_name == "wrapper" and type(cells.get("self")).__name__ == "FunctionalizedRngRuntimeWrapper":
        # Adds RNG seed and offset only for a graph whose random ops were functionalized.
        plain = getattr(cells.get("runtime_metadata"), "is_rng_op_functionalized", True) is False
        return cells.get("compiled_fn") if plain else None
    if code.co_name == "runtime_wrapper" and "runtime_metadata" in cells:
        return cells.get("compiled_fn") if _plain_metadata_wrapper(cells) else None
    if any(k in cells for k in ("runtime_metadata", "trace_joint", "disable_amp")):
        return None  # a runtime wrapper this module cannot read: assume it does work
    known = code.co_name in ("_fn", "forward", "runtime_wrapper")
    return next((cells[k] for k in _NEXT_CELLS if k in cells), None) if known else None


_EMPTY = object()


def _cell_value(cell):
    # A closure cell still unbound when the artifact is built (torch 2.11 leaves some so) holds
    # nothing this walk could follow.
    try:
        return cell.cell_contents
    except ValueError:
        return _EMPTY


def _plain_metadata_wrapper(cells: dict) -> bool:
    """Whether AOTAutograd's hand-written runtime wrapper (torch 2.11's, which reads its
    ``runtime_metadata`` at every call) has nothing to do: an inference graph, no input mutation
    to write back, no aliased output or intermediate base to regenerate, no dynamic dims to
    mark, no grad-mode change, autocast left alone."""
    meta = cells["runtime_metadata"]
    try:
        return (
            cells.get("trace_joint") is False
            and cells.get("disable_amp") is False
            and not meta.mutated_graph_handled_indices_seen_by_autograd
            and meta.num_mutated_inp_runtime_indices == 0
            and meta.num_outputs_aliased == 0
            and meta.num_intermediate_bases == 0
            and not meta.dynamic_outputs
            and meta.grad_enabled_mutation is None
        )
    except AttributeError:
        return False  # metadata of another layout: assume it matters


def _plain_runtime_wrapper(generated) -> bool:
    """Whether AOTAutograd's generated runtime wrapper does no work of its own: an inference
    wrapper that only calls the compiled graph (with grad mode off, as the caller has it)."""
    code = getattr(generated, "__code__", None)
    if code is None:
        return False
    return not (_WRAPPER_WORK & set(generated.__globals__)) and not (_JOINT_WRAPPER & set(code.co_names))


def graph_allows_fast_call(gm: torch.fx.GraphModule, example_inputs) -> bool:
    """Whether ``gm`` (a region or piece, before compilation) has nothing for AOTAutograd's
    wrappers to do (:func:`wrapper_work` finds none)."""
    return wrapper_work(gm, example_inputs) is None


def wrapper_work(gm: torch.fx.GraphModule, example_inputs) -> str | None:
    """What AOTAutograd's wrappers have to do for ``gm`` (a region or piece, before
    compilation), judged on the graph itself, or ``None``: an input that requires grad, an op that
    mutates, an output that is an input or shares storage with one or with another output.

    Sharing is judged twice, and either finding refuses: by the graph's structure
    (:func:`_storage_roots`: a pass-through, or a chain of ops whose schema says they return a view
    of an argument), and by the traced values' storages, which also see ops that alias without
    saying so. Two nodes holding the very same traced value are left to the structural test: in a
    graph of repeated blocks (:mod:`fp8conf.graph.repeat`) the copies of a node share its traced
    value, so a block's input (the block before's output) and the block's own output hold one
    value object and look like one storage although the block computes a new tensor; judged by
    storage alone, every such unit compiled by ``standalone_compile`` (``saveable_units``, compile
    workers) was called through torch's wrappers at every step, and only from the depth at which
    blocks are repeated."""
    if any(isinstance(v, torch.Tensor) and v.requires_grad for v in example_inputs):
        return "an input requires grad"
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable:
            return f"{node.name} ({node.target}) mutates"
    roots = _storage_roots(gm)
    placeholders = gm.graph.find_nodes(op="placeholder")
    seen = [(_storage(n), n.meta.get("val")) for n in placeholders]
    claimed = set().union(*(roots[n] for n in placeholders)) if placeholders else set()
    (output,) = gm.graph.find_nodes(op="output")
    values = output.args[0] if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    for value in values:
        storage = _storage(value) if isinstance(value, torch.fx.Node) else None
        if storage is None:
            return f"output {value} is no tensor the graph shows"
        if roots[value] & claimed:
            return f"output {value.name} is an input, or a view of an input or of another output"
        traced = value.meta.get("val")
        if any(storage == other and traced is not other_traced for other, other_traced in seen):
            return f"output {value.name} shares a storage with an input or another output through an op that does not say so"
        seen.append((storage, traced))
        claimed |= roots[value]
    return None


#: ATen ops whose result may share its argument's storage though their schema marks no alias.
_UNMARKED_ALIASES = frozenset({"aten::_unsafe_view"})


def _storage_roots(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, frozenset]:
    """Per node, the nodes whose fresh storage its value may share, as the graph computes it: a
    placeholder, an attribute or an op that allocates is its own root; a view (an ATen op whose
    schema returns an alias of an argument, or one of :data:`_UNMARKED_ALIASES`) and any call
    this cannot read (not an ATen op) share every root of their arguments, the latter its own too;
    an item of a fresh multi-output op is a root of its own, an item of anything else shares its
    container's roots (and is one itself)."""
    roots: dict[torch.fx.Node, frozenset] = {}
    for node in gm.graph.nodes:
        inherited = frozenset().union(*(roots[a] for a in node.all_input_nodes)) if node.all_input_nodes else frozenset()
        if node.op in ("placeholder", "get_attr", "output"):
            roots[node] = frozenset({node})
        elif node.op == "call_function" and node.target is operator.getitem:
            sources = node.all_input_nodes
            fresh = len(sources) == 1 and roots[sources[0]] == {sources[0]}
            roots[node] = frozenset({node}) if fresh else inherited | {node}
        elif node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            schema = node.target._schema
            aliases = schema.name in _UNMARKED_ALIASES or any(r.alias_info is not None for r in schema.returns)
            roots[node] = inherited if aliases and inherited else frozenset({node})
        else:
            roots[node] = inherited | {node}
    return roots


def _storage(node: torch.fx.Node):
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return None
    return torch.multiprocessing.reductions.StorageWeakRef(value.untyped_storage())
