"""Repeating equal blocks without the caller's word: which container, whether it pays, and the
proof on the model that copying a block gives what tracing it does.

``trace_joint(model, args)`` with no ``repeat=`` repeats a container of equal blocks
(:mod:`fp8conf.graph.repeat`) when it finds one that pays and the model proves it safe:

* the container (:func:`find_block_container`) is the ModuleList, ModuleDict or Sequential,
  not the model itself, whose children are modules of one class with parameters and which holds
  the most modules in all: the transformer's ``layers`` rather than the experts inside a layer;
* it pays from :data:`AUTO_REPEAT_MIN_BLOCKS` blocks on: the proof traces nine blocks (four,
  then five), so a model of fewer traces faster whole; and its blocks hold quantized modules
  (high-precision blocks have no FP8 compute to speed up, and their backward nodes no module to
  tell the blocks apart by);
* the blocks are equal module by module (:func:`~fp8conf.graph.equal_blocks.blocks_difference`:
  an attribute that differs, a hook on a block, is refused, since nothing says the forward does
  not read it) and the model is not sharded (a copy would carry block 1's collective records);
* the proof (:func:`graph_difference`): the container cut to four blocks and to five is traced,
  and the four-block graph with its middle block copied once more must be the five-block graph
  node for node, in everything fp8conf reads (op, wiring, constants, values' layouts, forward or
  backward, sequence-number pairing, block, owner, provenance, annotations, descriptors) and in
  the calls of the quantized modules. A forward that reads the depth (``len(self.layers)``, a
  scale by it), calls a block twice, in another order or past its neighbours, or reaches a block
  by an index the cut container lacks, fails it. Two depths, not one: the copies of a single
  trace's block equal its other blocks even where the forward reads the depth (each of five
  blocks scaled by 1/5 alike), so one trace cannot show that the copies are right at another.

Whatever fails, the model is traced whole and the reason is logged once through the ``fp8conf``
logger and kept in :class:`~fp8conf.graph.trace.TraceInfo` ``.fallbacks`` (hence in the compiled
step's ``fallbacks``). What the proof cannot see is a forward that treats a block past the fifth
apart from the others (``if i == 17``): a model that does so is traced with ``repeat=False``.
"""

from __future__ import annotations

import torch
import torch.fx
import torch.utils._pytree as pytree

from fp8conf.graph.equal_blocks import TRACED_BLOCKS, blocks_difference, tensor_layout
from fp8conf.graph.provenance import BLOCK_META_KEY, OWNER_META_KEY, PROVENANCE_META_KEY
from fp8conf.graph.repeat import untagged_backward
from fp8conf.log import logger
from fp8conf.parallel.layout import layout_of
from fp8conf.quantized.protocol import find_quantized_modules

__all__ = ["AUTO_REPEAT_MIN_BLOCKS", "PROOF_BLOCKS", "find_block_container", "repeat_refusal", "graph_difference"]

#: Blocks a container needs before trace_joint repeats it unasked: the proof traces
#: ``2 * TRACED_BLOCKS + 1`` of them, and the outside of the model twice.
AUTO_REPEAT_MIN_BLOCKS = 3 * TRACED_BLOCKS
#: The depth of the second trace of the proof.
PROOF_BLOCKS = TRACED_BLOCKS + 1

_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)
#: node.meta keys fp8conf reads after tracing, compared as they are.
_META_KEYS = (("pass", "partitioner_tag"), ("block", BLOCK_META_KEY), ("owner", OWNER_META_KEY),
              ("provenance", PROVENANCE_META_KEY), ("annotations", "custom"), ("collective", "fp8conf_collective"),
              ("descriptor", "desc"))


def find_block_container(model: torch.nn.Module) -> tuple[str, list[str]] | None:
    """``(container FQN, block FQNs)`` of the container of ``model``'s blocks when repeating it
    would pay, else ``None`` (said at debug level)."""
    candidates = [(fqn, module) for fqn, module in model.named_modules() if fqn and _holds_blocks(module)]
    if not candidates:
        logger.debug("trace_joint: %s holds no container of blocks of one class; traced whole", type(model).__qualname__)
        return None
    fqn, container = max(candidates, key=lambda c: sum(1 for _ in c[1].modules()))
    if len(container) < AUTO_REPEAT_MIN_BLOCKS:
        logger.debug("trace_joint: %s.%s holds %d blocks, fewer than the %d from which repeating them pays; traced whole",
                     type(model).__qualname__, fqn, len(container), AUTO_REPEAT_MIN_BLOCKS)
        return None
    blocks = [f"{fqn}.{name}" for name in container._modules]
    if not any(_inside(module, blocks[0]) for module in find_quantized_modules(model)):
        # Tracing tells the blocks' backward nodes apart by the quantized modules in them: blocks
        # without one cannot be copied, and have no FP8 compute for fp8conf to speed up.
        logger.debug("trace_joint: the blocks of %s.%s hold no quantized module; traced whole", type(model).__qualname__, fqn)
        return None
    return fqn, blocks


def _inside(fqn: str, block: str) -> bool:
    return fqn.startswith(block + ".")


def _holds_blocks(module: torch.nn.Module) -> bool:
    if not isinstance(module, _CONTAINERS) or len(module._modules) < 2:
        return False
    children = list(module._modules.values())
    return all(type(child) is type(children[0]) for child in children) and any(True for _ in children[0].parameters())


def repeat_refusal(model: torch.nn.Module, fqn: str) -> str | None:
    """Why container ``fqn`` of ``model`` may not be repeated unasked, known before tracing, or ``None``."""
    if layout_of(model) is not None:
        return "the model is sharded, and a copied block would carry block 1's collective records"
    return blocks_difference(model.get_submodule(fqn), fqn)


def graph_difference(expected: torch.fx.GraphModule, seen: torch.fx.GraphModule) -> str | None:
    """The first node where ``seen`` differs from ``expected`` in what fp8conf reads, as a phrase
    naming the node, or ``None`` when they are the same graph up to node names."""
    ours, theirs = list(seen.graph.nodes), list(expected.graph.nodes)
    if len(ours) != len(theirs):
        return f"{len(ours)} nodes where tracing gives {len(theirs)}"
    seen_key, expected_key = _NodeKey(seen), _NodeKey(expected)
    for node, traced in zip(ours, theirs):
        for (what, value), (_, wanted) in zip(seen_key(node), expected_key(traced)):
            if value != wanted:
                return f"node {node.name} ({node.op} {node.target}): {what} {value!r} where tracing gives {wanted!r}"
    return None


class _NodeKey:
    """A node as fp8conf reads it, names aside: arguments by position in the graph, an op's
    sequence number relative to the graph's first (a gradient accumulation's, which no forward op
    shares, as such)."""

    def __init__(self, gm: torch.fx.GraphModule):
        self.position = {n: i for i, n in enumerate(gm.graph.nodes)}
        ops = [n for n in gm.graph.nodes if n.op == "call_function" and "seq_nr" in n.meta]
        self.base = min((n.meta["seq_nr"] for n in ops), default=0)
        after = untagged_backward(gm.graph)
        self.forward = {n.meta["seq_nr"] for n in ops if n.meta.get("partitioner_tag") != "is_backward" and n not in after}

    def _arg(self, a):
        return ("node", self.position[a]) if isinstance(a, torch.fx.Node) else a

    def __call__(self, node: torch.fx.Node) -> list[tuple[str, object]]:
        seq = node.meta.get("seq_nr")
        val = pytree.tree_map(lambda v: tensor_layout(v) if isinstance(v, torch.Tensor) else v, node.meta.get("val"))
        return [
            ("op", (node.op, str(node.target))),
            ("arguments", pytree.tree_map(self._arg, (node.args, node.kwargs))),
            ("sequence number", None if seq is None or node.op != "call_function" else seq - self.base if seq in self.forward else "accumulation"),
            ("value", val),
            *((what, node.meta.get(key)) for what, key in _META_KEYS),
        ]
