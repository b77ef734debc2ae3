"""What the suite itself reads from a backend's graph, independently of the backend.

The suite needs ground truth that does not come from the backend under test:

* :func:`is_fp8_compute`: the spec's own definition of FP8 compute (a scaled matmul whose two
  matrix operands are FP8, judged from ``node.meta["val"]``), the scaled matmuls being torch's
  and the backend's own e8m0 op (:class:`Fp8Ops`, built once from the backend);
* :func:`copy_graph_module`: a copy of a graph that the backend may rewrite and tag in place
  without the change reaching the suite's cached trace or another property's copy;
* :func:`trace_with_oracle`: while the backend traces, the suite annotates each quantized
  module's forward with ``torch.fx.traceback.annotate`` under a key of its own. Forward nodes
  then say which module issued them; backward nodes are paired with the forward op they
  differentiate through autograd's ``seq_nr``. The backend's provenance is compared with this;
* :func:`tangent_placeholders` / :func:`surely_backward`: which placeholders the backend's
  runner feeds the gradients of the step's outputs, seen while it runs the graph, and the nodes
  those reach: no forward value can depend on the gradient of the step's outputs, so those
  nodes are backward whatever the backend says.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import itertools
import warnings

import torch
import torch.fx
import torch.fx.traceback as fx_traceback

from conformance.api.types import TORCH_COMPUTE_OPS, ComputeOp

__all__ = [
    "Fp8Ops",
    "is_fp8_dtype",
    "is_fp8_compute",
    "Oracle",
    "trace_with_oracle",
    "trace_and_rewrite",
    "Rewritten",
    "RewriteFailed",
    "copy_graph_module",
    "fp8_compute_nodes",
    "is_low_precision_dtype",
    "undeclared_low_precision_compute",
    "declared_on_high_precision",
    "grouped_offsets",
    "unjudged_scaled_mms",
    "no_fp8_compute_reason",
    "is_fp8_cast",
    "live_nodes",
    "output_dependencies",
    "run_for_side_effects_only",
    "tagged_groups",
    "incompleteness",
    "non_convexity",
    "tangent_placeholders",
    "surely_backward",
]

ORACLE_KEY = "conformance.issued_by"
#: Which call of the module issued a node: the module's own call counter while tracing.
ORACLE_CALL_KEY = "conformance.call"
@dataclasses.dataclass(frozen=True)
class Fp8Ops:
    """The ops whose call is FP8 compute when its two matrix operands are low precision.

    torch's scaled matmuls always (:data:`conformance.api.types.TORCH_COMPUTE_OPS`); a backend's
    own ops only when it declares them through the contract (``Backend.fp8_compute_ops``, and
    its ``e8m0_op`` with capability ``e8m0``). The suite builds one per backend
    (:func:`conformance.run.harness.fp8_ops`), so no op name of a backend's is wired in here and two
    backends never see each other's.
    """

    ops: tuple[ComputeOp, ...] = TORCH_COMPUTE_OPS

    @classmethod
    def of(cls, backend) -> Fp8Ops:
        declared = list(TORCH_COMPUTE_OPS)
        for op in backend.fp8_compute_ops():
            if not isinstance(op, ComputeOp):
                raise TypeError(f"backend {backend.name!r}: fp8_compute_ops() holds {op!r}, not a conformance.ComputeOp")
            declared.append(op)
        if "e8m0" in backend.capabilities:
            op = backend.e8m0_op()
            # Any overload of the backend's op computes the same thing: match its packet.
            packet = getattr(op, "overloadpacket", None)
            if packet is None:
                raise TypeError(f"backend {backend.name!r}: e8m0_op() returned {op!r}, expected a torch._ops.OpOverload")
            declared.append(ComputeOp(packet, (0, 1), (2, 3)))
        return cls(tuple(dict.fromkeys(declared)))

    @classmethod
    def declared_by(cls, backend) -> Fp8Ops:
        """What ``backend`` itself declares FP8 compute (``fp8_compute_ops`` and its e8m0 op),
        without the suite's own knowledge of torch's scaled matmuls: what VAL-008 holds it to."""
        everything = cls.of(backend)
        own = tuple(backend.fp8_compute_ops())
        return cls(tuple(op for op in everything.ops if op in own or op not in TORCH_COMPUTE_OPS))

    def __post_init__(self) -> None:
        # What find() said of each target: it is asked of every node of every graph a property
        # reads, and matching goes through the op's printed name.
        object.__setattr__(self, "_found", {})

    def find(self, target) -> ComputeOp | None:
        """The declaration of ``target``, or None for an op that is no compute op."""
        try:
            return self._found[target]
        except KeyError:
            found = self._found[target] = next((op for op in self.ops if op.matches(target)), None)
            return found
        except TypeError:  # a target that cannot be a key
            return next((op for op in self.ops if op.matches(target)), None)

    def matches(self, target) -> bool:
        return self.find(target) is not None


def is_fp8_dtype(dtype) -> bool:
    """Whether ``dtype`` holds FP8 values (e4m3, e5m2 and their variants). ``float8_e8m0fnu``
    does not: it is the dtype of MX scales, powers of two, never FP8 data."""
    return dtype is not None and "float8" in str(dtype) and "e8m0" not in str(dtype)


def _is_fp8(value) -> bool:
    return is_fp8_dtype(getattr(value.meta.get("val") if isinstance(value, torch.fx.Node) else value, "dtype", None))


def is_low_precision_dtype(dtype) -> bool:
    """FP8 (:func:`is_fp8_dtype`) or packed FP4 (``float4_e2m1fn_x2``): what low-precision
    compute multiplies."""
    return is_fp8_dtype(dtype) or (dtype is not None and "float4" in str(dtype))


def _is_low_precision(value) -> bool:
    return is_low_precision_dtype(getattr(value.meta.get("val") if isinstance(value, torch.fx.Node) else value, "dtype", None))


def is_fp8_compute(node: torch.fx.Node, ops: Fp8Ops) -> bool:
    """A call of a compute op whose two matrix operands (at its declared positions) are both low
    precision: FP8 or packed FP4."""
    if node.op != "call_function":
        return False
    found = ops.find(node.target)
    if found is None:
        return False
    first, second = found.operands
    return len(node.args) > max(first, second) and _is_low_precision(node.args[first]) and _is_low_precision(node.args[second])


def scale_operands(node: torch.fx.Node, ops: Fp8Ops | None = None) -> list[torch.fx.Node]:
    """The scales a scaled matmul reads: ``args[2]`` and ``args[3]`` of the first API; the
    tensors of the ``scale_a`` and ``scale_b`` lists (``args[2]``, ``args[5]``) of the second
    (``_scaled_mm_v2``, ``_scaled_grouped_mm_v2``, what ``F.scaled_mm`` lowers to); of an op a
    backend declares (in ``ops``), the arguments at its declared scale positions."""
    declared = ops.find(node.target) if ops is not None else None
    if declared is not None and not any(op is declared for op in TORCH_COMPUTE_OPS):
        values = [node.args[i] for i in declared.scales if len(node.args) > i]
        values = [v for group in values for v in (group if isinstance(group, (list, tuple)) else [group])]
    elif str(node.target).split(".")[-2].endswith("_v2"):
        picked = [node.args[i] if len(node.args) > i else node.kwargs.get(k) for i, k in ((2, "scale_a"), (5, "scale_b"))]
        values = [v for group in picked for v in (group if isinstance(group, (list, tuple)) else [group])]
    else:
        values = [node.args[i] if len(node.args) > i else node.kwargs.get(k) for i, k in ((2, "scale_a"), (3, "scale_b"))]
    return [v for v in values if isinstance(v, torch.fx.Node)]


def grouped_offsets(node: torch.fx.Node):
    """The token-group offsets a grouped GEMM reads (``args[4]`` of ``_scaled_grouped_mm``,
    ``args[8]`` of ``_scaled_grouped_mm_v2``, else the ``offs`` keyword), or None."""
    position = 8 if str(node.target).split(".")[-2].endswith("_v2") else 4
    return node.args[position] if len(node.args) > position else node.kwargs.get("offs")


def fp8_compute_nodes(gm: torch.fx.GraphModule, ops: Fp8Ops) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if is_fp8_compute(n, ops)]


def unjudged_scaled_mms(gm: torch.fx.GraphModule, ops: Fp8Ops) -> list[torch.fx.Node]:
    """Scaled matmuls whose matrix operands record no ``node.meta["val"]``: the suite judges FP8
    compute by operand dtypes, so on such a graph it cannot tell FP8 compute from none."""
    def unknown(value) -> bool:
        return isinstance(value, torch.fx.Node) and getattr(value.meta.get("val"), "dtype", None) is None

    return [n for n in gm.graph.nodes if n.op == "call_function" and ops.matches(n.target) and any(map(unknown, n.args[:2]))]


def no_fp8_compute_reason(gm: torch.fx.GraphModule, ops: Fp8Ops) -> str:
    """Why a graph that should hold FP8 compute shows none, as far as the graph tells."""
    unjudged = unjudged_scaled_mms(gm, ops)
    if unjudged:
        return (
            f"the graph holds {len(unjudged)} scaled matmul(s) (first: '{unjudged[0].name}', {unjudged[0].target}) whose "
            "operands record no node.meta['val']: FP8 compute is judged by operand dtypes, so the backend's graphs must "
            "keep meta['val'] on every node (trace with fake tensors, copy node.meta in rewrites)"
        )
    return "the graph of a non-emulated model holds no FP8 compute at all"


def is_fp8_cast(node: torch.fx.Node) -> bool:
    """A quantization: a node that makes an FP8 tensor from inputs none of which is FP8."""
    return node.op == "call_function" and _is_fp8(node) and not any(_is_fp8(i) for i in node.all_input_nodes)


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` that a backend may rewrite, and whose node meta it may edit in place.

    The graph, every node's meta dict and the dicts and lists nested in it (``meta["custom"]``
    and the ``compile_with_inductor`` value inside it) are the copy's own; everything else in
    meta (fake tensors, provenance objects) is shared, as are parameters and submodules.
    """
    graph = torch.fx.Graph()
    graph._codegen = copy_codegen(gm.graph._codegen)  # keeps the pytree calling convention
    copied_nodes: dict[torch.fx.Node, torch.fx.Node] = {}
    for old in gm.graph.nodes:
        if old.op == "output":
            new = graph.output(torch.fx.map_arg(old.args[0], copied_nodes.__getitem__))
        else:
            new = _node_copy(graph, old, copied_nodes)
        # Into the new node's own (empty) meta dict: assigning a node attribute goes through
        # Node.__setattr__, which re-files the node in the graph's lookup table each time.
        meta = new.meta
        for key, item in old.meta.items():
            meta[key] = _own_containers(item) if isinstance(item, (dict, list)) else item
        copied_nodes[old] = new
    copied = _deferred_graph_module(gm, graph)
    copied.meta = _own_containers(gm.meta)
    return copied


def _node_copy(graph: torch.fx.Graph, node: torch.fx.Node, copied: dict) -> torch.fx.Node:
    """``graph.node_copy(node)``, its arguments mapped through ``copied``, made with no arguments
    and given them after: ``Graph.create_node`` walks every argument of a call for raw SymInts (to
    warn about a graph being built, not copied), a quarter of a copy's time."""
    args = torch.fx.map_arg(node.args, copied.__getitem__)
    kwargs = torch.fx.map_arg(node.kwargs, copied.__getitem__)
    if node.op not in ("call_function", "call_method", "call_module"):
        return graph.create_node(node.op, node.target, args, kwargs, node.name, node.type)
    new = graph.create_node(node.op, node.target, (), {}, node.name, node.type)
    if kwargs:
        new.kwargs = kwargs
    if args:
        new.args = args
    return new


def _deferred_graph_module(root, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """``torch.fx.GraphModule(root, graph)`` that writes its Python code when first called,
    printed or asked for ``.code``, as Inductor's are: most properties only read a copy's nodes,
    and writing the code of every copy was a third of a run's time. On a torch without deferred
    graph modules, a plain one."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError as exc:
        _said_copies_write_code_at_once(str(exc))
        return torch.fx.GraphModule(root, graph)
    return _LazyGraphModule(root, graph)


@functools.cache
def _said_copies_write_code_at_once(why: str) -> None:
    warnings.warn(f"the suite's graph copies write their Python code when made ({why}): the run is slower, "
                  "its verdicts the same", RuntimeWarning, stacklevel=3)


def copy_codegen(codegen):
    """A copy of a graph's code generator (its pytree calling convention). torch's own copy of a
    ``TreeSpec`` makes a check that torch deprecates; the warning says nothing about the backend."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)
        return copy.deepcopy(codegen)


def _own_containers(value):
    """``value`` with its dicts and lists, at any depth, copied; other objects are shared."""
    if isinstance(value, dict):
        own = copy.copy(value)  # keeps the class of a dict subclass
        for key, item in value.items():
            if isinstance(item, (dict, list)):  # most items are not: no call for those
                own[key] = _own_containers(item)
        return own
    if isinstance(value, list):
        return [_own_containers(item) if isinstance(item, (dict, list)) else item for item in value]
    return value


def live_nodes(gm: torch.fx.GraphModule) -> set:
    """The nodes torch's dead-code elimination keeps: those the graph's outputs depend on, every
    node with a side effect (an in-place or otherwise mutating op, as it judges it:
    ``Node.is_impure``, random ops not counted as such) and everything those depend on. A
    ``make_fx`` graph's in-place ``mul_`` on a value nothing returns stays, with what it reads.
    What counts as FP8 compute is what reaches an output (:mod:`conformance.judge.dead_compute`)."""
    return _with_inputs(n for n in gm.graph.nodes if n.op == "output" or _has_side_effect(n))


def output_dependencies(gm: torch.fx.GraphModule) -> set:
    """The nodes the graph's outputs depend on (the output node included)."""
    return _with_inputs(gm.graph.find_nodes(op="output"))


def undeclared_low_precision_compute(gm: torch.fx.GraphModule, declared: Fp8Ops) -> list[torch.fx.Node]:
    """The nodes of ``gm`` that compute in low precision, judged by dtypes alone (two or more FP8
    or packed FP4 tensors in, a high-precision floating tensor out), whose op ``declared`` does
    not hold."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or declared.matches(node.target):
            continue
        inputs = [a for a in node.all_input_nodes if _is_low_precision(a)]
        outputs = node.meta.get("val")
        outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
        high = [v for v in outputs if getattr(v, "dtype", None) is not None and v.dtype.is_floating_point and not is_low_precision_dtype(v.dtype)]
        if len(inputs) >= 2 and high:
            found.append(node)
    return found


def declared_on_high_precision(gm: torch.fx.GraphModule, declared: Fp8Ops) -> list[torch.fx.Node]:
    """The calls in ``gm`` of an op ``declared`` holds whose matrix operands are not both low
    precision: a declared FP8 op computing in high precision."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and declared.matches(n.target) and not is_fp8_compute(n, declared)]


def run_for_side_effects_only(gm: torch.fx.GraphModule) -> set:
    """The nodes that run (:func:`live_nodes`) although no output depends on them: a side
    effect and what it needs, such as a grad_input nobody asked for that TorchAO scales in
    place in a ``make_fx`` graph."""
    return live_nodes(gm) - output_dependencies(gm)


def _with_inputs(roots) -> set:
    found, stack = set(), list(roots)
    while stack:
        node = stack.pop()
        if node not in found:
            found.add(node)
            stack.extend(node.all_input_nodes)
    return found


def _has_side_effect(node: torch.fx.Node) -> bool:
    if node.op != "call_function":
        return False
    try:
        return node.is_impure(impure_random=False)
    except TypeError:  # a torch whose is_impure takes no impure_random
        return isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable


@dataclasses.dataclass
class Oracle:
    """Which module issued each call_function node (``None``: no quantized module), and in which
    of its calls (``call_of``: ``(fqn, n)`` for the module's ``n``-th call while tracing)."""

    issued_by: dict[torch.fx.Node, str | None]
    forward_seq_nrs: frozenset
    call_of: dict[torch.fx.Node, tuple[str, int] | None] = dataclasses.field(default_factory=dict)

    def is_accumulation(self, node: torch.fx.Node) -> bool:
        """A backward node issued by no forward op: gradient accumulation."""
        return node.meta.get("seq_nr") not in self.forward_seq_nrs


@contextlib.contextmanager
def _annotate_modules(model: torch.nn.Module, fqns):
    patched = []
    for fqn in fqns:
        module = model.get_submodule(fqn)
        original = module.__dict__.get("forward")
        inner = module.forward

        def forward(*args, _inner=inner, _fqn=fqn, _calls=itertools.count(), **kwargs):
            with fx_traceback.annotate({ORACLE_KEY: _fqn, ORACLE_CALL_KEY: next(_calls)}):
                return _inner(*args, **kwargs)

        module.forward = forward
        patched.append((module, original))
    try:
        yield
    finally:
        for module, original in patched:
            if original is None:
                del module.forward
            else:
                module.forward = original


def trace_with_oracle(backend, model, args, quantized_fqns, is_backward) -> tuple[torch.fx.GraphModule, Oracle]:
    """Let ``backend`` trace ``model`` while the suite records its own ground truth."""
    return _with_oracle(_traced(backend, model, args, quantized_fqns), is_backward)


class RewriteFailed(Exception):
    """The backend's ``rewrite()`` raised or returned something other than a graph module."""


@dataclasses.dataclass
class Rewritten:
    """A traced graph and the backend's rewrite of it, each with the suite's oracle."""

    gm: torch.fx.GraphModule
    oracle: Oracle
    traced_gm: torch.fx.GraphModule
    traced_oracle: Oracle


def trace_and_rewrite(backend, model, args, quantized_fqns, is_backward) -> Rewritten:
    """As :func:`trace_with_oracle`, then the backend's post-trace passes (``Backend.rewrite``,
    capability ``rewrites``) on the traced graph. The suite's annotation of who issued each node
    is still in the nodes' ``meta["custom"]`` while the rewrite runs: a rewrite that copies node
    metadata, as it must for provenance, carries it to the nodes it makes; one that does not
    leaves them issued by no module, as it leaves them without provenance."""
    gm = _traced(backend, model, args, quantized_fqns)
    before = _with_oracle(copy_graph_module(gm), is_backward)
    try:
        rewritten = backend.rewrite(gm)
    except Exception as exc:
        raise RewriteFailed(f"rewrite() raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(rewritten, torch.fx.GraphModule):
        raise RewriteFailed(f"rewrite() returned {type(rewritten).__qualname__}, expected torch.fx.GraphModule")
    return Rewritten(*_with_oracle(rewritten, is_backward), *before)


def _traced(backend, model, args, quantized_fqns) -> torch.fx.GraphModule:
    with fx_traceback.preserve_node_meta(), _annotate_modules(model, quantized_fqns):
        gm = backend.trace_joint(model, args)
    if not isinstance(gm, torch.fx.GraphModule):
        raise TypeError(f"backend {backend.name!r}: trace_joint returned {type(gm).__qualname__}, expected torch.fx.GraphModule")
    return gm


def _with_oracle(gm: torch.fx.GraphModule, is_backward) -> tuple[torch.fx.GraphModule, Oracle]:
    """``gm`` without the suite's annotations, and the oracle they make."""
    issued_by, call_of, first_by_seq = {}, {}, {}
    backward_nodes = []
    for node in gm.graph.nodes:
        call = _take_oracle_keys(node)
        if node.op != "call_function":
            continue
        if is_backward(node):
            backward_nodes.append(node)
        else:
            issued_by[node], call_of[node] = (call[0] if call else None), call
            # The first forward op of a sequence number is the one whose autograd node took it;
            # later ops may carry it too (a cast under no_grad, made by the next call, keeps the
            # number of the autograd node before it) without being what the backward differentiates.
            first_by_seq.setdefault(node.meta.get("seq_nr"), call)
    for node in backward_nodes:
        # A backward node differentiates the forward op of its seq_nr, so the same call.
        call_of[node] = first_by_seq.get(node.meta.get("seq_nr"))
        issued_by[node] = call_of[node][0] if call_of[node] else None
    return gm, Oracle(issued_by, frozenset(k for k in first_by_seq if k is not None), call_of)


def _take_oracle_keys(node) -> tuple[str, int] | None:
    """``(fqn, call)`` the suite annotated on ``node``, removed from its meta."""
    custom = node.meta.get("custom")
    if not custom or ORACLE_KEY not in custom:
        return None
    rest = {k: v for k, v in custom.items() if k not in (ORACLE_KEY, ORACLE_CALL_KEY)}
    if rest:
        node.meta["custom"] = rest
    else:
        del node.meta["custom"]
    return custom[ORACLE_KEY], custom.get(ORACLE_CALL_KEY)



def tagged_groups(gm: torch.fx.GraphModule) -> dict[object, set[torch.fx.Node]]:
    """Nodes tagged for regional Inductor, grouped by region id (``None``: no id given)."""
    groups: dict[object, set[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        value = (node.meta.get("custom") or {}).get("compile_with_inductor")
        if value is None:
            continue
        region_id = value.get("inductor_region") if isinstance(value, dict) else None
        groups.setdefault(region_id, set()).add(node)
    return groups


def incompleteness(nodes: set, is_backward, ops: Fp8Ops) -> str | None:
    """Why ``nodes`` is not a complete FP8 region, or None when it is.

    Complete: it holds FP8 compute, and every FP8 value its nodes use and every scale its
    compute nodes use is made inside it or enters at a boundary: a placeholder, or a value of
    the other pass (saved for backward).
    """
    computes = [n for n in nodes if is_fp8_compute(n, ops)]
    if not computes:
        return "it holds no FP8 compute"
    entering = [(n, i) for n in nodes for i in n.all_input_nodes if i not in nodes and _is_fp8(i)]
    entering += [(c, a) for c in computes for a in scale_operands(c, ops) if a not in nodes]
    for consumer, value in entering:
        if value.op == "placeholder" or is_backward(value) != is_backward(consumer):
            continue
        return f"'{value.name}' used by '{consumer.name}' is made outside the region"
    return None


def non_convexity(nodes: set) -> str | None:
    """A path that leaves ``nodes`` and comes back, or None when the set is convex."""
    outside = {user for n in nodes for user in n.users if user not in nodes}
    stack, seen = list(outside), set(outside)
    while stack:
        node = stack.pop()
        for user in node.users:
            if user in nodes:
                return f"the path through '{node.name}' leaves the region and re-enters at '{user.name}'"
            if user not in seen:
                seen.add(user)
                stack.append(user)
    return None


class _InputsSeen(Exception):
    """Stops a run once the graph's inputs were seen: nothing of the graph needs to execute."""


def tangent_placeholders(run_joint, gm: torch.fx.GraphModule, grad_outputs) -> list[torch.fx.Node]:
    """The placeholders of ``gm`` that the backend's runner feeds the gradients of the step's
    outputs (``grad_outputs``), observed: ``run_joint(fn)`` must run the joint graph through the
    backend with ``fn`` in its place; ``fn`` reads its arguments as ``gm`` binds them to its
    placeholders (its own calling convention) and stops the run there. A placeholder is a
    tangent when it receives one of ``grad_outputs``, the tensor itself or an equal copy."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    seen: list = []

    def fn(*args):
        seen.extend(gm.graph.process_inputs(*args))
        raise _InputsSeen

    try:
        run_joint(fn)
    except _InputsSeen:
        pass
    if len(seen) != len(placeholders):
        raise ValueError(f"the runner fed {len(seen)} value(s) to a graph of {len(placeholders)} placeholder(s)")
    return [p for p, value in zip(placeholders, seen) if any(_same_tensor(value, g) for g in grad_outputs)]


def _same_tensor(value, expected) -> bool:
    if value is expected:
        return True
    return (
        isinstance(value, torch.Tensor) and isinstance(expected, torch.Tensor)
        and value.shape == expected.shape and value.dtype == expected.dtype and value.device == expected.device
        and torch.equal(value, expected)
    )


def surely_backward(tangents) -> set[torch.fx.Node]:
    """The ``call_function`` nodes the tangent placeholders reach: they depend on the gradient
    of the step's outputs, which no forward value can, so they belong to the backward."""
    found, stack = set(), [u for t in tangents for u in t.users]
    while stack:
        node = stack.pop()
        if node not in found:
            found.add(node)
            stack.extend(node.users)
    return {n for n in found if n.op == "call_function"}
