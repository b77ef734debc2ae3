"""Quantization provenance: which quantized module issued each node of a joint graph.

Provenance lives in ``node.meta["fp8conf_provenance"]`` as a :class:`Provenance`. Forward nodes
are stamped while tracing (each quantized module's forward, and its forward hooks, run under
``torch.fx.traceback.annotate``); backward nodes are then given the provenance of the forward
op they differentiate, paired through autograd's sequence number ``node.meta["seq_nr"]``. Torch
2.13 also copies annotations to backward nodes, older releases do not, so the pairing is done
here and never left to the torch version.

Rules:

* nested quantized modules: the innermost one wins (inner annotations override outer ones);
* a module called twice: both calls carry its FQN, with distinct ``call`` indices;
* gradient accumulation across uses of a tensor has a sequence number of its own, issued by no
  forward op, so it carries no provenance.

Every node also records its **owner**, in ``node.meta["fp8conf_owner"]``: the FQN and class of
the innermost module whose call issued it, and whether that module is a quantized one (paired
to backward nodes alike). Low-precision compute without provenance whose owner is not a
quantized module was issued by a module that declares no quantization, and every pass names that
module (:func:`unattributed_fp8_compute`) rather than blaming a rewrite.

Every node also records which **repeated block** issued it, in ``node.meta["fp8conf_block"]``:
the FQN of the outermost module held at an index of a container (``layers.3``), ``""`` for an
op of the model outside every block (embedding, head), paired to backward nodes alike; a
backward node paired to no forward op has none (:func:`get_block` returns ``None``). Regional
compilation keeps each compiled unit inside one block, so that identical blocks compile once.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
import torch.fx
import torch.fx.traceback as fx_traceback

from fp8contract import types as contract

from fp8conf.arguments import require
from fp8conf.graph.roles import compute_format, is_fp8_compute, is_unjudged_scaled_mm, matrix_operands
from fp8conf.quantized.protocol import QuantizationConfig, class_name, undeclared_fp8_message

__all__ = [
    "PROVENANCE_META_KEY",
    "BLOCK_META_KEY",
    "OWNER_META_KEY",
    "Provenance",
    "CallRecord",
    "get_provenance",
    "get_block",
    "get_owner",
    "repeated_block",
    "repeated_blocks",
    "record_forward_provenance",
    "propagate_provenance",
    "node_passes",
    "unattributed_fp8_compute",
]

PROVENANCE_META_KEY = "fp8conf_provenance"
BLOCK_META_KEY = "fp8conf_block"
OWNER_META_KEY = "fp8conf_owner"
# Keys fp8conf writes into node.meta["custom"] while tracing; removed again by propagation.
_MODULE_KEY = "fp8conf.module"
_CALL_KEY = "fp8conf.call"
_BLOCK_KEY = "fp8conf.block"
_OWNER_KEY = "fp8conf.owner"


@dataclasses.dataclass(frozen=True)
class Provenance(contract.Provenance):
    """The quantized module that issued a node (the contract's fields), and which of its calls:
    ``call`` counts the module's calls from 0."""

    call: int = 0


@dataclasses.dataclass(frozen=True)
class CallRecord:
    """One call of a quantized module during tracing, and which gradients it needs."""

    module_fqn: str
    call: int
    input_requires_grad: bool
    weight_requires_grad: bool


def get_provenance(node: torch.fx.Node) -> Provenance | None:
    require(node, "node", "get_provenance", "node")
    return node.meta.get(PROVENANCE_META_KEY)


def get_block(node: torch.fx.Node) -> str | None:
    """The repeated block that issued ``node`` (``"layers.3"``), ``""`` for the model outside
    every block, ``None`` where unknown (a graph not traced by fp8conf, gradient accumulation)."""
    return node.meta.get(BLOCK_META_KEY)


def get_owner(node: torch.fx.Node) -> tuple[str, str, bool] | None:
    """``(module FQN, class name, quantized)`` of the innermost module whose call issued
    ``node``, ``None`` where unknown (a graph not traced by fp8conf, gradient accumulation)."""
    return node.meta.get(OWNER_META_KEY)


def repeated_blocks(model: torch.nn.Module) -> list[str]:
    """FQNs of the outermost modules held at an index of a container (``layers.3``)."""
    return [fqn for fqn, _ in model.named_modules() if fqn and fqn.split(".")[-1].isdigit() and repeated_block(fqn) == fqn]


def repeated_block(module_fqn: str) -> str:
    """The repeated block a module belongs to: its FQN up to the first index
    (``layers.3.attention.wq`` -> ``layers.3``), or the whole FQN where there is none."""
    parts = module_fqn.split(".")
    index = next((i for i, part in enumerate(parts) if part.isdigit()), len(parts) - 1)
    return ".".join(parts[: index + 1])


@contextlib.contextmanager
def record_forward_provenance(
    model: torch.nn.Module, modules: dict[str, QuantizationConfig], calls: list[CallRecord]
) -> Iterator[None]:
    """Annotate every op each quantized module issues while the context is open.

    Appends a :class:`CallRecord` to ``calls`` per module call. The model's ``forward``
    attributes are restored on exit, whatever happens inside.
    """
    patched, hooks = [], []
    counters = dict.fromkeys(modules, 0)
    for fqn, module in model.named_modules():
        owner = {_OWNER_KEY: (fqn, class_name(type(module)), fqn in modules)}
        if fqn in modules:
            hooks.extend(_annotating_hooks(module, lambda fqn=fqn, owner=owner: {**owner, _MODULE_KEY: fqn, _CALL_KEY: counters[fqn]}))
        else:
            hooks.extend(_annotating_hooks(module, lambda owner=owner: owner))
    for fqn in repeated_blocks(model):
        module = model.get_submodule(fqn)
        patched.append((module, module.__dict__.get("forward")))
        module.forward = _block_forward(module.forward, fqn)
    for fqn in modules:
        module = model.get_submodule(fqn)
        patched.append((module, module.__dict__.get("forward")))
        module.forward = _annotated_forward(module, fqn, counters, calls)
    # The tracer may run the model more than once (metadata collection, then the real trace):
    # each top-level call starts the record afresh, so only the traced run remains.
    if "" not in modules:
        patched.append((model, model.__dict__.get("forward")))
        model.forward = _restarting_forward(model.forward, counters, calls)
    try:
        yield
    finally:
        for handle in hooks:
            handle.remove()
        for module, original in reversed(patched):
            if original is None:
                del module.forward
            else:
                module.forward = original


def _block_forward(inner, fqn):
    def forward(*args, **kwargs):
        with fx_traceback.annotate({_BLOCK_KEY: fqn}):
            return inner(*args, **kwargs)

    return forward


def _restarting_forward(inner, counters, calls):
    def forward(*args, **kwargs):
        calls.clear()
        counters.update(dict.fromkeys(counters, 0))
        return inner(*args, **kwargs)

    return forward


def _annotating_hooks(module, payload):
    """Annotate what ``module`` issues from its hooks and its forward with ``payload()``, a pre-hook
    placed first opening the annotation and a hook placed last (run even when the call raises)
    closing it: hooks, not a patched forward, so they hold whoever calls the module, and they
    cover its forward hooks (tensor parallelism's input and output hooks: TorchAO's
    ``Float8ColwiseParallel`` casts the input to FP8 in one), which run outside ``forward`` yet
    belong to the module's call. A module called inside it annotates its own ops over it."""
    open_annotations = []

    def enter(_module, _args):
        annotation = fx_traceback.annotate(payload())
        annotation.__enter__()
        open_annotations.append(annotation)

    def leave(_module, _args, _output):
        if open_annotations:
            open_annotations.pop().__exit__(None, None, None)

    return [module.register_forward_pre_hook(enter, prepend=True), module.register_forward_hook(leave, always_call=True)]


def _annotated_forward(module, fqn, counters, calls):
    inner = module.forward

    def forward(*args, **kwargs):
        call = counters[fqn]
        counters[fqn] += 1
        first = args[0] if args else next(iter(kwargs.values()), None)
        weight = getattr(module, "weight", None)
        calls.append(
            CallRecord(
                module_fqn=fqn,
                call=call,
                input_requires_grad=bool(getattr(first, "requires_grad", False)),
                weight_requires_grad=bool(getattr(weight, "requires_grad", False)),
            )
        )
        with fx_traceback.annotate({_MODULE_KEY: fqn, _CALL_KEY: call}):
            return inner(*args, **kwargs)

    return forward


def unattributed_fp8_compute(graph: torch.fx.Graph, passes: dict | None = None, provenance_of=None) -> list[contract.Finding]:
    """One ``VAL-003`` finding per scaled matmul of ``graph`` that no quantized module can be
    held to: low-precision compute without provenance, and a scaled matmul whose operands record
    no ``node.meta["val"]`` (whether it computes in low precision cannot be told, so neither
    validation nor region tagging can account for it). Compute issued by a module that declares
    no quantization names that module (its owner) and how to declare it; compute with neither
    provenance nor owner was made by a rewrite that dropped ``node.meta``. Strict passes refuse
    such a graph; others warn."""
    provenance_of = provenance_of or get_provenance
    passes = node_passes(graph) if passes is None else passes
    found = []
    for node in graph.nodes:
        if is_unjudged_scaled_mm(node):
            missing = [a.name for a in matrix_operands(node) if isinstance(a, torch.fx.Node) and "val" not in a.meta]
            found.append(contract.Finding(
                "VAL-003",
                f"scaled matmul '{node.name}' ({node.target}) in the {passes[node]} pass: its operand(s) {missing} record no "
                "node.meta['val'], so whether it computes in FP8, and for which module, cannot be told. A rewrite probably "
                "made new nodes without their meta; copy node.meta (or run torch.fx.passes.fake_tensor_prop.FakeTensorProp)",
                pass_name=passes[node],
                node_name=node.name,
            ))
        elif is_fp8_compute(node) and provenance_of(node) is None:
            found.append(_unattributed(node, passes[node]))
    return found


def _unattributed(node: torch.fx.Node, pass_name: str) -> contract.Finding:
    owner = get_owner(node)
    seen = f"{compute_format(node)} operands into '{node.name}' ({node.target}), {pass_name} pass"
    if owner is not None and not owner[2]:
        return contract.Finding("VAL-003", undeclared_fp8_message(owner[0], owner[1], seen), module_fqn=owner[0],
                                pass_name=pass_name, node_name=node.name)
    return contract.Finding(
        "VAL-003",
        f"FP8 compute node '{node.name}' ({node.target}, {compute_format(node)} operands) in the {pass_name} pass carries no provenance: no "
        "quantized module claims it, so it would be compiled and validated as unknown code. A rewrite "
        "probably replaced the node without copying node.meta; copy node.meta['fp8conf_provenance'] onto new nodes"
        + (f" (the trace saw it issued by quantized module '{owner[0]}')" if owner is not None else ""),
        pass_name=pass_name,
        node_name=node.name,
    )


def node_passes(graph: torch.fx.Graph) -> dict[torch.fx.Node, str]:
    """``"forward"`` or ``"backward"`` for every node.

    AOTAutograd tags joint nodes with ``meta["partitioner_tag"]``. A node a rewrite created
    without tags is backward when any of its inputs is (tangents are backward by definition),
    or when only backward nodes use it: a rebuilt cast of a value saved by the forward pass
    still belongs to the backward.
    """
    require(graph, "graph", "node_passes", "graph")
    passes, untagged = {}, []
    for node in graph.nodes:
        tag = node.meta.get("partitioner_tag")
        if tag in ("is_forward", "is_backward"):
            passes[node] = "backward" if tag == "is_backward" else "forward"
        elif node.op == "placeholder":
            passes[node] = "backward" if node.name.startswith("tangents") else "forward"
        elif node.op == "output":
            passes[node] = "backward"
        else:
            untagged.append(node)
            passes[node] = "backward" if any(passes.get(i) == "backward" for i in node.all_input_nodes) else "forward"
    for node in reversed(untagged):
        users = [u for u in node.users if u.op != "output"]
        if users and all(passes[u] == "backward" for u in users):
            passes[node] = "backward"
    return passes


def propagate_provenance(gm: torch.fx.GraphModule, modules: dict[str, QuantizationConfig]) -> torch.fx.GraphModule:
    """Turn the tracing annotations into provenance on forward nodes, then pair backward nodes.

    Returns ``gm`` itself; only ``node.meta`` changes.
    """
    passes = node_passes(gm.graph)
    first_by_seq_nr: dict[int, tuple[Provenance | None, str, tuple[str, str, bool] | None]] = {}
    for node in gm.graph.nodes:
        block = _take_block(node)
        owner = _take_custom(node, _OWNER_KEY).get(_OWNER_KEY)
        provenance = _take_annotation(node, modules)
        if passes[node] != "forward" or node.op != "call_function":
            continue
        _set(node, provenance)
        node.meta[BLOCK_META_KEY] = block
        _set_owner(node, owner)
        seq_nr = node.meta.get("seq_nr")
        # The first forward op with a sequence number is the one whose autograd node took it:
        # an op that records no autograd node (under no_grad, as a weight cast made outside the
        # module's autograd function) carries the number of whatever ran before it, perhaps
        # another module's op or the previous call of the same module. Backward ops pair with
        # the op that took the number (torch's own copy of forward meta pairs the same way).
        if seq_nr is not None and seq_nr not in first_by_seq_nr:
            first_by_seq_nr[seq_nr] = (provenance, block, owner)
    for node in gm.graph.nodes:
        if passes[node] == "backward" and node.op == "call_function":
            provenance, block, owner = first_by_seq_nr.get(node.meta.get("seq_nr"), (None, None, None))
            _set(node, provenance)
            _set_owner(node, owner)
            node.meta.pop(BLOCK_META_KEY, None)
            if block is not None:
                node.meta[BLOCK_META_KEY] = block
    return gm


def _take_block(node: torch.fx.Node) -> str:
    """The block annotation of ``node`` (``""`` if none), taken out of ``meta["custom"]``."""
    return _take_custom(node, _BLOCK_KEY).get(_BLOCK_KEY, "")


def _take_annotation(node: torch.fx.Node, modules) -> Provenance | None:
    taken = _take_custom(node, _MODULE_KEY, _CALL_KEY)
    if _MODULE_KEY not in taken:
        return None
    fqn, call = taken[_MODULE_KEY], taken.get(_CALL_KEY, 0)
    config = modules[fqn]
    return Provenance(fqn, config.kind, config.recipe, config.emulate, call)


def _take_custom(node: torch.fx.Node, *keys: str) -> dict:
    """The values of ``keys`` in ``node.meta["custom"]``, removed from it."""
    custom = node.meta.get("custom")
    if not custom or not any(k in custom for k in keys):
        return {}
    # Tracing may share one dict between many nodes: replace it, never edit it in place.
    rest = {k: v for k, v in custom.items() if k not in keys}
    if rest:
        node.meta["custom"] = rest
    else:
        del node.meta["custom"]
    return {k: custom[k] for k in keys if k in custom}


def _set_owner(node: torch.fx.Node, owner: tuple[str, str, bool] | None) -> None:
    if owner is None:
        node.meta.pop(OWNER_META_KEY, None)
    else:
        node.meta[OWNER_META_KEY] = owner


def _set(node: torch.fx.Node, provenance: Provenance | None) -> None:
    if provenance is None:
        node.meta.pop(PROVENANCE_META_KEY, None)
    else:
        node.meta[PROVENANCE_META_KEY] = provenance
