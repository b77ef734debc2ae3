"""Mutant backends whose post-trace rewrite (capability ``rewrites``) breaks the traced step.

Each is the worked example backend (``docs/examples/trainer_backend.py``, whose rewrite fuses a
weight used twice's summed gradients into its own scaled add-matmul and moves the backward's
``torch._scaled_mm`` onto the second API) with one defect a graph trainer's pass
ships by accident. Every property runs on the rewritten
graph; the RWR property named by ``KILLED_BY`` compares it with the graph as traced.
"""

from __future__ import annotations

import torch
import trainer_backend  # docs/examples, on sys.path for fp8conf's tests

import fp8conf

__all__ = [
    "MUTANTS", "RewriteDropsNodeMeta", "RewriteReadsAScaleTwice", "RewriteFeedsWeightGradIntoInputGrad", "RewriteReordersInputs",
    "FusionDropsTheAccumulator", "FusionIntoTheEarlierCall",
]

_V2 = torch.ops.aten._scaled_mm_v2.default


def _finish(gm):
    gm.graph.lint()
    gm.recompile()
    return gm


class RewriteDropsNodeMeta(trainer_backend.TrainerBackend):
    """Its API rewrite builds each new matmul with its value alone, not the old node's metadata."""

    name = "mutant-rewrite-drops-node-meta"
    KILLED_BY = "RWR-001"

    def rewrite(self, gm):
        gm = super().rewrite(gm)
        for node in gm.graph.find_nodes(op="call_function", target=_V2):
            node.meta = {"val": node.meta["val"]}
        return gm


class RewriteReadsAScaleTwice(trainer_backend.TrainerBackend):
    """Its API rewrite multiplies the backward matmuls' first scale in once more."""

    name = "mutant-rewrite-reads-a-scale-twice"
    KILLED_BY = "RWR-004"

    def rewrite(self, gm):
        gm = super().rewrite(gm)
        for node in [n for n in gm.graph.find_nodes(op="call_function", target=_V2) if self.is_backward(n)]:
            (scale,) = node.args[2]
            with gm.graph.inserting_before(node):
                twice = gm.graph.call_function(torch.ops.aten.mul.Tensor, (scale, scale))
            twice.meta.update(scale.meta)
            node.args = (node.args[0], node.args[1], [twice], *node.args[3:])
        return _finish(gm)


class RewriteFeedsWeightGradIntoInputGrad(trainer_backend.TrainerBackend):
    """Its rewrite adds every weight gradient, times zero, to the input gradient (a fused
    epilogue that reads both): the values stay, and no split can leave dW work for later."""

    name = "mutant-rewrite-feeds-weight-grad-into-input-grad"
    KILLED_BY = "RWR-002"

    def rewrite(self, gm):
        gm = super().rewrite(gm)
        signature = fp8conf.joint_signature(gm)
        output = gm.graph.find_nodes(op="output")[0]
        flat = list(output.args[0])
        weight_grads = [flat[i] for i, o in enumerate(signature.outputs) if o is not None and o.kind == "param_grad" and flat[i] is not None]
        inputs = [i for i, o in enumerate(signature.outputs) if o is not None and o.kind == "input_grad" and flat[i] is not None]
        if not weight_grads or not inputs:
            return gm
        i = inputs[0]
        with gm.graph.inserting_before(output):
            total = flat[i]
            for grad in weight_grads:
                zero = gm.graph.call_function(torch.ops.aten.mul.Tensor, (gm.graph.call_function(torch.ops.aten.sum.default, (grad,)), 0.0))
                total = gm.graph.call_function(torch.ops.aten.add.Tensor, (total, zero))
                for made in (zero.args[0], zero, total):
                    made.meta.update({k: v for k, v in flat[i].meta.items() if k != "val"})
                with flat[i].meta["val"].fake_mode:
                    zero.args[0].meta["val"] = grad.meta["val"].sum()
                    zero.meta["val"] = zero.args[0].meta["val"] * 0.0
                    total.meta["val"] = flat[i].meta["val"] + zero.meta["val"]
        flat[i] = total
        output.args = (tuple(flat),) if isinstance(output.args[0], tuple) else (flat,)
        return _finish(gm)


class RewriteReordersInputs(trainer_backend.TrainerBackend):
    """Its rewrite rebuilds the graph with the inputs in name order, as a pass that regenerates a
    graph from a dict of its nodes does."""

    name = "mutant-rewrite-reorders-inputs"
    KILLED_BY = "RWR-003"

    def rewrite(self, gm):
        gm = super().rewrite(gm)
        placeholders = list(gm.graph.find_nodes(op="placeholder"))
        first = next(iter(gm.graph.nodes))
        for node in sorted(placeholders, key=lambda n: n.name, reverse=True):
            first.prepend(node)
            first = node
        return _finish(gm)


class FusionDropsTheAccumulator(trainer_backend.TrainerBackend):
    """Its weight-gradient fusion adds the second gradient to zeros, not to the first: a weight
    used twice gets the gradient of its second use only."""

    name = "mutant-fusion-drops-the-accumulator"
    KILLED_BY = "RWR-004"

    def rewrite(self, gm):
        gm = super().rewrite(gm)
        for node in gm.graph.find_nodes(op="call_function", target=torch.ops.trainer_example.scaled_addmm.default):
            acc = node.args[0]
            with gm.graph.inserting_before(node):
                zeros = gm.graph.call_function(torch.ops.aten.zeros_like.default, (acc,))
            zeros.meta.update(acc.meta)
            node.args = (zeros, *node.args[1:])
        return _finish(gm)


class FusionIntoTheEarlierCall(trainer_backend.TrainerBackend):
    """Its weight-gradient fusion fuses the earlier of the two matmuls: the fused node, issued by
    the module's first call, then reads the second call's gradient, computed after the first
    call's backward began, and its region is no longer convex."""

    name = "mutant-fusion-into-the-earlier-call"
    KILLED_BY = "REG-003"

    def rewrite(self, gm):
        return trainer_backend.to_second_api(trainer_backend.fuse_accumulations(gm, lambda earlier, later: (later, earlier)))


MUTANTS = [RewriteDropsNodeMeta, RewriteReadsAScaleTwice, RewriteFeedsWeightGradIntoInputGrad, RewriteReordersInputs,
           FusionDropsTheAccumulator, FusionIntoTheEarlierCall]
