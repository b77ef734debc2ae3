"""Compiling tagged FP8 regions, each structurally distinct region once.

``torch.fx.passes.regional_inductor`` compiles every tagged region on its own, so a model of 32
identical blocks pays 32 times for the same code, and cold start grows with depth. Here the
regions are cut out with torch's own fuser (``fuse_by_partitions``, as regional_inductor does)
and each submodule gets a **structural key**: its op sequence, argument structure and
constants, with every value's shape, stride, dtype and device, but no node names and no module
FQNs. Regions with equal keys compute the same function of their inputs, so the first one is
compiled and the others call the same compiled code: by Inductor's inner compiler, as
``torch.compile`` compiles what AOTAutograd hands it (:class:`InnerCompiledUnit`), where the unit
is already functional, else by ``torch._inductor.standalone_compile``, which is also the form a
regional artifact stores (``CompileConfig(saveable_units=True)``).

Only complete regions reach this module (:mod:`fp8conf.graph.regions` checks that they are
convex, so each is one piece that can be cut out alone). The pieces of the eager remainder
(:mod:`fp8conf.compile.remainder`) are cut out, keyed and compiled the same way, after the regions
and sharing their cache. A unit whose compile fails is compiled again, kept eager or refused as
:mod:`fp8conf.compile.unit_failures` says, when it is bound.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import functools
import heapq
import inspect
import operator
import re
from collections.abc import Callable

import torch
import torch.fx
import torch.utils._pytree as pytree

from fp8conf.compile.compiled_unit import CompiledUnit
from fp8conf.compile.fast_call import fast_entry, fast_entry_or_reason, wrapper_work
from fp8conf.compile.unit_failures import RETRY_PATCHES, settle, unit_name
from fp8conf.log import fell_back, logger
from fp8conf.graph.lazy_code import graph_module
from fp8conf.graph.regions import Region

# What the engine's other modules (joint, workers, compiled_unit) and artifacts use.
__all__ = ["InProcessCompiler", "structural_key", "compile_regions", "cut_regions", "cut_pieces", "compile_unit",
           "standalone_unit", "InnerCompiledUnit", "bundles_units", "region_call", "unit_call", "pack_inputs",
           "tracing_fake_mode"]

#: Prefix of the submodules regions are cut into (one per region, before compilation).
REGION_SUBMODULE_PREFIX = "fp8conf_region_"
#: Prefix of the submodules pieces of the eager remainder are cut into.
PIECE_SUBMODULE_PREFIX = "fp8conf_piece_"


def structural_key(gm: torch.fx.GraphModule) -> tuple:
    """What a compiled graph depends on, with node names left out: per node its op, target,
    arguments (other nodes by position) and the metadata of its value."""
    position: dict[torch.fx.Node, int] = {}
    key = []
    for i, node in enumerate(gm.graph.nodes):
        position[node] = i
        key.append(_node_key(gm, node, position))
    return tuple(key)


def _node_key(gm, node, position) -> tuple:
    if node.op == "get_attr":
        # A constant the region reads: equal only when it is the very same object.
        target = ("get_attr", id(getattr(gm, node.target)))
    elif node.op == "placeholder":
        target = "placeholder"
    else:
        target = node.target
    # torch.fx's own map over arguments (pytree's costs several times as much per node): the same
    # containers, each node replaced by its position.
    arguments = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: ("node", position[n]))
    return (node.op, target, repr(arguments), _describe(node.meta.get("val")))


def _describe(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), tuple(value.stride()), value.storage_offset(), value.dtype, value.device.type)
    if isinstance(value, (list, tuple)):
        return tuple(_describe(v) for v in value)
    return repr(value)


def compile_regions(gm: torch.fx.GraphModule, regions: list[Region], cache: dict,
                    error: Callable[[Region, Exception], Exception], compiler=None, *, fast_calls: bool = True,
                    strict: bool = True) -> tuple[Callable, set[str]]:
    """Cut ``regions`` (complete, tagged, nodes of ``gm``) out of ``gm`` in place and compile
    them; ``cache`` maps structural keys to compiled regions and may be shared between graphs
    (a joint graph's forward and backward). Returns a flat callable of ``gm`` and the names of
    the nodes that now run compiled. ``error(region, exc)`` builds the exception raised when
    Inductor rejects a region. ``compiler`` (:mod:`fp8conf.compile.workers`; by default
    this process) compiles each distinct region; ``fast_calls`` and ``strict`` are :meth:`CutUnits.bind`'s."""
    cut = cut_regions(gm, regions, cache, error, compiler)
    return cut.bind(fast_calls=fast_calls, strict=strict), cut.names


def cut_regions(gm, regions: list[Region], cache: dict, error, compiler=None) -> CutUnits:
    """The first half of :func:`compile_regions`: the regions cut out and each distinct one
    submitted to ``compiler``; :meth:`CutUnits.bind` waits for them and makes ``gm`` call them.
    Several graphs cut before any is bound have their units compiled side by side."""
    return _cut(gm, [r.nodes for r in regions], REGION_SUBMODULE_PREFIX, cache, lambda i, exc: error(regions[i], exc), compiler)


def cut_pieces(gm, pieces: list[list[torch.fx.Node]], cache: dict, error, compiler=None) -> CutUnits:
    """:func:`cut_regions` for pieces of the eager remainder or units around the regions
    (:func:`fp8conf.compile.remainder.remainder_pieces`); ``error(piece, exc)`` builds the exception
    raised when Inductor rejects a piece."""
    return _cut(gm, pieces, PIECE_SUBMODULE_PREFIX, cache, lambda i, exc: error(pieces[i], exc), compiler)


@dataclasses.dataclass
class _Submitted:
    """A unit handed to a compiler and not yet bound: what the compiler returned, and the error
    to raise should it fail; ``failure``: what the compiler raised when it was handed the unit
    (settled when the unit is bound, as a failure found then is)."""

    pending: object
    error: Callable[[Exception], Exception]
    failure: Exception | None = None


@dataclasses.dataclass(frozen=True)
class _Settled:
    """A unit whose first compile failed (:mod:`fp8conf.compile.unit_failures`), as every call
    site of it binds it: its code compiled again (``compiled``) or ``None`` (it runs eagerly),
    and the line saying which."""

    compiled: Callable | None
    fallback: str


class CutUnits:
    """Groups of a graph cut out into submodules and submitted for compilation (see
    :func:`cut_regions`)."""

    def __init__(self, gm, calls: list, cache: dict, compiler, names: set[str]):
        self._gm, self._calls, self._cache, self._compiler, self.names = gm, calls, cache, compiler, names
        #: Fast paths not taken where they should have been, each a line (see fp8conf.log.fell_back).
        self.fallbacks: list[str] = []

    def bind(self, *, fast_calls: bool = True, strict: bool = True) -> Callable:
        """Wait for the units' compiled code and replace each submodule call by a call of it;
        returns a flat callable of the graph. With ``fast_calls``
        (:attr:`~fp8conf.CompileConfig.fast_calls`) a unit is called through
        :func:`fp8conf.compile.fast_call.fast_entry` where that is safe: always for the engine's
        own units (:class:`~fp8conf.compile.compiled_unit.CompiledUnit`, which have no AOTAutograd
        wrappers whose work could be skipped: the fast entry calls what the unit itself calls), else
        where :func:`~fp8conf.compile.fast_call.wrapper_work` finds nothing for those
        wrappers to do (what it finds instead is logged at debug level). The graph is not asked
        about the engine's own units since it cannot answer for them: in a graph of repeated
        blocks (:mod:`fp8conf.graph.repeat`) the copies of a node share its traced value, so a
        block's input and its own output can seem to share storage, and every such unit would be
        called through the slow path at every step. A unit whose compile fails is settled by
        :func:`fp8conf.compile.unit_failures.settle`: compiled again where its C++ code did not
        compile, else refused (``strict``: its ``error``) or left a call of its submodule, which
        runs eagerly, its nodes taken out of :attr:`names`."""
        gm = self._gm
        if not self._calls:
            return _flat_callable(gm)
        for node, key, fake_inputs, group in self._calls:
            submodule = getattr(gm, node.target)
            compiled = self._cache[key]
            if isinstance(compiled, _Submitted):
                compiled = self._cache[key] = self._wait(compiled, submodule, fake_inputs, group, strict)
            if isinstance(compiled, _Settled):
                self.fallbacks.append(compiled.fallback)  # at each call site: one graph may hold none of the others'
                if compiled.compiled is None:
                    self.names -= {n.name for n in group}
                    continue
                compiled = compiled.compiled
            if isinstance(compiled, CompiledUnit) and compiled.fallback:
                self.fallbacks.append(compiled.fallback)
            fast = None
            work = None if not fast_calls or isinstance(compiled, CompiledUnit) else wrapper_work(submodule, fake_inputs)
            if work is not None:
                # Not a fallback: torch's wrappers have work to do for this unit at every call.
                logger.debug("fp8conf: unit %s is called through torch's wrappers: %s", node.target, work)
            elif fast_calls:
                fast, reason = fast_entry_or_reason(compiled)
                if fast is None:
                    # Nothing in the unit needs torch's wrappers, yet they cannot be skipped.
                    self.fallbacks.append(fell_back("fast call", reason, "compiled units are called through torch's wrappers "
                                                    "(more host time per call)"))
            with gm.graph.inserting_after(node):
                call = gm.graph.call_function(region_call(compiled, fast), args=node.args, kwargs=node.kwargs)
            call.meta = node.meta
            node.replace_all_uses_with(call)
            gm.graph.erase_node(node)
            delattr(gm, node.target)
        gm.recompile()
        return _flat_callable(gm)

    def _wait(self, submitted: _Submitted, submodule, fake_inputs, group, strict: bool):
        """The compiled unit, or, where its compile failed, a :class:`_Settled` one."""
        failure = submitted.failure
        if failure is None:
            try:
                return self._compiler.result(submitted.pending)
            except Exception as exc:
                failure = exc

        def retry():
            # Here, whichever process compiled it first: a worker's unit too. The settings ride
            # with the unit (its regional artifact is compiled under them as well).
            saveable = getattr(self._compiler, "saveable", False)
            with tracing_fake_mode(self._gm):
                compiled = compile_unit(submodule, fake_inputs, saveable=saveable, config_patches=RETRY_PATCHES)
            return InProcessCompiler.result(compiled)  # its kernels: a C++ error is raised now

        return _Settled(*settle(failure, retry, unit=unit_name(group), strict=strict, error=submitted.error))


class InProcessCompiler:
    """Compiles each unit here, when it is submitted; ``saveable`` as :func:`compile_unit` takes it."""

    def __init__(self, *, saveable: bool = False):
        self.saveable = saveable

    def submit(self, submodule: torch.fx.GraphModule, fake_inputs) -> Callable:
        return compile_unit(submodule, fake_inputs, saveable=self.saveable)

    @staticmethod
    def result(compiled) -> Callable:
        if isinstance(compiled, CompiledUnit):  # its kernels, built meanwhile
            compiled.finish()
        return compiled

    def close(self) -> None:
        pass


def _cut(gm, groups, prefix: str, cache: dict, error: Callable[[int, Exception], Exception], compiler) -> CutUnits:
    """Cut each group of nodes (convex, disjoint) out of ``gm`` into one submodule and submit each
    structurally distinct submodule to ``compiler`` once. ``error(index, exc)`` builds the
    exception raised when Inductor rejects ``groups[index]``."""
    from torch.fx.passes.utils.fuser_utils import fuse_by_partitions

    compiler = compiler or InProcessCompiler()
    names = {n.name for group in groups for n in group}
    if not groups:
        return CutUnits(gm, [], cache, compiler, names)
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    partitions = [dict.fromkeys(sorted(group, key=order.__getitem__)) for group in groups]
    with _submodules_deferred():
        fuse_by_partitions(gm, partitions, prefix=prefix, always_return_tuple=True)
    keys = _share_outputs(gm, prefix, _in_canonical_order(gm, prefix))
    calls = []
    with tracing_fake_mode(gm):
        for node in list(gm.graph.find_nodes(op="call_module")):
            if not node.target.startswith(prefix):
                continue
            submodule = getattr(gm, node.target)
            key = keys[node]
            fake_inputs = [i.meta["val"] for i in node.all_input_nodes]
            index = int(node.target[len(prefix):])
            if key not in cache:
                try:
                    cache[key] = _Submitted(compiler.submit(submodule, fake_inputs), functools.partial(error, index))
                except Exception as exc:  # settled when bound, as a failure found then is
                    cache[key] = _Submitted(None, functools.partial(error, index), exc)
            calls.append((node, key, fake_inputs, groups[index]))
    return CutUnits(gm, calls, cache, compiler, names)


@contextlib.contextmanager
def _submodules_deferred():
    """Inside, the submodules ``fuse_by_partitions`` cuts out are deferred graph modules
    (:func:`fp8conf.graph.lazy_code.graph_module`): their Python code is written when first
    called, not when cut. Most are never called: a unit equal to one cut before it is bound to
    that one's compiled code and its submodule dropped, and a compiled unit runs Inductor's code,
    not its submodule's (writing the code of every unit of a 32-block joint graph, each twice as
    its inputs are put in order, was about a tenth of its regional compile on CPU). A submodule
    that reads attributes of the graph (``get_attr``) is lifted by torch, as before; so is every
    one on a torch whose fuser lifts them otherwise."""
    from torch.fx.passes.utils import fuser_utils

    lift = getattr(fuser_utils, "lift_subgraph_as_module", None)
    if lift is None:
        yield
        return

    def lift_deferred(gm, subgraph, comp_name: str = "", class_name: str = "GraphModule"):
        if any(n.op in ("call_module", "get_attr") for n in subgraph.nodes):
            return lift(gm, subgraph, comp_name=comp_name, class_name=class_name)
        return graph_module(torch.nn.Module(), subgraph, class_name), {}

    fuser_utils.lift_subgraph_as_module = lift_deferred
    try:
        yield
    finally:
        fuser_utils.lift_subgraph_as_module = lift


def _in_canonical_order(gm, prefix: str) -> dict[torch.fx.Node, tuple]:
    """Give each submodule its inputs in the order its nodes first use them (its call's arguments
    to match) and, where submodules made of the same nodes still get different keys, put their
    nodes in an order of their own structure too, so that equal blocks cut out of one graph get
    equal keys. ``fuse_by_partitions`` orders inputs by where their producers sit in the whole
    graph (torch 2.14 puts the stage input before the parameters), and the joint graph may order
    independent nodes of one block otherwise than those of the next (torch 2.11 puts the two
    products of a SwiGLU's backward either way round): either would compile the block once more.
    Returns the :func:`structural_key` of the calls whose units it computed one for."""
    units = []
    for call in gm.graph.find_nodes(op="call_module"):
        if not call.target.startswith(prefix):
            continue
        submodule = getattr(gm, call.target)
        if len(list(submodule.graph.find_nodes(op="placeholder"))) != len(call.args) or call.kwargs:
            continue  # not the calling convention fuse_by_partitions makes; leave it as it is
        if _inputs_in_order_of_use(call, submodule):
            submodule.recompile()
        units.append((call, submodule))
    alike = collections.defaultdict(list)  # same nodes, in any order
    for call, submodule in units:
        alike[_node_bag(submodule.graph)].append((call, submodule))
    keys = {}
    for group in alike.values():
        if len(group) > 1:
            keys.update((call, structural_key(submodule)) for call, submodule in group)
        if len({keys[call][:-1] for call, _ in group if call in keys}) < 2:
            continue  # equal already (or alone): the order is left as the graph had it
        for call, submodule in group:
            if _sort_body(submodule.graph):
                _inputs_in_order_of_use(call, submodule)
                submodule.recompile()
                keys[call] = structural_key(submodule)
    return keys


def _inputs_in_order_of_use(call: torch.fx.Node, submodule: torch.fx.GraphModule) -> bool:
    """Put the submodule's inputs in front, in the order its nodes first use them, and the call's
    arguments to match; returns whether their order changed (its code is then out of date)."""
    graph = submodule.graph
    placeholders = list(graph.find_nodes(op="placeholder"))
    position = {node: i for i, node in enumerate(graph.nodes)}

    def first_use(i):
        # The first node that reads the input, then where among that node's arguments it sits.
        users = sorted(placeholders[i].users, key=position.__getitem__)
        if not users:
            return (len(position), 0, i)
        leaves = pytree.tree_leaves((users[0].args, users[0].kwargs))
        return (position[users[0]], next(j for j, leaf in enumerate(leaves) if leaf is placeholders[i]), i)

    order = sorted(range(len(placeholders)), key=first_use)
    # fuse_by_partitions adds an input where its first user sits: gather them in front (the code
    # stays as it is while their order does).
    if list(graph.nodes)[: len(placeholders)] != [placeholders[i] for i in order]:
        for i in reversed(order):
            first = next(iter(graph.nodes))
            if first is not placeholders[i]:
                first.prepend(placeholders[i])
    if order == list(range(len(placeholders))):
        return False
    call.args = tuple(call.args[i] for i in order)
    return True


def _node_bag(graph: torch.fx.Graph) -> tuple:
    """What a graph's nodes compute, each alone, sorted: equal for graphs of the same nodes in any order."""
    return tuple(sorted(_ADDRESS.sub("", repr((n.op, str(n.target) if n.op == "call_function" else n.op,
                                               _describe(n.meta.get("val"))))) for n in graph.nodes))


def _sort_body(graph: torch.fx.Graph) -> bool:
    """Reorder the nodes between the placeholders and the output topologically, choosing among
    the nodes that are ready the one first by a label of its structure, never its name or place:
    what it computes, refined round by round with the labels of its arguments and of its users
    (and where it sits among their arguments) until the labels tell no more nodes apart. Graphs
    that mutate, draw random numbers or communicate keep their order (their nodes' order is part
    of what they compute). Returns whether the order changed."""
    nodes = list(graph.nodes)
    body = [n for n in nodes if n.op not in ("placeholder", "output")]
    if any(_order_matters(n) for n in body):
        return False
    arguments, uses = {}, {n: [] for n in nodes}
    for node in nodes:
        leaves = pytree.tree_leaves((node.args, node.kwargs))
        arguments[node] = [leaf for leaf in leaves if isinstance(leaf, torch.fx.Node)]
        if node.op != "output":  # where among the outputs follows the original order: left out
            for j, leaf in enumerate(leaves):
                if isinstance(leaf, torch.fx.Node):
                    uses[leaf].append((node, j))
    # Labels are ranks among the sorted descriptions, never hash(): every process (each rank of a
    # sharded step, each compile worker) must put a unit in the same order.
    first = {}
    for node in nodes:
        constants = pytree.tree_map_only(torch.fx.Node, lambda _: None, (node.args, node.kwargs))
        target = node.op if node.op in ("placeholder", "get_attr", "output") else node.target
        first[node] = _ADDRESS.sub("", repr((node.op, str(target), repr(constants), _describe(node.meta.get("val")))))
    label = _ranks(first)
    kinds = len(set(label.values()))
    for _ in range(len(nodes)):
        label = _ranks({n: (label[n], tuple(label[a] for a in arguments[n]), tuple(sorted((label[u], j) for u, j in uses[n])))
                        for n in nodes})
        refined = len(set(label.values()))
        if refined == kinds:
            break
        kinds = refined
    position = {node: i for i, node in enumerate(nodes)}
    inside = set(body)
    waiting = {n: sum(1 for i in n.all_input_nodes if i in inside) for n in body}
    ready = [(label[n], position[n], n) for n in body if waiting[n] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        *_, node = heapq.heappop(ready)
        order.append(node)
        for user in node.users:
            if user in inside:
                waiting[user] -= 1
                if waiting[user] == 0:
                    heapq.heappush(ready, (label[user], position[user], user))
    if order == body:
        return False
    output = nodes[-1]
    for node in order:
        output.prepend(node)
    return True


#: An object's address in its repr, which differs from process to process.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _ranks(descriptions: dict) -> dict:
    """Each key's rank among the distinct sorted values."""
    order = {d: i for i, d in enumerate(sorted(set(descriptions.values())))}
    return {n: order[d] for n, d in descriptions.items()}


def _order_matters(node: torch.fx.Node) -> bool:
    """Whether the node's place among the others is part of what the graph computes: it mutates,
    draws random numbers or communicates (collectives are issued in the graph's order on every
    rank), or it is not an ATen op whose schema says."""
    if node.op in ("call_module", "call_method"):
        return True
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return (target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags
                or target.namespace in ("c10d", "_c10d_functional", "_c10d_functional_autograd"))
    return node.op == "call_function" and target is not operator.getitem


def _share_outputs(gm, prefix: str, known: dict[torch.fx.Node, tuple]) -> dict[torch.fx.Node, tuple]:
    """Give the submodules that compute the same nodes, and differ only in which of them leave,
    the same outputs: those any of them returns. The partitioner may keep other values of one
    block for the backward than of the others (the first block's residual sum recomputed, say,
    from the attention output it saved): without this such a block's unit would be compiled once
    more for a different output list. Each call's users (``getitem``) are renumbered to match;
    outputs a call site does not use are dropped as soon as the call returns. Returns each call's
    :func:`structural_key` (those in ``known`` taken from there)."""
    calls = [n for n in gm.graph.find_nodes(op="call_module") if n.target.startswith(prefix)]
    bodies: dict[tuple, list] = {}
    keys = {}
    for node in calls:
        submodule = getattr(gm, node.target)
        nodes = list(submodule.graph.nodes)
        output = nodes[-1]
        position = {n: i for i, n in enumerate(nodes)}
        returned = tuple(position[v] for v in output.args[0])
        keys[node] = known[node] if node in known else structural_key(submodule)
        bodies.setdefault(keys[node][:-1], []).append((node, submodule, nodes, returned))
    for group in bodies.values():
        union = sorted({p for *_, returned in group for p in returned})
        for node, submodule, nodes, returned in group:
            if list(returned) == union or any(u.target is not operator.getitem for u in node.users):
                continue
            position = {n: i for i, n in enumerate(nodes)}
            output = nodes[-1]
            output.args = (tuple(nodes[p] for p in union),)
            submodule.recompile()
            index = {old: union.index(p) for old, p in enumerate(returned)}
            for user in list(node.users):
                user.args = (node, index[user.args[1]])
            value = node.meta.get("val")
            if value is not None:
                node.meta["val"] = tuple(nodes[p].meta.get("val") for p in union)
            keys[node] = keys[node][:-1] + (_node_key(submodule, output, position),)  # only the output changed
    return keys


def bundles_units() -> bool:
    """Whether this torch's ``standalone_compile`` can bundle a unit into one serializable
    artifact (``aot=True``): what a regional artifact and a compile worker send on."""
    return "aot" in inspect.signature(torch._inductor.standalone_compile).parameters


def compile_unit(submodule, fake_inputs, *, saveable: bool = False, config_patches: dict | None = None) -> Callable:
    """Compile one cut-out unit for ``fake_inputs`` (in this process; see
    :mod:`fp8conf.compile.workers` for the same in a worker), under Inductor's settings changed
    by ``config_patches`` for this unit alone (``torch._inductor.config.patch`` keys; what a unit
    is compiled again with, :mod:`fp8conf.compile.unit_failures`).

    A unit that is already what AOTAutograd would make of it (:func:`_functional_unit`: tensors
    in, none requiring grad, no op that mutates) is compiled as ``torch.compile`` compiles the
    graphs AOTAutograd hands it, by Inductor's inner compiler (:class:`InnerCompiledUnit`);
    ``standalone_compile`` would trace it through AOTAutograd once more first (on an H200, 3.1 s
    of a 6-block regional first step, against 1.1 s for the decompositions and passes here).
    Other units, and every unit when ``saveable`` (:attr:`~fp8conf.CompileConfig.saveable_units`:
    compiled as a regional artifact stores it, so that what is saved is what ran), go through
    ``standalone_compile``.
    """
    if not saveable and _functional_unit(submodule, fake_inputs):
        return InnerCompiledUnit(submodule, fake_inputs, config_patches)
    return standalone_unit(submodule, fake_inputs, config_patches)


def _functional_unit(gm: torch.fx.GraphModule, fake_inputs) -> bool:
    """Whether AOTAutograd would leave ``gm`` as it is: every input a tensor that does not require
    grad, and no op that mutates (an in-place op, a copy into an input). Outputs may alias inputs
    or each other: the unit runs with gradients off, where Inductor's views of the same buffers
    are the values AOTAutograd's wrappers would regenerate."""
    if not all(isinstance(v, torch.Tensor) and not v.requires_grad for v in fake_inputs):
        return False
    return not any(
        n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
        for n in gm.graph.nodes
    )


def standalone_unit(submodule, fake_inputs, config_patches: dict | None = None) -> Callable:
    """``submodule`` compiled by ``torch._inductor.standalone_compile``: a serializable
    ``AOTCompiledArtifact`` where this torch bundles one (:func:`bundles_units`); ``config_patches``
    as :func:`compile_unit` takes them."""
    # As regional_inductor does: shapes from the tracing context (the joint graph's fake mode),
    # and no second rematerialisation pass inside an already partitioned graph.
    # aot=True bundles the region's AOTAutograd state in the artifact, as regional_inductor
    # asks for; a torch whose standalone_compile lacks it compiles the same graph without.
    bundle = {"aot": True} if bundles_units() else {}
    with _no_nested_remat():
        options = {"config_patches": {**_LAZY_TUNING["config_patches"], **(config_patches or {})}}
        return torch._inductor.standalone_compile(submodule, fake_inputs, dynamic_shapes="from_tracing_context",
                                                  options=options, **bundle)


#: Kernels are autotuned on a unit's first call, as torch.compile does, not while it compiles:
#: standalone_compile would otherwise run every multi-config kernel on random inputs as part of the
#: compile (on an H200, 2.4 s of a 6-block regional first step; benchmarks/RESULTS.md).
_LAZY_TUNING = {"config_patches": {"triton.autotune_at_compile_time": False}}


class InnerCompiledUnit:
    """A unit compiled by Inductor's inner compiler (``compile_fx_inner``), as ``torch.compile``
    compiles a graph after AOTAutograd: first rewritten into Inductor's decompositions and through
    its joint-graph passes (what ``standalone_compile`` would do in AOTAutograd), then lowered,
    every output keeping its traced strides. Called with the unit's inputs as arguments; the
    compiled code itself (``compiled_fn``) takes them as one list and empties it.

    The generated code's wait for its Triton kernels (which Inductor's compile processes build
    meanwhile) is put off until :meth:`finish`, when the compile binds the unit, after every
    unit of the forward and the backward has been lowered: the kernels of one unit compile while
    the next is lowered, instead of each compile ending in its own wait (about 1.3 s of a 6-block
    regional first step on an H200). Nothing can call the unit before that.

    :meth:`saveable` is the same unit compiled by ``standalone_compile``, once, when a regional
    artifact saves a graph calling this unit (:mod:`fp8conf.artifacts.regional`); that compile
    waits for its own kernels, which the artifact bundles. ``config_patches``: as
    :func:`compile_unit` takes them, for both compiles."""

    def __init__(self, submodule: torch.fx.GraphModule, fake_inputs, config_patches: dict | None = None):
        self._submodule, self._fake_inputs = submodule, list(fake_inputs)
        self._config_patches = dict(config_patches or {})
        self._fake_mode = torch._guards.detect_fake_mode(self._fake_inputs)
        self._saveable = None
        self._waits: list = []
        #: The fast path this unit did not take (a line of :func:`fp8conf.log.fell_back`), or None.
        self.fallback = None
        from fp8conf.torch_internals import probe

        wait = probe("torch._inductor.async_compile.AsyncCompile.wait")
        if wait.found:
            with _kernel_waits_put_off(self._waits):
                self.compiled_fn = _inner_compile_unit(submodule, self._fake_inputs, self._fake_mode, self._config_patches)
        else:
            self.fallback = fell_back("put-off kernel waits", wait.reason, "each unit waits for its kernels before the next compiles")
            self.compiled_fn = _inner_compile_unit(submodule, self._fake_inputs, self._fake_mode, self._config_patches)

    def finish(self) -> None:
        """Wait for the unit's kernels (a kernel that fails to build raises here)."""
        while self._waits:
            self._waits.pop(0)()

    def __call__(self, *args):
        self.finish()
        return self.compiled_fn(list(args))

    def saveable(self) -> Callable:
        """This unit as ``standalone_compile`` compiles it (what a regional artifact stores)."""
        if self._saveable is None:
            context = contextlib.nullcontext() if self._fake_mode is None else torch._guards.tracing(torch._guards.TracingContext(self._fake_mode))
            with context:
                self._saveable = standalone_unit(self._submodule, self._fake_inputs, self._config_patches)
        return self._saveable


#: Where the kernel waits of the unit compiling on this thread go (see :func:`_kernel_waits_put_off`).
_PUT_OFF: contextvars.ContextVar[list | None] = contextvars.ContextVar("fp8conf_kernel_waits", default=None)


@contextlib.contextmanager
def _kernel_waits_put_off(sink: list):
    """While inside, the code Inductor generates and loads on this thread records its
    ``async_compile.wait(globals())`` in ``sink``, as a call of Inductor's own wait on the
    module's globals (whose kernel futures it replaces by kernels), instead of waiting; other
    threads wait as usual."""
    from fp8conf.torch_internals import async_compile_wait_patched

    def patched(original):
        def wait(self, scope):
            pending = _PUT_OFF.get()
            if pending is None:
                return original(self, scope)
            pending.append(functools.partial(original, self, scope))
            return None

        return wait

    token = _PUT_OFF.set(sink)
    try:
        with async_compile_wait_patched(patched):
            yield
    finally:
        _PUT_OFF.reset(token)


def _inner_compile_unit(submodule, fake_inputs, fake_mode, config_patches=None):
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes
    from torch._inductor.utils import BoxedBool

    from fp8conf.compile.partition import inductor_decomposed

    table = select_decomp_table()
    if any(n.op == "call_function" and n.target in table for n in submodule.graph.nodes):
        graph = inductor_decomposed(submodule, fake_inputs, fake_mode if fake_mode is not None else contextlib.nullcontext())
    else:
        from fp8conf.graph.trace import copy_graph_module

        graph = copy_graph_module(submodule)  # the passes below rewrite it; the unit stays as cut
    devices = {v.device for v in fake_inputs if isinstance(v, torch.Tensor)}
    if "input_device" in inspect.signature(joint_graph_passes).parameters and len(devices) == 1:
        graph = joint_graph_passes(graph, input_device=next(iter(devices)))
    else:
        graph = joint_graph_passes(graph)
    # Every output is one the graph around the unit reads: each keeps the strides it was traced
    # with, as for a graph AOTAutograd compiles for inference.
    (output,) = graph.graph.find_nodes(op="output")
    values = output.args[0] if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    output.meta["user_visible_output_idxs"] = [i for i, v in enumerate(values) if isinstance(v, torch.fx.Node)]
    with torch._inductor.config.patch({**_LAZY_TUNING["config_patches"], **(config_patches or {})}):
        return compile_fx_inner(graph, fake_inputs, cudagraphs=BoxedBool(False), is_inference=True)


def _no_nested_remat():
    config = torch._functorch.config
    if hasattr(config, "remat_using_tags_for_fwd_loss_bwd_graph"):
        return config.patch(remat_using_tags_for_fwd_loss_bwd_graph=False)
    return contextlib.nullcontext()


def region_call(compiled, fast: Callable | None = None) -> Callable:
    """A plain function, not the artifact object (FX code generation calls functions by name),
    whose ``__wrapped__`` is the artifact (what a regional artifact saves). With ``fast``
    (:func:`fp8conf.compile.fast_call.fast_entry`), calls after the first skip the artifact's
    wrappers; the first goes through them, for whatever torch does on a graph's first run
    (writing its autotuning cache, say). Its ``boxed`` attribute takes the inputs as one list
    and empties it (through the fast entry's own, after the first call); ``fast`` is the fast
    entry, or ``None``, and ``current()`` what the next call runs."""
    state = {"first": True}

    @functools.wraps(compiled)
    def region(*args):
        if fast is None:
            return compiled(*args)
        if state.pop("first", False):
            return compiled(*args)
        return fast(*args)

    def boxed(args: list):
        if fast is None or state.pop("first", False):
            inputs = tuple(args)
            args.clear()
            return compiled(*inputs)
        return fast.boxed(args)

    def current() -> Callable:
        """What the next call runs: the artifact, or the fast entry."""
        return compiled if fast is None or "first" in state else fast

    boxed.__wrapped__ = compiled
    region.boxed = boxed
    for fn in (region, boxed):
        fn.fast, fn.current = fast, current
    return region


def unit_call(artifact, *, fast_calls: bool = True) -> Callable:
    """A unit loaded from a regional artifact (an ``AOTCompiledArtifact``), called as a compile
    makes its units called (:func:`region_call`), through its fast entry where there is one and
    ``fast_calls`` asks for it."""
    return region_call(artifact, fast_entry(artifact) if fast_calls else None)


def pack_inputs(*values) -> list:
    """The inputs of a boxed call as one list (see :func:`region_call`)."""
    return list(values)


def _flat_callable(gm: torch.fx.GraphModule) -> Callable:
    return gm.forward


def tracing_fake_mode(gm):
    """A tracing context holding the fake mode of ``gm``'s placeholders (with a ShapeEnv), for
    ``standalone_compile(..., dynamic_shapes="from_tracing_context")``."""
    fake_mode = next(
        (n.meta["val"].fake_mode for n in gm.graph.find_nodes(op="placeholder") if isinstance(n.meta.get("val"), torch._subclasses.FakeTensor)),
        None,
    )
    if fake_mode is None:
        return contextlib.nullcontext()
    if fake_mode.shape_env is None:
        # Inductor caches a compiled region, and makes it serializable (a regional artifact), only
        # under a fake mode with a ShapeEnv; without one it bypasses its caches ("No shape env").
        # Shapes stay static: the mode keeps static_shapes.
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        fake_mode.shape_env = ShapeEnv()
    return torch._guards.tracing(torch._guards.TracingContext(fake_mode))
