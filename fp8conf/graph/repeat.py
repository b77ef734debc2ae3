"""Tracing a model of N equal blocks at the cost of four: the middle block's nodes copied N-2 times.

Tracing the joint graph costs about the same per node wherever the node comes from (AOT export
dispatches every op through functionalization, fake tensors and the autograd engine), so a deep
model's cold start grows with its depth although its blocks are all alike. When the container of
its blocks is repeated (``trace_joint(model, args)`` finds it, ``repeat="layers"`` names it), only
blocks 0 to 3 are traced; the graph of the whole model is then built from that one:

* block 0 (fed by the embedding) and block 3 (feeding the head) are kept, block 3 standing for
  block N-1;
* block 1, fed by a block and feeding one, is the *template*: its forward nodes are emitted once
  per middle block 1..N-2 in forward order, its backward span once per middle block in reverse;
* block 2 is traced only to learn how a middle block is wired to its neighbours: node for node it
  must equal block 1, and where block 1 reads a value of block 0 (or of block 2's backward), block
  2 reads the same node of block 1 (of block 3's backward). That is the rule each copy follows.
  Block 2's nodes are then dropped;
* a block's *tail*, the untagged ops AOT appends after the whole backward that read only that
  block's gradients (two transposes per rowwise weight gradient), is copied with its block, in
  block order where the template's tail was.

Every copy gets its block's parameters as placeholders (descriptors, provenance, ``fp8conf_block``
and module stacks renamed), and autograd sequence numbers of its own, consistent between its
forward ops and the backward nodes paired with them. The result is the graph tracing all N blocks
would give, up to node names and one thing: a copied node carries its template node's traced
value (``meta["val"]``), right in shape, dtype and layout, but the same fake tensor in every
copy, so that storage identity says nothing across blocks (a block's input and its own output
seem to share storage). Whoever reads aliasing from the traced values must not trust it here.

The blocks must compute the same function of their parameters, at any depth: they must be of one
class with equal attributes (checked module by module, :mod:`fp8conf.graph.equal_blocks`;
``per_block`` names those the forward never reads, such as an index kept for weight
initialisation), and a forward that depended on the depth itself (``len(self.layers)``) would be
traced at depth four. Who says so: with ``repeat="layers"`` the caller, unchecked; with no
``repeat``, trace_joint finds the container and proves it on the model, tracing it at depths four
and five, and traces the model whole where the proof fails (:mod:`fp8conf.graph.auto_repeat`);
``repeat=False`` traces every block.
"""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.fx
import torch.utils._pytree as pytree

from fp8conf.errors import FP8TraceError
from fp8conf.graph.equal_blocks import TRACED_BLOCKS, equal_values
from fp8conf.graph.lazy_code import graph_module
from fp8conf.graph.provenance import BLOCK_META_KEY, OWNER_META_KEY, PROVENANCE_META_KEY, CallRecord

__all__ = ["RepeatRefused", "repeat_blocks", "repeat_calls", "untagged_backward"]

_MODULE_STACK_KEYS = ("nn_module_stack", "fwd_nn_module_stack")
#: A node name's base and number, as torch.fx splits them (``mm_3`` -> ``mm``, ``3``).
_NAME = re.compile(r"^([a-zA-Z_][0-9a-zA-Z_]*?)(?:_(\d+))?$")


@dataclasses.dataclass
class _Block:
    """One traced block: its forward nodes and backward span in graph order, its placeholders by
    the FQN suffix of the parameter or buffer they hold."""

    fqn: str
    forward: list = dataclasses.field(default_factory=list)
    backward: list = dataclasses.field(default_factory=list)
    placeholders: dict = dataclasses.field(default_factory=dict)
    #: Nodes after every block's backward computed from this block's gradients alone: the
    #: transposes AOT adds to give a rowwise weight gradient its parameter's layout.
    tail: list = dataclasses.field(default_factory=list)

    def index(self):
        return ({n: i for i, n in enumerate(self.forward)}, {n: i for i, n in enumerate(self.backward)},
                {n: i for i, n in enumerate(self.tail)})


def repeat_blocks(gm: torch.fx.GraphModule, blocks: list[str]) -> torch.fx.GraphModule:
    """The joint graph of a model whose container holds ``blocks`` (all of them, in order), built
    from ``gm``, its graph traced with only the first :data:`TRACED_BLOCKS` of them."""
    traced = _segments(gm, blocks[:TRACED_BLOCKS])
    return _Emit(gm, _Plan(traced, blocks)).graph_module()


def repeat_calls(calls, blocks: list[str]) -> tuple[CallRecord, ...]:
    """The quantized-module calls of the whole model, from those of its traced first four blocks."""
    first, template, reference, last = blocks[:TRACED_BLOCKS]
    out, emitted = [], False
    for call in calls:
        owner = next((b for b in (template, reference, last) if _inside(call.module_fqn, b)), None)
        if owner == template:
            if not emitted:
                run = [c for c in calls if _inside(c.module_fqn, template)]
                out += [dataclasses.replace(c, module_fqn=_rename(c.module_fqn, template, b)) for b in blocks[1:-1] for c in run]
                emitted = True
        elif owner == last:
            out.append(dataclasses.replace(call, module_fqn=_rename(call.module_fqn, last, blocks[-1])))
        elif owner is None:
            out.append(call)
    return tuple(out)


def _inside(fqn: str, block: str) -> bool:
    return fqn == block or fqn.startswith(block + ".")


def _rename(fqn: str, old: str, new: str) -> str:
    return new + fqn[len(old):] if _inside(fqn, old) else fqn


def _desc_target(desc) -> str | None:
    """The parameter or buffer FQN an AOT descriptor names, looking through gradients of them."""
    while dataclasses.is_dataclass(desc):
        target = getattr(desc, "target", None)
        if isinstance(target, str):
            return target
        desc = getattr(desc, "grad_of", None)
    return None


def _retarget(desc, old: str, new: str):
    if not dataclasses.is_dataclass(desc):
        return desc
    changes = {}
    for field in dataclasses.fields(desc):
        value = getattr(desc, field.name)
        if field.name == "target" and isinstance(value, str):
            changes[field.name] = _rename(value, old, new)
        elif dataclasses.is_dataclass(value):
            changes[field.name] = _retarget(value, old, new)
    return dataclasses.replace(desc, **changes)


def untagged_backward(graph: torch.fx.Graph) -> set:
    """The ops AOT leaves without a pass tag that are computed from the backward: the transposes it
    appends after the whole backward to give a rowwise weight gradient its parameter's layout.
    Being untagged, they would pass for forward ops; their sequence number is a gradient
    accumulation's, which no forward op has."""
    found = set()
    for node in graph.nodes:
        if node.op == "call_function" and node.meta.get("partitioner_tag") is None and any(
            a.meta.get("partitioner_tag") == "is_backward" or a in found for a in node.all_input_nodes
        ):
            found.add(node)
    return found


def _segments(gm, fqns: list[str]) -> list[_Block]:
    """Each traced block's forward nodes, backward span, tail and placeholders. A backward span
    runs from the block's first backward node to the next node of another block or of the model
    outside every block; gradient accumulation inside it (no block of its own) belongs to it. An
    untagged node computed from one block's backward alone is that block's tail; one computed from
    several blocks' is the model's, outside every block."""
    blocks = {fqn: _Block(fqn) for fqn in fqns}
    forward, backward = _Runs(blocks, "forward"), _Runs(blocks, "backward")
    after = untagged_backward(gm.graph)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            target = _desc_target(node.meta.get("desc"))
            owner = next((b for b in fqns if target and _inside(target, b)), None)
            if owner:
                blocks[owner].placeholders[node] = target[len(owner) + 1:]
        elif node.op == "call_function" and node not in after:
            label = node.meta.get(BLOCK_META_KEY)
            if node.meta.get("partitioner_tag") == "is_backward":
                backward.add(node, label)
            else:
                forward.add(node, label)
    owner_of = {n: fqn for fqn, b in blocks.items() for n in b.backward}
    for node in gm.graph.nodes:
        if node in after:
            owners = {owner_of.get(a) for a in node.all_input_nodes}
            if len(owners) == 1 and None not in owners:
                owner = owners.pop()
                blocks[owner].tail.append(node)
                owner_of[node] = owner
    for block in blocks.values():
        if not block.forward or not block.backward:
            raise _unsupported(f"block {block.fqn} issued no {'forward' if not block.forward else 'backward'} node")
    return [blocks[f] for f in fqns]


class _Runs:
    """Hands the nodes of one pass to the block whose run they are in, checking that each block's
    run is one (the model outside the blocks, ``""``, may have several): a node without a block
    (``None``) continues the current run, and so do nodes of the model outside the blocks amid one
    block's run, where that block's run goes on after them. (The first gradient accumulations of
    the backward take the sequence number of the forward's last op, the head's, and with it the
    head's label, amid the last block's backward.)"""

    def __init__(self, blocks: dict, what: str):
        self.blocks, self.what, self.current, self.done = blocks, what, None, set()
        self.interrupted, self.pending = None, []  # the block whose run nodes of the model outside interrupt, and those nodes

    def add(self, node, label):
        if label is not None and label != self.current:
            if label == "" and self.current in self.blocks:
                self.interrupted = self.current
            if label == self.interrupted and self.pending:
                getattr(self.blocks[label], self.what).extend(self.pending)
                self.done.discard(label)
            elif label != "":
                self.interrupted = None
            self.pending = []
            if self.current in self.blocks:
                self.done.add(self.current)
            if label in self.done:
                raise _unsupported(f"the {self.what} of {label} is not one run of the graph (node {node.name})")
            self.current = label
        if self.current in self.blocks:
            getattr(self.blocks[self.current], self.what).append(node)
        elif self.interrupted is not None:
            self.pending.append(node)


class RepeatRefused(FP8TraceError):
    """The traced blocks cannot be repeated; ``why`` says what in the graph forbids it.

    Its message is for a caller who asked for ``repeat=`` and must trace without it. Where
    trace_joint chose to repeat unasked (:mod:`fp8conf.graph.auto_repeat`), the error is never
    raised to the caller: ``why`` becomes the reason of the logged fallback to the whole trace."""

    def __init__(self, why: str):
        super().__init__(
            f"trace_joint(repeat=...): the traced blocks cannot be repeated: {why}. A repeated block may read only its own "
            "values, the previous block's, the next block's gradients and values every block shares; trace without repeat="
        )
        self.why = why


def _unsupported(why: str) -> RepeatRefused:
    return RepeatRefused(why)


class _Plan:
    """What a middle block reads, learnt from the traced blocks 1 (the template) and 2 (its
    reference): its own values, its parameters, the previous block's values (``prev_rule``), the
    next block's gradients (``next_rule``) and values every block shares. Raises when the two
    blocks differ or something outside the blocks reads them."""

    def __init__(self, traced: list[_Block], blocks: list[str]):
        self.blocks = blocks
        self.first, self.template, self.reference, self.last = traced
        self.middle = len(blocks) - 2  # copies of the template: blocks[1] .. blocks[-2]
        self.t_forward, self.t_backward, self.t_tail = self.template.index()
        self.r_forward, self.r_backward, self.r_tail = self.reference.index()
        self.t_nodes = set(self.template.forward) | set(self.template.backward) | set(self.template.tail)
        self.r_nodes = set(self.reference.forward) | set(self.reference.backward) | set(self.reference.tail)
        self.first_forward, self.last_backward = set(self.first.forward), {n: i for i, n in enumerate(self.last.backward)}
        self.prev_rule, self.next_rule = {}, {}
        self._pair(self.template.forward, self.reference.forward, "forward")
        self._pair(self.template.backward, self.reference.backward, "backward")
        self._pair(self.template.tail, self.reference.tail, "tail")
        self._check_outside_users()

    # -- what a middle block reads from its neighbours, learnt from blocks 1 and 2 -----------------

    def _category(self, arg, block: _Block, prev: _Block, nxt_backward: dict):
        own_forward, own_backward, own_tail = (
            (self.t_forward, self.t_backward, self.t_tail) if block is self.template else (self.r_forward, self.r_backward, self.r_tail)
        )
        if arg in own_forward:
            return ("forward", own_forward[arg])
        if arg in own_backward:
            return ("backward", own_backward[arg])
        if arg in own_tail:
            return ("tail", own_tail[arg])
        if arg in block.placeholders:
            return ("param", block.placeholders[arg])
        if arg in (self.first_forward if prev is self.first else self.t_forward):
            return ("prev", arg)
        if arg in nxt_backward:
            return ("next", arg)
        for other in (self.first, self.template, self.reference, self.last):
            if other is not block and (arg in other.forward or arg in other.backward or arg in other.tail or arg in other.placeholders):
                raise _unsupported(f"{block.fqn} reads {arg.name} of {other.fqn}, not its neighbour's value a repeated block may read")
        return ("global", arg)

    def _pair(self, t_nodes, r_nodes, what: str):
        if len(t_nodes) != len(r_nodes):
            raise _unsupported(f"the {what} of {self.template.fqn} has {len(t_nodes)} nodes, of {self.reference.fqn} {len(r_nodes)}")
        for t, r in zip(t_nodes, r_nodes):
            t_leaves, t_spec = pytree.tree_flatten((t.args, t.kwargs))
            r_leaves, r_spec = pytree.tree_flatten((r.args, r.kwargs))
            if t.target != r.target or t_spec != r_spec:
                raise _unsupported(f"{what} node {t.name} ({t.target}) of {self.template.fqn} differs from {r.name} ({r.target}) of {self.reference.fqn}")
            for a, b in zip(t_leaves, r_leaves):
                if isinstance(a, torch.fx.Node) != isinstance(b, torch.fx.Node):
                    raise _unsupported(f"{what} nodes {t.name} and {r.name} take different arguments")
                if not isinstance(a, torch.fx.Node):
                    if not equal_values(a, b):
                        raise _unsupported(f"{what} nodes {t.name} and {r.name} take {a!r} and {b!r}")
                    continue
                ca = self._category(a, self.template, self.first, self.r_backward)
                cb = self._category(b, self.reference, self.template, self.last_backward)
                if ca[0] != cb[0] or (ca[0] in ("forward", "backward", "tail", "param", "global") and ca[1] != cb[1]):
                    raise _unsupported(f"{what} node {t.name} of {self.template.fqn} reads {a.name}, {r.name} of {self.reference.fqn} reads {b.name}")
                if ca[0] == "prev":
                    self._learn(self.prev_rule, a, self.t_forward[b], t)
                elif ca[0] == "next":
                    self._learn(self.next_rule, a, b, t)

    @staticmethod
    def _learn(rule: dict, key, value, node):
        if rule.setdefault(key, value) is not value:
            raise _unsupported(f"node {node.name} reads {key.name} of a neighbour in two ways")

    def _check_outside_users(self):
        # Outside the middle blocks, only block 0 reads block 1 (its gradient) and only block 3
        # reads block 2 (its output): the copies nearest to them take those roles.
        for block, neighbour in ((self.template, self.first), (self.reference, self.last)):
            allowed = self.t_nodes | self.r_nodes | set(neighbour.forward) | set(neighbour.backward)
            for node in block.forward + block.backward + block.tail:
                for user in node.users:
                    if user not in allowed and user.op != "output":
                        raise _unsupported(f"{user.name}, outside the blocks, reads {node.name} of {block.fqn}")


class _SeqNumbers:
    """Sequence numbers of the whole model's nodes: each copy of the template its own range,
    forward ops and their backward nodes alike; a gradient accumulation (a number no forward op
    has) a fresh one per copy."""

    def __init__(self, gm, plan: _Plan):
        nodes = gm.graph.nodes
        self.middle = plan.middle
        after = untagged_backward(gm.graph)
        forward = {n.meta["seq_nr"] for n in nodes
                   if n.op == "call_function" and n.meta.get("partitioner_tag") != "is_backward" and n not in after and "seq_nr" in n.meta}
        t = [n.meta["seq_nr"] for n in plan.template.forward if "seq_nr" in n.meta]
        r = [n.meta["seq_nr"] for n in plan.reference.forward if "seq_nr" in n.meta]
        if not t or not r or max(t) >= min(r):
            raise _unsupported("the sequence numbers of the middle blocks do not follow each other")
        span = max(t) - min(t) + 1
        self.t_range, self.r_max, self.width = (min(t), max(t)), max(r), span
        if set(range(min(t), max(r) + 1)) & forward - set(t) - set(r):
            raise _unsupported("an op outside the middle blocks has a sequence number between theirs")
        self.forward_seq = forward
        self.shift = (self.middle - 2) * span  # the copies take middle*span numbers where blocks 1 and 2 took 2*span
        self.next_free = max(forward, default=0) + self.shift + 1
        self.fresh = {}

    def __call__(self, seq, copy: int | None):
        if seq not in self.forward_seq:  # gradient accumulation: a number no forward op has
            key = (copy, seq)
            if key not in self.fresh:
                self.fresh[key] = self.next_free
                self.next_free += 1
            return self.fresh[key]
        low, high = self.t_range
        if low <= seq <= high:
            return seq + (copy - 1) * self.width if copy else seq
        return seq + self.shift if seq > self.r_max else seq


class _Emit:
    """Emits the whole model's graph from a :class:`_Plan`: block 0, the template once per middle
    block, block 3 as the last block, everything outside the blocks as traced."""

    def __init__(self, gm, plan: _Plan):
        self.gm, self.plan, self.seq = gm, plan, _SeqNumbers(gm, plan)

    def graph_module(self) -> torch.fx.GraphModule:
        graph = torch.fx.Graph()
        self.graph, self.env, self.copies = graph, {}, [None] + [{} for _ in range(self.plan.middle)]
        self.numbers = {}  # per name base, the highest number a traced node's name has
        for node in self.gm.graph.nodes:
            base, number = _NAME.match(node.name).groups()
            self.numbers[base] = max(self.numbers.get(base, 0), int(number or 0))
        self.block_placeholders = [None] + [{} for _ in range(self.plan.middle)]
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        t_runs = _runs(placeholders, self.plan.template.placeholders)
        self.primals = 0
        for node in placeholders:
            if node in self.plan.template.placeholders:
                if node in t_runs:
                    for k in range(1, self.plan.middle + 1):
                        for p in t_runs[node]:
                            self.block_placeholders[k][self.plan.template.placeholders[p]] = self._placeholder(p, self.plan.template.fqn, self.plan.blocks[k], fresh=k > 1)
            elif node in self.plan.reference.placeholders:
                continue
            elif node in self.plan.last.placeholders:
                self.env[node] = self._placeholder(node, self.plan.last.fqn, self.plan.blocks[-1])
            else:
                self.env[node] = self._placeholder(node, None, None)
        t_first_forward, t_first_backward = self.plan.template.forward[0], self.plan.template.backward[0]
        t_first_tail = self.plan.template.tail[0] if self.plan.template.tail else None
        for node in self.gm.graph.nodes:
            if node.op in ("placeholder", "output") or node in self.plan.r_nodes:
                continue
            if node is t_first_forward:
                for k in range(1, self.plan.middle + 1):
                    for t in self.plan.template.forward:
                        self._copy(t, k)
            elif node is t_first_backward:
                for k in range(self.plan.middle, 0, -1):
                    for t in self.plan.template.backward:
                        self._copy(t, k)
            elif node is t_first_tail:  # after the whole backward, in block order as AOT appends them
                for k in range(1, self.plan.middle + 1):
                    for t in self.plan.template.tail:
                        self._copy(t, k)
            elif node not in self.plan.t_nodes:
                self._emit_outside(node)
        self._output()
        graph._codegen = self._codegen()
        new = graph_module(self.gm, graph)
        new.meta.update(self.gm.meta)
        return new

    def _placeholder(self, node, old, new, fresh=False):
        name = node.name if node.name.startswith("tangents") else f"primals_{self.primals + 1}"
        if not node.name.startswith("tangents"):
            self.primals += 1
        placeholder = self.graph.placeholder(name)
        placeholder.meta = dict(node.meta)
        if old is not None:
            placeholder.meta["desc"] = _retarget(node.meta.get("desc"), old, new)
        val = node.meta.get("val")
        if fresh and isinstance(val, torch.Tensor) and getattr(val, "fake_mode", None) is not None:
            # A parameter of its own: no storage shared with another block's placeholder.
            with val.fake_mode:
                placeholder.meta["val"] = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device).requires_grad_(val.requires_grad)
        return placeholder

    def _copy(self, node, k: int):
        env = self.copies[k]

        def arg(a):
            if a in env:
                return env[a]
            if a in self.plan.template.placeholders:
                return self.block_placeholders[k][self.plan.template.placeholders[a]]
            if a in self.plan.first_forward:  # the previous block's value
                return self.env[a] if k == 1 else self.copies[k - 1][self.plan.template.forward[self.plan.prev_rule[a]]]
            if a in self.plan.r_backward:  # the next block's gradient
                return self.env[self.plan.next_rule[a]] if k == self.plan.middle else self.copies[k + 1][self.plan.template.backward[self.plan.r_backward[a]]]
            return self.env[a]

        new = self._node_copy(node, arg, node.name if k == 1 else self._fresh_name(node.name))
        self._rename_meta(new, self.plan.template.fqn, self.plan.blocks[k], k)
        env[node] = new

    def _node_copy(self, node, arg, name: str):
        new = self.graph.create_node(node.op, node.target, torch.fx.map_arg(node.args, arg), torch.fx.map_arg(node.kwargs, arg), name, node.type)
        new.meta = dict(node.meta)
        return new

    def _fresh_name(self, name: str) -> str:
        """A name no node has, numbered past every traced one of its base (``mm_3`` -> ``mm_812``).
        Asking the graph to make ``mm_3`` unique instead costs a scan of the taken numbers per
        copy on torch releases before 2.12, quadratic in the depth."""
        base = _NAME.match(name).group(1)
        number = self.numbers.get(base, 0) + 1
        self.numbers[base] = number
        return f"{base}_{number}"

    def _outside_arg(self, a):
        if a in self.plan.t_nodes:
            return self.copies[1][a]
        if a in self.plan.r_forward:
            return self.copies[self.plan.middle][self.plan.template.forward[self.plan.r_forward[a]]]
        if a in self.plan.r_backward:
            return self.copies[self.plan.middle][self.plan.template.backward[self.plan.r_backward[a]]]
        if a in self.plan.r_tail:
            return self.copies[self.plan.middle][self.plan.template.tail[self.plan.r_tail[a]]]
        return self.env[a]

    def _emit_outside(self, node):
        new = self._node_copy(node, self._outside_arg, node.name)
        if node in self.plan.last.forward or node in self.plan.last_backward:
            self._rename_meta(new, self.plan.last.fqn, self.plan.blocks[-1], None)
        elif "seq_nr" in new.meta and node.op == "call_function":
            new.meta["seq_nr"] = self.seq(new.meta["seq_nr"], None)
        self.env[node] = new

    def _rename_meta(self, new, old: str, fqn: str, k: int | None):
        meta = new.meta
        if meta.get(BLOCK_META_KEY) is not None:
            meta[BLOCK_META_KEY] = _rename(meta[BLOCK_META_KEY], old, fqn)
        owner = meta.get(OWNER_META_KEY)
        if owner is not None:  # (module FQN, class, quantized): validation names the module from it
            meta[OWNER_META_KEY] = (_rename(owner[0], old, fqn), *owner[1:])
        provenance = meta.get(PROVENANCE_META_KEY)
        if provenance is not None:
            meta[PROVENANCE_META_KEY] = dataclasses.replace(provenance, module_fqn=_rename(provenance.module_fqn, old, fqn))
        for key in _MODULE_STACK_KEYS:
            if isinstance(meta.get(key), dict):
                meta[key] = {_rename(name, old, fqn): (_rename(path, old, fqn), kind) for name, (path, kind) in meta[key].items()}
        if "seq_nr" in meta:
            meta["seq_nr"] = self.seq(meta["seq_nr"], k)

    def _output(self):
        old = self.gm.graph.find_nodes(op="output")[0]
        flat, spec = pytree.tree_flatten(old.args[0], is_leaf=lambda x: x is None)
        descs = old.meta.get("desc") or [None] * len(flat)
        values, new_descs = [], []
        t_run = []

        def flush():
            for k in range(1, self.plan.middle + 1):
                for value, desc in t_run:
                    values.append(None if value is None else self.copies[k][value])
                    new_descs.append(_retarget(desc, self.plan.template.fqn, self.plan.blocks[k]))
            t_run.clear()

        # The outputs end with one gradient per primal input, in the inputs' order; a gradient
        # that is None (a buffer's) may come without a descriptor: its input's says whose it is.
        primals = [n for n in self.gm.graph.find_nodes(op="placeholder") if not n.name.startswith("tangents")]
        first_gradient = len(flat) - len(primals)
        for position, (value, desc) in enumerate(zip(flat, descs)):
            target = _desc_target(desc)
            if target is None and value is None and 0 <= first_gradient <= position:
                target = _desc_target(primals[position - first_gradient].meta.get("desc"))
            if target and _inside(target, self.plan.template.fqn):
                t_run.append((value, desc))
                continue
            flush()
            if target and _inside(target, self.plan.reference.fqn):
                continue
            if value is not None and (value in self.plan.t_nodes or value in self.plan.r_nodes):
                raise _unsupported(f"the graph returns {value.name} of {self.plan.template.fqn if value in self.plan.t_nodes else self.plan.reference.fqn}, which is no gradient of its parameters")
            values.append(None if value is None else self._outside_arg(value))
            new_descs.append(_retarget(desc, self.plan.last.fqn, self.plan.blocks[-1]) if target and _inside(target, self.plan.last.fqn) else desc)
        flush()
        output = self.graph.output(values)
        output.meta = dict(old.meta)
        output.meta["desc"] = new_descs
        self.out_flat = values

    def _codegen(self):
        from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo

        info = self.gm.graph._codegen.pytree_info
        placeholders = self.graph.find_nodes(op="placeholder")
        tangents = sum(p.name.startswith("tangents") for p in placeholders)
        in_spec = pytree.tree_structure(([0] * (len(placeholders) - tangents), [0] * tangents))
        # The outputs are (forward outputs, gradients): the forward part is as traced, the rest grew.
        children = info.out_spec.children_specs
        if len(children) != 2 or info.in_spec.num_children != 2:
            raise _unsupported("the traced graph's calling convention is not (primals, tangents) -> (outputs, gradients)")
        forward = children[0].num_leaves
        out_spec = pytree.tree_structure((tuple([0] * forward), tuple([0] * (len(self.out_flat) - forward))))
        return _PyTreeCodeGen(_PyTreeInfo(info.orig_args, in_spec, out_spec))


def _runs(nodes: list, members: dict) -> dict:
    """Maximal runs of consecutive ``nodes`` that are in ``members``, keyed by their first node."""
    runs, current = {}, None
    for node in nodes:
        if node in members:
            if current is None:
                current = [node]
                runs[node] = current
            else:
                current.append(node)
        else:
            current = None
    return runs
