"""Mutant backends for REG and NUM: the reference with one defect each in regions or compilation."""

from __future__ import annotations

import dataclasses

import fp8conf
from conformance.backends.reference import ReferenceBackend
from conformance.api.types import Compiled, Region
from fp8conf.graph.regions import identify_fp8_regions, tag_fp8_regions


def _tag(gm, regions):
    tag_fp8_regions(gm, regions, strict=False)
    return [Region(r.id, r.nodes, r.complete, r.complete) for r in regions]


class BackwardRegionsMissing(ReferenceBackend):
    """Identifies regions in the forward pass only."""

    name = "mutant-backward-regions-missing"
    KILLED_BY = "REG-001"

    def regions(self, gm):
        return _tag(gm, [r for r in identify_fp8_regions(gm) if r.pass_name == "forward"])


class ModulesMerged(ReferenceBackend):
    """Puts every forward region into one, as a region grown through any provenance would be."""

    name = "mutant-modules-merged"
    KILLED_BY = "REG-002"

    def regions(self, gm):
        found = identify_fp8_regions(gm)
        forward = [r for r in found if r.pass_name == "forward"]
        if len(forward) > 1:
            order = {n: i for i, n in enumerate(gm.graph.nodes)}
            nodes = tuple(sorted({n for r in forward for n in r.nodes}, key=order.__getitem__))
            merged = dataclasses.replace(forward[0], nodes=nodes, compute_nodes=tuple(c for r in forward for c in r.compute_nodes))
            found = [merged] + [r for r in found if r.pass_name != "forward"]
        return _tag(gm, found)


class CastsAndMatmulsOnly(ReferenceBackend):
    """Keeps only the casts and the matmuls of a region, dropping the views between them."""

    name = "mutant-casts-and-matmuls-only"
    KILLED_BY = "REG-003"

    def regions(self, gm):
        kept = {fp8conf.OpRole.CAST, fp8conf.OpRole.COMPUTE}
        roles = fp8conf.op_roles(gm.graph)
        thinned = [dataclasses.replace(r, nodes=tuple(n for n in r.nodes if roles[n] in kept)) for r in identify_fp8_regions(gm)]
        return _tag(gm, thinned)


class NoRegionIds(ReferenceBackend):
    """Tags regions without a region id, so regional Inductor may merge them into one piece."""

    name = "mutant-no-region-ids"
    KILLED_BY = "REG-004"

    def regions(self, gm):
        found = super().regions(gm)
        for node in gm.graph.nodes:
            value = (node.meta.get("custom") or {}).get("compile_with_inductor")
            if isinstance(value, dict):
                node.meta["custom"] = {**node.meta["custom"], "compile_with_inductor": {}}
        return found


class IncompleteRegionsTagged(ReferenceBackend):
    """Tags every region, complete or not."""

    name = "mutant-incomplete-regions-tagged"
    KILLED_BY = "REG-005"

    def regions(self, gm):
        found = [dataclasses.replace(r, complete=True, reason=None) for r in identify_fp8_regions(gm)]
        return _tag(gm, found)


class NameDependentIds(ReferenceBackend):
    """Names each region after its first node."""

    name = "mutant-name-dependent-ids"
    KILLED_BY = "REG-006"

    def regions(self, gm):
        return _tag(gm, [dataclasses.replace(r, id=f"region_{r.nodes[0].name}") for r in identify_fp8_regions(gm)])


class AnnotationsReplaced(ReferenceBackend):
    """Writes its tag over ``node.meta["custom"]``, dropping annotations others put there."""

    name = "mutant-annotations-replaced"
    KILLED_BY = "REG-007"

    def regions(self, gm):
        found = super().regions(gm)
        for node in gm.graph.nodes:
            value = (node.meta.get("custom") or {}).get("compile_with_inductor")
            if value is not None:
                node.meta["custom"] = {"compile_with_inductor": value}
        return found


def _first_result_forever(fn):
    cache = []

    def run(primals, tangents):
        if not cache:
            cache.append(fn(primals, tangents))
        return cache[0]

    return run


class StaleFullCompile(ReferenceBackend):
    """Full compile whose callable returns the first step's results on every step."""

    name = "mutant-stale-full-compile"
    KILLED_BY = "NUM-001"

    def compile(self, gm, *, mode, cudagraph=False):
        compiled = super().compile(gm, mode=mode, cudagraph=cudagraph)
        return dataclasses.replace(compiled, fn=_first_result_forever(compiled.fn)) if mode == "full" else compiled


class StaleRegionalCompile(ReferenceBackend):
    """Regional compile whose callable returns the first step's results on every step."""

    name = "mutant-stale-regional-compile"
    KILLED_BY = "NUM-002"

    def compile(self, gm, *, mode, cudagraph=False):
        compiled = super().compile(gm, mode=mode, cudagraph=cudagraph)
        return dataclasses.replace(compiled, fn=_first_result_forever(compiled.fn)) if mode == "regional" else compiled


class CompiledButEager(ReferenceBackend):
    """Reports the tagged regions as compiled but runs the whole graph eagerly."""

    name = "mutant-compiled-but-eager"
    KILLED_BY = "NUM-003"

    def compile(self, gm, *, mode, cudagraph=False):
        compiled = super().compile(gm, mode=mode, cudagraph=cudagraph)
        return dataclasses.replace(compiled, fn=gm) if mode == "regional" else compiled


MUTANTS = [
    BackwardRegionsMissing,
    ModulesMerged,
    CastsAndMatmulsOnly,
    NoRegionIds,
    IncompleteRegionsTagged,
    NameDependentIds,
    AnnotationsReplaced,
    StaleFullCompile,
    StaleRegionalCompile,
    CompiledButEager,
]
