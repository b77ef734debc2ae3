"""Mutant backends for BND: the reference with one defect each in the GraphPP split.

Three of them make dW compute again some nodes of dI instead of receiving their values: they
swap fp8conf's own step that picks dW's nodes while their split runs (no torch code is patched).
"""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

from conformance.backends.reference import ReferenceBackend
from conformance.api.types import Region
from fp8conf.graph import split as graphpp
from fp8conf.graph.provenance import PROVENANCE_META_KEY, get_provenance
from fp8conf.graph.regions import identify_fp8_regions, tag_fp8_regions
from fp8conf.graph.roles import is_fp8_compute, is_fp8_dtype
from fp8conf.graph.validate import SIBLING_COMPUTE_META_KEY, validate_fp8_graph


def _fp8(node) -> bool:
    return is_fp8_dtype(getattr(node.meta.get("val"), "dtype", None))


def _used_by_weight(d_i, d_w):
    return {i for n in d_w for i in n.all_input_nodes if i in d_i}


def _requantize_chains(d_i, d_w):
    # Every FP8 value dW takes from dI, made again in dW from its high-precision source: the
    # whole chain of the issuing module (amax, scale, cast, views).
    chains = set()
    for value in _used_by_weight(d_i, d_w):
        if not _fp8(value):
            continue
        provenance, stack = get_provenance(value), [value]
        while stack:
            node = stack.pop()
            if node in chains:
                continue
            chains.add(node)
            stack.extend(i for i in node.all_input_nodes if i in d_i and get_provenance(i) == provenance)
    return chains


def _casts_only(d_i, d_w):
    # The FP8 values dW takes from dI, cast again in dW from the scaled high-precision value
    # (the scale itself still crosses): the cast is duplicated across the cut.
    recast = set()
    for value in _used_by_weight(d_i, d_w):
        node = value
        while node in d_i and _fp8(node):
            recast.add(node)
            if all(_fp8(i) is False for i in node.all_input_nodes):
                break  # the cast itself
            node = next(i for i in node.all_input_nodes if _fp8(i))
    return recast


def _matmuls_recomputed(d_i, d_w):
    # dW computes again the dI results it needs that come out of an FP8 matmul.
    again = set()
    for value in _used_by_weight(d_i, d_w):
        path, stack = set(), [value]
        while stack:
            node = stack.pop()
            if node in path or node not in d_i:
                continue
            path.add(node)
            if is_fp8_compute(node):
                again.add(node)
                continue
            stack.extend(node.all_input_nodes)
        if any(is_fp8_compute(n) for n in path):
            again |= {n for n in path if _between(n, again)}
    return again


def _between(node, computes) -> bool:
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        if current in computes:
            return True
        if current not in seen:
            seen.add(current)
            stack.extend(current.all_input_nodes)
    return False


class _Recomputing(ReferenceBackend):
    recompute = staticmethod(lambda d_i, d_w: set())

    def split_stage(self, gm, *, strict=True):
        def weight_nodes(d_i, needed):
            d_w = needed - d_i
            return d_w | self.recompute(d_i, d_w)

        with mock.patch.object(graphpp, "_weight_nodes", weight_nodes):
            return super().split_stage(gm, strict=strict)


class WeightRequantizes(_Recomputing):
    """dW re-quantizes the gradient it shares with dI from high precision."""

    name = "mutant-weight-requantizes"
    KILLED_BY = "BND-003"
    recompute = staticmethod(_requantize_chains)


class CastDuplicatedAcrossCut(_Recomputing):
    """dW repeats the cast of a value dI already quantized (from the crossed scale)."""

    name = "mutant-cast-duplicated-across-cut"
    KILLED_BY = "BND-003"
    recompute = staticmethod(_casts_only)


class ComputeDuplicated(_Recomputing):
    """dW runs again the FP8 matmuls of dI whose results it needs."""

    name = "mutant-compute-duplicated"
    KILLED_BY = "BND-002"
    recompute = staticmethod(_matmuls_recomputed)


class ProvenanceLostInSplit(ReferenceBackend):
    """Builds backward_weight from nodes whose provenance was not copied."""

    name = "mutant-provenance-lost-in-split"
    KILLED_BY = "BND-005"

    def split_stage(self, gm, *, strict=True):
        split = super().split_stage(gm, strict=strict)
        for node in split.backward_weight.graph.nodes:
            node.meta.pop(PROVENANCE_META_KEY, None)
        return split


class ProvenanceSwappedInSplit(ReferenceBackend):
    """Hands the provenance of backward_weight's FP8 matmuls round by one: each module's count
    stays the same, but nodes name the wrong module."""

    name = "mutant-provenance-swapped-in-split"
    KILLED_BY = "BND-005"

    def split_stage(self, gm, *, strict=True):
        split = super().split_stage(gm, strict=strict)
        computes = [n for n in split.backward_weight.graph.nodes if is_fp8_compute(n) and PROVENANCE_META_KEY in n.meta]
        provenances = [n.meta[PROVENANCE_META_KEY] for n in computes]
        for node, provenance in zip(computes, provenances[1:] + provenances[:1]):
            node.meta[PROVENANCE_META_KEY] = provenance
        return split


class PlaceholderBoundaryIncomplete(ReferenceBackend):
    """Treats an FP8 placeholder as a broken chain: regions starting there are never tagged."""

    name = "mutant-placeholder-boundary-incomplete"
    KILLED_BY = "BND-004"

    def regions(self, gm):
        found = []
        for region in identify_fp8_regions(gm):
            members = set(region.nodes)
            enters_fp8 = any(i.op == "placeholder" and _fp8(i) for n in members for i in n.all_input_nodes)
            if enters_fp8:
                region = dataclasses.replace(region, complete=False, reason="an FP8 value enters from a placeholder")
            found.append(region)
        tag_fp8_regions(gm, found, strict=False)
        return [Region(r.id, r.nodes, r.complete, r.complete) for r in found]


class CallablesRevalidatedStrictly(ReferenceBackend):
    """Validates each callable strictly as if it were a whole stage."""

    name = "mutant-callables-revalidated-strictly"
    KILLED_BY = "BND-006"

    def split_stage(self, gm, *, strict=True):
        split = super().split_stage(gm, strict=strict)
        for part in split.parts.values():
            alone = dict(part.meta)
            alone.pop(SIBLING_COMPUTE_META_KEY, None)
            with _meta_replaced(part, alone):
                validate_fp8_graph(part, strict=True)
        return split


class SplitSkipsStrictValidation(ReferenceBackend):
    """Cuts the stage without validating it strictly first."""

    name = "mutant-split-skips-strict-validation"
    KILLED_BY = "BND-006"

    def split_stage(self, gm, *, strict=True):
        return super().split_stage(gm, strict=False)


@contextlib.contextmanager
def _meta_replaced(gm, meta):
    saved = dict(gm.meta)
    gm.meta.clear()
    gm.meta.update(meta)
    try:
        yield
    finally:
        gm.meta.clear()
        gm.meta.update(saved)


class ParamGradsOutOfOrder(ReferenceBackend):
    """Describes the parameter gradients in reverse order."""

    name = "mutant-param-grads-out-of-order"
    KILLED_BY = "BND-001"

    def split_stage(self, gm, *, strict=True):
        split = super().split_stage(gm, strict=strict)
        n = len(split.param_grads)
        layout = tuple(
            (kind, n - 1 - i) if kind == "param_grad" else (kind, i) for kind, i in (s for s in split.output_layout if s is not None)
        )
        slots = iter(layout)
        return dataclasses.replace(split, output_layout=tuple(None if s is None else next(slots) for s in split.output_layout))


class WeightWorkInInput(ReferenceBackend):
    """Does all backward work in dI and passes the finished parameter gradients through dW:
    bitwise right, and no weight-gradient work left for the schedule to defer."""

    name = "mutant-weight-work-in-input"
    KILLED_BY = "BND-007"

    def split_stage(self, gm, *, strict=True):
        sized = graphpp._size_queries_carried_as_sizes

        def everything_to_input(d_i, d_w):
            # Called with dI and the nodes only dW needs: hand all of those to dI as well.
            return sized(d_i, d_w) | d_w

        with mock.patch.object(graphpp, "_size_queries_carried_as_sizes", everything_to_input):
            return super().split_stage(gm, strict=strict)


class DeadWeightMatmulCopies(ReferenceBackend):
    """Its split leaves in backward_weight a copy of every FP8 matmul there that nothing reads
    (a pass that rebuilt dW's matmuls and kept the originals): values, counts of what the outputs
    need and provenance stay right, and dW's code runs each weight-gradient matmul twice."""

    name = "mutant-dead-weight-matmul-copies"
    KILLED_BY = "BND-002"

    def split_stage(self, gm, *, strict=True):
        split = super().split_stage(gm, strict=strict)
        graph = split.backward_weight.graph
        for node in [n for n in graph.nodes if is_fp8_compute(n)]:
            with graph.inserting_after(node):
                graph.node_copy(node)
        split.backward_weight.recompile()
        return split


MUTANTS = [
    WeightRequantizes,
    CastDuplicatedAcrossCut,
    ComputeDuplicated,
    ProvenanceLostInSplit,
    ProvenanceSwappedInSplit,
    PlaceholderBoundaryIncomplete,
    CallablesRevalidatedStrictly,
    SplitSkipsStrictValidation,
    ParamGradsOutOfOrder,
    WeightWorkInInput,
    DeadWeightMatmulCopies,
]
