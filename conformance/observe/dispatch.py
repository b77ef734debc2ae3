"""What ran eagerly, observed rather than asked: the ops that reach torch's dispatcher.

Inductor's generated code computes without calling aten ops; what a compiled callable leaves
eager dispatches each of its ops. So the suite decides what ran compiled from what it sees
dispatched while a callable runs, not from the backend's report alone (NUM-003):

* :class:`DispatchCounter` counts the op overloads that reach the dispatcher while it is active,
  and the conversions to FP8 among them; :func:`observed` wraps a callable so that only its own
  calls are counted;
* :func:`dispatches_per_node` runs a joint graph eagerly, node by node, and records which
  overloads each node dispatches: its own op, or what a composite op decomposes into;
* :func:`equal_computations` groups the nodes that compute the same thing from the same inputs,
  which a partitioner's common-subexpression elimination may run once;
* :func:`always_generated` says which overloads Inductor always turns into generated code
  (pointwise ops it lowers and never falls back on): such an op dispatched while a compiled
  region should be computing it was run eagerly;
* :class:`BlockScaledCalls` records, for every call that reaches the dispatcher with FP8
  operands and e8m0 scales (``uint8`` bytes or ``float8_e8m0fnu``), the scale bytes it received:
  what an MX matmul was given, eager or compiled, whatever the op's name.

Extern kernels (matmuls, Inductor's fallbacks) dispatch from compiled code too, and a
partitioner may recompute eager nodes: dispatches may exceed the eager nodes, never fall short
of them, which is the direction the suite checks for every op, and the other direction only for
the ops Inductor always generates code for.
"""

from __future__ import annotations

import collections
import functools

import torch
import torch.fx

from conformance.observe.graphs import is_fp8_dtype

__all__ = ["DispatchCounter", "observed", "dispatches_per_node", "equal_computations", "always_generated", "BlockScaledCalls"]

_CASTS = ("aten._to_copy.default", "prims.convert_element_type.default")


class _Watcher:
    """A reentrant context manager that, while active, shows every op call reaching torch's
    dispatcher to :meth:`seen` (with its result), one ``TorchDispatchMode`` per ``with``."""

    def __init__(self):
        self._modes: list = []

    def seen(self, func, args, kwargs, out) -> None:
        raise NotImplementedError

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        watcher = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                watcher.seen(func, args, kwargs, out)
                return out

        mode = Mode()
        mode.__enter__()
        self._modes.append(mode)
        return self

    def __exit__(self, *exc):
        return self._modes.pop().__exit__(*exc)


class DispatchCounter(_Watcher):
    """Counts, while active (``with counter:``, reentrant), every op overload that reaches the
    dispatcher (``counts``) and how many of those calls convert a tensor to FP8 (``fp8_casts``)."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.fp8_casts = 0

    def seen(self, func, args, kwargs, out) -> None:
        self.counts[func] += 1
        if str(func) in _CASTS and is_fp8_dtype(getattr(out, "dtype", None)):
            self.fp8_casts += 1


def observed(fn):
    """``(wrapped, counter)``: ``wrapped`` calls ``fn`` with the same arguments while ``counter``
    counts what reaches the dispatcher, so that only ``fn``'s own work is counted, not what a
    backend's runner does around it."""
    counter = DispatchCounter()

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with counter:
            return fn(*args, **kwargs)

    return wrapped, counter


class _NodeByNode(torch.fx.Interpreter):
    """Runs a graph eagerly and records, per node, the overloads it dispatched."""

    def __init__(self, gm: torch.fx.GraphModule, counter: DispatchCounter):
        super().__init__(gm)
        self.counter = counter
        self.per_node: dict[torch.fx.Node, collections.Counter] = {}

    def run_node(self, n):
        before = collections.Counter(self.counter.counts)
        result = super().run_node(n)
        self.per_node[n] = self.counter.counts - before
        return result


def dispatches_per_node(run_joint, gm: torch.fx.GraphModule) -> dict[torch.fx.Node, collections.Counter]:
    """What each node of ``gm`` dispatches when ``gm`` runs eagerly, node by node, and how often.
    ``run_joint(fn)`` must run the joint graph through the backend with ``fn`` in its place:
    ``fn`` runs ``gm`` with ``gm``'s own calling convention."""
    counter = DispatchCounter()
    interpreter = _NodeByNode(gm, counter)

    def fn(*args):
        with counter:
            return interpreter.run(*args)

    run_joint(fn)
    return interpreter.per_node


def equal_computations(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, int]:
    """A class number per ``call_function`` node, equal for nodes that apply the same op to the
    same arguments (their input nodes equal in turn): what common-subexpression elimination may
    merge into one. A node with a side effect, or a random one, is a class of its own."""
    classes: dict[torch.fx.Node, int] = {}
    table: dict[tuple, int] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or _has_side_effect(node):
            classes[node] = len(table)
            table[("own", node)] = classes[node]
            continue
        args = torch.fx.node.map_arg(node.args, lambda n: _Class(classes[n]))
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: _Class(classes[n]))
        classes[node] = table.setdefault((str(node.target), repr(args), repr(sorted(kwargs.items()))), len(table))
    return {n: c for n, c in classes.items() if n.op == "call_function"}


class _Class:
    """An input node inside another node's key: its class number."""

    def __init__(self, number: int):
        self.number = number

    def __repr__(self):
        return f"<class {self.number}>"


def _has_side_effect(node: torch.fx.Node) -> bool:
    try:
        return node.is_impure(impure_random=True)
    except TypeError:  # a torch whose is_impure takes no impure_random
        return node.is_impure()


@functools.lru_cache(maxsize=None)
def always_generated(op) -> bool:
    """Whether Inductor always computes ``op`` in generated code: a pointwise overload that it
    lowers (directly or through its decompositions) and never calls as a fallback kernel."""
    if not isinstance(op, torch._ops.OpOverload) or torch.Tag.pointwise not in op.tags:
        return False
    from torch._inductor import lowering
    from torch._inductor.decomposition import select_decomp_table

    return op not in lowering.fallbacks and (op in lowering.lowerings or op in select_decomp_table())


#: The dtypes an e8m0 scale travels in: its own, or its bytes.
_SCALE_DTYPES = ("torch.uint8", "torch.float8_e8m0fnu")


class BlockScaledCalls(_Watcher):
    """While active (``with calls:``), every op call that reaches the dispatcher with at least one
    FP8 tensor argument and at least one e8m0 scale argument (``uint8`` or ``float8_e8m0fnu``) is
    recorded in ``calls`` as ``(op name, scales)``, ``scales`` a tuple of ``(shape, bytes)`` of the
    scale arguments in argument order (lists of tensors, as ``_scaled_mm_v2`` takes, flattened),
    each read in its logical layout: a call's scales are compared by value, not by stride."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, tuple]] = []

    def seen(self, func, args, kwargs, out) -> None:
        tensors = list(_tensors_in((*args, *kwargs.values())))
        scales = [t for t in tensors if str(t.dtype) in _SCALE_DTYPES]
        if scales and any(is_fp8_dtype(t.dtype) for t in tensors):
            self.calls.append((str(func), tuple(_bytes_of(t) for t in scales)))


def _tensors_in(values):
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from _tensors_in(v)


def _bytes_of(t: torch.Tensor) -> tuple:
    flat = t.detach().contiguous().view(torch.uint8).reshape(-1).cpu()
    return tuple(t.shape), bytes(flat.tolist())


