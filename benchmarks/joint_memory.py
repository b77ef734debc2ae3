"""Memory of a joint forward+backward graph run node by node, from its fake tensors alone.

Running a joint graph eagerly (``fp8conf.run_joint`` without ``fn``) executes its nodes in order
and drops every value after its last use (``torch.fx`` code generation frees dead names), so the
graph's order and its fake tensors (``node.meta["val"]``) fix what is allocated when. Values
are counted by storage: a view costs nothing beyond the storage it aliases, and a storage lives
from the node that creates it to the last use of any value aliasing it (graph outputs: to the
end). Placeholders (parameters, inputs, tangents) belong to the caller and are left out.

* ``peak``: the most bytes live at once, a node's outputs counted with its inputs;
* ``saved``: the bytes created by forward nodes (``partitioner_tag``) still live when the first
  backward node runs, outputs of the step excluded: what the step keeps for its backward.

Kernel workspaces and the allocator's rounding are not seen, so a GPU's measured peak is
somewhat higher; the figures compare graphs of the same model, not devices.

:func:`measured_cpu_peak` measures instead: the most bytes a callable's CPU allocations hold at
once, from the profiler's memory events, for runs whose memory the graph does not describe
(autograd's saved tensors).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["JointMemory", "joint_memory", "measured_cpu_peak"]


@dataclasses.dataclass
class _Storage:
    nbytes: int
    created: int  # position of the node that made it
    last_use: int  # position of the last node that reads a value aliasing it
    node: torch.fx.Node  # the node that made it
    is_output: bool = False


@dataclasses.dataclass(frozen=True)
class JointMemory:
    """What one joint graph allocates (see the module docstring)."""

    peak_bytes: int
    peak_node: str
    saved_bytes: int
    #: ``(bytes, description)`` of every saved storage, largest first.
    saved: tuple[tuple[int, str], ...]
    #: ``(bytes, description)`` of the storages live at the peak, largest first.
    at_peak: tuple[tuple[int, str], ...]


def _tensors(value) -> list[torch.Tensor]:
    return [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]


def _describe(node: torch.fx.Node) -> str:
    val = _tensors(node.meta.get("val"))
    shape = f"{val[0].dtype} {tuple(val[0].shape)}".replace("torch.", "") if val else ""
    target = getattr(node.target, "__name__", str(node.target))
    return f"{target} {shape} ({node.name})"


def _storages(gm: torch.fx.GraphModule) -> tuple[dict, list[torch.fx.Node]]:
    nodes = list(gm.graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    storages: dict[StorageWeakRef, _Storage] = {}
    keys_of: dict[torch.fx.Node, list[StorageWeakRef]] = {}
    for i, node in enumerate(nodes):
        keys = []
        for t in _tensors(node.meta.get("val")):
            key = StorageWeakRef(t.untyped_storage())
            keys.append(key)
            if key not in storages:
                storages[key] = _Storage(t.untyped_storage().nbytes(), i, i, node)
        keys_of[node] = keys
        if node.op == "output":
            for arg in pytree.tree_leaves(node.args):
                for key in keys_of.get(arg, []) if isinstance(arg, torch.fx.Node) else []:
                    storages[key].is_output = True
    for node in nodes:
        last = max((position[user] for user in node.users), default=position[node])
        for key in keys_of[node]:
            storages[key].last_use = max(storages[key].last_use, last)
    return storages, nodes


def joint_memory(gm: torch.fx.GraphModule) -> JointMemory:
    """Peak live and saved bytes of ``gm`` (a joint graph with fake tensors in its meta)."""
    storages, nodes = _storages(gm)
    owned = [s for s in storages.values() if s.node.op != "placeholder"]
    boundary = next(
        i for i, node in enumerate(nodes) if node.op == "call_function" and node.meta.get("partitioner_tag") == "is_backward"
    )
    saved = sorted(
        ((s.nbytes, _describe(s.node)) for s in owned if s.created < boundary <= s.last_use and not s.is_output), reverse=True
    )
    deltas = [0] * (len(nodes) + 1)
    for s in owned:
        deltas[s.created] += s.nbytes
        deltas[s.last_use + 1] -= s.nbytes  # freed once the node that last reads it has run
    live, peak, peak_at = 0, 0, 0
    for i in range(len(nodes)):
        live += deltas[i]
        if live > peak:
            peak, peak_at = live, i
    at_peak = sorted(((s.nbytes, _describe(s.node)) for s in owned if s.created <= peak_at <= s.last_use), reverse=True)
    return JointMemory(peak, _describe(nodes[peak_at]), sum(b for b, _ in saved), tuple(saved), tuple(at_peak))


def measured_cpu_peak(fn) -> int:
    """Peak bytes allocated on the CPU while ``fn()`` runs, above what was allocated before."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak
