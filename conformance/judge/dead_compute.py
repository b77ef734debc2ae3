"""Which FP8 compute counts, and which is dead (SPEC.md, "Counting what the outputs need").

FP8 compute counts when its result reaches an output of its graph: an in-place user whose result
reaches nothing does not make it count. A ``torch.fx.GraphModule`` executes every node of its
code, needed or not, until a pass removes it; so FP8 compute that no output needs and that a
graph (or a GraphPP callable) still holds runs for nothing. A backend may remove it anywhere. The
one kind a graph may keep is what the recipe computes though the step does not need it, kept only
for a side effect: a ``make_fx`` graph's first-layer grad_input matmul that TorchAO scales in
place, at most one per call whose input needs no gradient (:func:`compute_truth`). Anything else
(a copy a rewrite or a split left behind, pure or kept by an in-place op) is a defect.

* :func:`needed_fp8_compute` / :func:`dead_fp8_compute`: a graph's FP8 compute, by whether some
  output of the graph depends on it;
* :func:`keepable_dead_compute`: the dead FP8 compute the allowance may cover, judged on the
  graph alone (callables of a split included);
* :func:`compute_truth`: the counts a traced graph must hold per ``(module, pass)``, what it
  keeps within the allowance, and the dead FP8 compute beyond it.
"""

from __future__ import annotations

import collections
import dataclasses

import torch
import torch.fx

from conformance.observe.graphs import Fp8Ops, Oracle, fp8_compute_nodes, output_dependencies, run_for_side_effects_only

__all__ = [
    "needed_fp8_compute", "dead_fp8_compute", "keepable_dead_compute", "unneeded_grad_inputs", "ComputeTruth", "compute_truth",
]


def needed_fp8_compute(gm: torch.fx.GraphModule, ops: Fp8Ops) -> list[torch.fx.Node]:
    """The FP8 compute of ``gm`` whose result reaches an output of ``gm``: what counts."""
    needed = output_dependencies(gm)
    return [n for n in fp8_compute_nodes(gm, ops) if n in needed]


def dead_fp8_compute(gm: torch.fx.GraphModule, ops: Fp8Ops) -> list[torch.fx.Node]:
    """The FP8 compute of ``gm`` that no output of ``gm`` needs, which ``gm``'s code still runs."""
    needed = output_dependencies(gm)
    return [n for n in fp8_compute_nodes(gm, ops) if n not in needed]


def keepable_dead_compute(gm: torch.fx.GraphModule, ops: Fp8Ops) -> list[torch.fx.Node]:
    """The dead FP8 compute of ``gm`` that the allowance may cover: kept only for a side effect
    (an in-place op on its result, which nothing reads) and computing what no other FP8 compute
    node of ``gm`` computes. A copy of a needed matmul is never covered, kept in place or not."""
    computes = fp8_compute_nodes(gm, ops)
    repeated = collections.Counter(_computation(n) for n in computes)
    side_effects_only = run_for_side_effects_only(gm)
    return [n for n in dead_fp8_compute(gm, ops) if n in side_effects_only and repeated[_computation(n)] == 1]


def _computation(node: torch.fx.Node) -> tuple:
    # The same op on the same arguments computes the same value: a node's name stands for its value.
    return node.target, repr(node.args), repr(node.kwargs)


def unneeded_grad_inputs(spec) -> dict[tuple[str, str], int]:
    """Per ``(fqn, "backward")``: the calls of a real quantized module whose input needs no
    gradient, each a grad_input matmul the recipe computes though the step does not need it."""
    found: dict = {}
    configs = spec.quantized_modules()
    for fqn, input_grad in spec.calls():
        if not input_grad and not configs[fqn][2]:
            found[(fqn, "backward")] = found.get((fqn, "backward"), 0) + 1
    return found


@dataclasses.dataclass(frozen=True)
class ComputeTruth:
    """The suite's count of a traced graph's FP8 compute per ``(fqn, pass)``."""

    #: The recipe's count for what the step needs (``spec.expected_compute_counts()``).
    needed: dict
    #: FP8 compute no output needs that the graph keeps within the allowance (a grad_input the
    #: step does not need, kept for an in-place op): a count may include it or leave it out.
    kept: dict
    #: ``(node, key)`` of every FP8 compute node no output needs beyond the allowance: it runs
    #: for nothing, and the graph holding it fails.
    dead: tuple

    def admits(self, key, count: int) -> bool:
        """Whether ``count`` FP8 compute for ``key`` is the truth: the recipe's, to which the
        graph's kept FP8 compute may be added."""
        low = self.needed.get(key, 0)
        return low <= count <= low + self.kept.get(key, 0)

    def admitted_counts(self) -> str:
        """The counts admitted per key, for a failure message."""
        keys = sorted(set(self.needed) | set(self.kept), key=str)
        return ", ".join(
            f"{key}: {self.needed.get(key, 0)}" + (f" or up to {self.needed.get(key, 0) + self.kept[key]}" if self.kept.get(key) else "")
            for key in keys
        )


def compute_truth(spec, gm: torch.fx.GraphModule, oracle: Oracle, ops: Fp8Ops, pass_of) -> ComputeTruth:
    """The FP8 compute ``gm`` must hold per ``(fqn, pass)`` (the recipe's count for what the step
    needs), what it keeps within the allowance and the dead FP8 compute beyond it; nodes are
    attributed by the suite's ``oracle``, never by the backend's provenance, and to a pass by
    ``pass_of(node)``. Only a dead node :func:`keepable_dead_compute` admits, in the backward
    pass, counts against the allowance: one per call whose input needs no gradient."""
    allowance = unneeded_grad_inputs(spec)
    keepable = set(keepable_dead_compute(gm, ops))
    kept: dict = {}
    dead = []
    for node in dead_fp8_compute(gm, ops):
        key = (oracle.issued_by.get(node), pass_of(node))
        if node in keepable and kept.get(key, 0) < allowance.get(key, 0):
            kept[key] = kept.get(key, 0) + 1
        else:
            dead.append((node, key))
    return ComputeTruth(dict(spec.expected_compute_counts()), kept, tuple(dead))
