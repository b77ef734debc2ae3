"""Mutant backends for MOE: the reference with one defect each in how it treats FP8 grouped experts.

MOE-008 (compiled MoE graphs on an sm90 GPU) has its mutant in :data:`GPU_MUTANTS`, run with the
GPU suite (``--fp8-device=cuda``), since CPU machines skip the property.
"""

from __future__ import annotations

import dataclasses

import torch

import fp8conf.graph.regions
import fp8conf.graph.validate
import fp8conf.quantized.protocol
import fp8conf.quantized.grouped as grouped
from conformance.judge import rewrites
from conformance.api.types import Compiled, Provenance
from conformance.backends.reference import ReferenceBackend
from mutants.backends import _replaced
from mutants.graphpp import WeightWorkInInput


class GroupedLabelledAsLinear(ReferenceBackend):
    """Knows only linears: the experts' provenance says ``float8_linear``."""

    name = "mutant-grouped-labelled-as-linear"
    KILLED_BY = "MOE-001"

    def provenance(self, node):
        found = super().provenance(node)
        if found is None or found.kind != grouped.GROUPED_KIND:
            return found
        return Provenance(found.module_fqn, "float8_linear", found.recipe, found.emulate)


class GroupedGradWeightAssumedHighPrecision(ReferenceBackend):
    """Treats grouped experts like ``rowwise_with_gw_hp`` linears: no FP8 grad_weight expected."""

    name = "mutant-grouped-grad-weight-assumed-high-precision"
    KILLED_BY = "MOE-002"

    def trace_joint(self, model, args):
        original = fp8conf.quantized.protocol.quantization_config_of

        def config_of(module):
            config = original(module)
            if config is not None and config.kind == grouped.GROUPED_KIND:
                return dataclasses.replace(config, fp8_grad_weight=False)
            return config

        with _replaced(fp8conf.quantized.protocol, "quantization_config_of", config_of):
            return super().trace_joint(model, args)


class GroupedExemptFromLoweringCheck(ReferenceBackend):
    """Counts grouped GEMMs but checks only linears for lost FP8 compute."""

    name = "mutant-grouped-exempt-from-lowering-check"
    KILLED_BY = "MOE-003"

    def validate(self, gm, *, strict):
        original = fp8conf.graph.validate._expected

        def expected(config, call):
            return {} if config.kind == grouped.GROUPED_KIND else original(config, call)

        with _replaced(fp8conf.graph.validate, "_expected", expected):
            return super().validate(gm, strict=strict)


class NoGroupedRegions(ReferenceBackend):
    """The seed's limitation: regional compilation leaves grouped experts out (no region, no tag)."""

    name = "mutant-no-grouped-regions"
    KILLED_BY = "MOE-004"

    def regions(self, gm):
        def is_linear_compute(node):
            found = fp8conf.get_provenance(node)
            return fp8conf.is_fp8_compute(node) and (found is None or found.kind != grouped.GROUPED_KIND)

        with _replaced(fp8conf.graph.regions, "is_fp8_compute", is_linear_compute):
            return super().regions(gm)


class GroupedWeightWorkInInput(WeightWorkInInput):
    """Finishes the experts' grad_weight grouped GEMMs in dI and hands dW the results."""

    name = "mutant-grouped-weight-work-in-input"
    KILLED_BY = "MOE-005"


def _shared_column_scales(x, groups, num_groups):
    # One scale per column over every token, repeated for each group: the dense rowwise choice.
    data, scale = grouped.to_float8_rowwise(x, dim=0)
    return data, scale.expand(num_groups, -1).contiguous()


class SharedGroupScales(ReferenceBackend):
    """Quantizes the grad_weight operands per column over all tokens, not per token group."""

    name = "mutant-shared-group-scales"
    KILLED_BY = "MOE-006"

    def trace_joint(self, model, args):
        with _replaced(grouped, "to_float8_per_group", _shared_column_scales):
            return super().trace_joint(model, args)


class NoAmaxFloor(ReferenceBackend):
    """Divides by the raw amax: an all-zero row gets an infinite scale, and 0 * inf is NaN."""

    name = "mutant-no-amax-floor"
    KILLED_BY = "MOE-007"

    def trace_joint(self, model, args):
        with _replaced(grouped, "_AMAX_EPS", 0.0):
            return super().trace_joint(model, args)


class RegionalCompileDropsGroupedScales(ReferenceBackend):
    """Compiles MoE graphs with the token scales of every FP8 grouped GEMM replaced by ones."""

    name = "mutant-regional-compile-drops-grouped-scales"
    KILLED_BY = "MOE-008"

    def compile(self, gm, *, mode, cudagraph=False):
        changed = fp8conf.copy_graph_module(gm)
        for node in list(changed.graph.nodes):
            if fp8conf.is_fp8_compute(node) and "grouped" in str(node.target):
                ones = rewrites._insert(changed.graph, node, node.args[2], torch.ops.aten.ones_like.default, node.args[2])
                node.args = (*node.args[:2], ones, *node.args[3:])
        changed.recompile()
        compiled = fp8conf.compile_joint(changed, mode=mode, strict=False, cudagraph=cudagraph)
        return Compiled(compiled, compiled.compiled_nodes, compiled.eager_nodes)


class V2SharedGroupScales(ReferenceBackend):
    """``SharedGroupScales`` only in experts on ``F.scaled_grouped_mm``: a port of the second API
    that took the dense rowwise scale choice with it. Experts on the first API, and emulated ones
    (what MOE-006 runs where the device runs no FP8 grouped GEMM), are right."""

    name = "mutant-v2-shared-group-scales"
    KILLED_BY = "MOE-006"

    def trace_joint(self, model, args):
        if not any(isinstance(m, grouped.Float8GroupedExperts) and m.v2 for m in model.modules()):
            return super().trace_joint(model, args)
        with _replaced(grouped, "to_float8_per_group", _shared_column_scales):
            return super().trace_joint(model, args)


MUTANTS = [
    GroupedLabelledAsLinear,
    GroupedGradWeightAssumedHighPrecision,
    GroupedExemptFromLoweringCheck,
    NoGroupedRegions,
    GroupedWeightWorkInInput,
    SharedGroupScales,
    NoAmaxFloor,
]
#: Caught only on an sm90 GPU: where MOE-008 runs, and where MOE-006 runs experts on the second
#: grouped API.
GPU_MUTANTS = [RegionalCompileDropsGroupedScales, V2SharedGroupScales]
