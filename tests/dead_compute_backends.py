"""Backends that drop dead FP8 compute, or keep only what the spec lets a graph keep: each must
pass the VAL and BND rules (tests/test_dead_compute.py; SPEC.md, "Counting what the outputs need").

The makefx ones are shown TorchAO's float8 linears (they do not claim ``float8_modules``): TorchAO
scales a rowwise matmul's result in place, so a first layer's grad_input FP8 matmul, which no
input gradient needs, stays in their traced graphs, kept by that in-place op.
"""

from __future__ import annotations

import collections
import dataclasses

import torch

from conformance.backends import makefx_stages, makefx_trainer
from conformance.backends.makefx import MakeFxBackend
from conformance.backends.reference import ReferenceBackend
from conformance.observe.graphs import output_dependencies

__all__ = [
    "ReferenceEliminatingDeadCode", "MakeFxCountingWhatOutputsNeed", "MakeFxSplitWithoutDeadCode", "MakeFxWithoutDeadCode",
    "remove_what_no_output_needs",
]


def remove_what_no_output_needs(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Erase every call_function node of ``gm`` that no output needs, in-place ops on values
    nothing reads and what they read included (stricter than torch's dead-code elimination,
    which keeps every mutating op); returns the FP8 matmuls it erased, with their meta intact."""
    needed = output_dependencies(gm)
    dead = [n for n in reversed(list(gm.graph.nodes)) if n.op == "call_function" and n not in needed]
    removed = [(n, makefx_trainer.module_provenance(n), makefx_trainer.phase_of(n)) for n in dead if makefx_trainer.is_fp8_matmul(n)]
    for node in dead:  # users before what they read
        gm.graph.erase_node(node)
    gm.recompile()
    return removed


def _expecting_less(gm: torch.fx.GraphModule, removed) -> None:
    """The trainer's own expectation of ``gm`` without the FP8 matmuls ``removed`` from it (or
    from a sibling callable): they no longer run, so its check no longer asks for them."""
    step = gm.meta[makefx_trainer.STEP_KEY]
    expected = collections.Counter(step.expected_fp8_matmuls)
    for _, found, phase in removed:
        if found is not None and not found[2]:
            expected[(found[0], phase)] -= 1
    gm.meta[makefx_trainer.STEP_KEY] = dataclasses.replace(step, expected_fp8_matmuls=dict(expected))


class ReferenceEliminatingDeadCode(ReferenceBackend):
    """The reference, its traced graph and every callable of its splits pruned by torch's own
    dead-code elimination (which keeps impure nodes)."""

    name = "reference-eliminating-dead-code"

    def trace_joint(self, model, args):
        gm = super().trace_joint(model, args)
        gm.graph.eliminate_dead_code()
        gm.recompile()
        return gm

    def split_stage(self, gm, *, strict=True):
        split = super().split_stage(gm, strict=strict)
        for part in split.parts.values():
            part.graph.eliminate_dead_code()
            part.recompile()
        return split


class MakeFxCountingWhatOutputsNeed(MakeFxBackend):
    """A make_fx trainer whose reported counts leave out the FP8 matmuls its graph keeps only for
    an in-place op (a first rowwise layer's grad_input): it counts what the outputs need."""

    name = "makefx-counting-what-outputs-need"
    capabilities = MakeFxBackend.capabilities - {"float8_modules"}

    def validate(self, gm, *, strict):
        report = super().validate(gm, strict=strict)
        counts = collections.Counter(report.compute_counts)
        needed = output_dependencies(gm)
        for node in gm.graph.nodes:
            found = makefx_trainer.module_provenance(node)
            if node not in needed and makefx_trainer.is_fp8_matmul(node) and found is not None:
                counts[(found[0], makefx_trainer.phase_of(node))] -= 1
        return dataclasses.replace(report, compute_counts=dict(counts))


class MakeFxSplitWithoutDeadCode(MakeFxBackend):
    """A make_fx trainer whose traced graph keeps the grad_input matmul TorchAO scales in place
    (its check counts it) and whose partitioner drops it: each callable holds only what its
    outputs need."""

    name = "makefx-split-without-dead-code"
    capabilities = MakeFxBackend.capabilities - {"float8_modules"}

    def split_stage(self, gm, *, strict=True):
        split = super().split_stage(gm, strict=strict)
        parts = split.parts
        removed = [found for part in parts.values() for found in remove_what_no_output_needs(part)]
        for part in parts.values():
            _expecting_less(part, removed)
        makefx_stages._record_siblings(parts)  # each callable is owed what its siblings now hold
        return split


class MakeFxWithoutDeadCode(MakeFxSplitWithoutDeadCode):
    """A make_fx trainer that removes from its traced graph, and from its callables, everything no
    output needs: the in-place scaling of an unneeded grad_input and that matmul too."""

    name = "makefx-without-dead-code"

    def trace_joint(self, model, args):
        gm = super().trace_joint(model, args)
        _expecting_less(gm, remove_what_no_output_needs(gm))
        return gm
