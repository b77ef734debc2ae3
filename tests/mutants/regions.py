"""Mutant backends for REG and NUM: the reference with one defect each in regions or compilation."""

from __future__ import annotations

import dataclasses
from unittest import mock

import fp8conf
import fp8conf.graph.regions
from conformance.backends.reference import ReferenceBackend
from conformance.api.types import Compiled, Region
from conformance.observe.graphs import copy_graph_module, is_fp8_cast
from fp8conf.graph.provenance import get_provenance
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


class OneIdPerModule(ReferenceBackend):
    """Names each region after its module: the forward and backward regions of a call, and
    both calls of a reused module, share one id and compile as one piece."""

    name = "mutant-one-id-per-module"
    KILLED_BY = "REG-002"

    def regions(self, gm):
        return _tag(gm, [dataclasses.replace(r, id=r.module_fqn) for r in identify_fp8_regions(gm)])


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


class BackwardRegionsJudgedPartial(ReferenceBackend):
    """Judges every backward region partial, as a completeness check that takes a value saved
    for backward for one made outside the region would: the backward regions are reported, not
    tagged, and never compiled. Its report and its tags agree."""

    name = "mutant-backward-regions-judged-partial"
    KILLED_BY = "REG-004"

    def regions(self, gm):
        found = [
            r if r.pass_name == "forward" else dataclasses.replace(r, complete=False, reason="a saved value enters from the forward")
            for r in identify_fp8_regions(gm)
        ]
        return _tag(gm, found)


class IncompleteRegionsTagged(ReferenceBackend):
    """Tags every region, complete or not."""

    name = "mutant-incomplete-regions-tagged"
    KILLED_BY = "REG-005"

    def regions(self, gm):
        found = [dataclasses.replace(r, complete=True, reason=None) for r in identify_fp8_regions(gm)]
        return _tag(gm, found)


def _untracked_all_the_way(value) -> bool:
    return value.op == "call_function" and get_provenance(value) is None and all(get_provenance(i) is None for i in value.all_input_nodes)


class UntrackedValuesAreBoundaries(ReferenceBackend):
    """Judges completeness as if a value made by untracked nodes from untracked inputs came from
    outside the stage (a pre-quantized weight, say): a chain that lost all its metadata passes."""

    name = "mutant-untracked-values-are-boundaries"
    KILLED_BY = "REG-005"

    def regions(self, gm):
        incomplete = fp8conf.graph.regions._incomplete

        def lenient(group, computes, passes, pass_name):
            outside = {i for n in group for i in n.all_input_nodes if i not in group and _untracked_all_the_way(i)}
            return incomplete(group | outside, computes, passes, pass_name)

        with mock.patch.object(fp8conf.graph.regions, "_incomplete", lenient):
            return _tag(gm, identify_fp8_regions(gm))


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


class CompileOptionsReplaced(ReferenceBackend):
    """Tags with a fresh ``compile_with_inductor`` value holding its region id alone, dropping
    the Inductor options a user had put on the node."""

    name = "mutant-compile-options-replaced"
    KILLED_BY = "REG-007"

    def regions(self, gm):
        found = super().regions(gm)
        for node in gm.graph.nodes:
            value = (node.meta.get("custom") or {}).get("compile_with_inductor")
            if isinstance(value, dict) and fp8conf.graph.regions.REGION_META_KEY in value:
                region_id = value[fp8conf.graph.regions.REGION_META_KEY]
                node.meta["custom"] = {**node.meta["custom"], "compile_with_inductor": {fp8conf.graph.regions.REGION_META_KEY: region_id}}
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


def _parameters_frozen_at_first_call(fn):
    # What Inductor's freezing does to a training step: the parameters seen at the first call
    # become constants of the compiled code.
    import torch

    frozen = {}

    def run(primals, tangents):
        if not frozen:
            frozen.update({i: p.detach().clone() for i, p in enumerate(primals) if isinstance(p, torch.nn.Parameter)})
        return fn([frozen.get(i, p) for i, p in enumerate(primals)], tangents)

    return run


class ParametersFrozenFullCompile(ReferenceBackend):
    """Full compile that keeps the parameters of its first call as constants."""

    name = "mutant-parameters-frozen-full-compile"
    KILLED_BY = "NUM-001"

    def compile(self, gm, *, mode, cudagraph=False):
        compiled = super().compile(gm, mode=mode, cudagraph=cudagraph)
        return dataclasses.replace(compiled, fn=_parameters_frozen_at_first_call(compiled.fn)) if mode == "full" else compiled


class ParametersFrozenRegionalCompile(ReferenceBackend):
    """Regional compile that keeps the parameters of its first call as constants."""

    name = "mutant-parameters-frozen-regional-compile"
    KILLED_BY = "NUM-002"

    def compile(self, gm, *, mode, cudagraph=False):
        compiled = super().compile(gm, mode=mode, cudagraph=cudagraph)
        return dataclasses.replace(compiled, fn=_parameters_frozen_at_first_call(compiled.fn)) if mode == "regional" else compiled


class RunJointIgnoresCompiled(ReferenceBackend):
    """A runner that runs the joint graph it is given, whatever compiled callable it is handed:
    compiled code is never what runs. Claims full compilation only (no regional compile, whose
    observation of what ran would see it)."""

    name = "mutant-run-joint-ignores-compiled"
    KILLED_BY = "NUM-001"
    capabilities = ReferenceBackend.capabilities - {"compile.regional", "cudagraph"}

    def run_joint(self, gm, model, args, grad_outputs, *, fn=None):
        return super().run_joint(gm, model, args, grad_outputs)


class FullCompileReturnsGraph(ReferenceBackend):
    """Full compile that hands back the graph module itself, reporting every node compiled: the
    step runs eagerly and matches eager exactly."""

    name = "mutant-full-compile-returns-graph"
    KILLED_BY = "NUM-001"

    def compile(self, gm, *, mode, cudagraph=False):
        if mode != "full":
            return super().compile(gm, mode=mode, cudagraph=cudagraph)
        names = frozenset(n.name for n in gm.graph.nodes if n.op == "call_function")
        return Compiled(gm, names, frozenset())


class FullCompileRegionsOnly(ReferenceBackend):
    """Full compile that compiles the tagged FP8 regions only and runs the rest eagerly,
    reporting every node compiled."""

    name = "mutant-full-compile-regions-only"
    KILLED_BY = "NUM-001"

    def compile(self, gm, *, mode, cudagraph=False):
        if mode != "full":
            return super().compile(gm, mode=mode, cudagraph=cudagraph)
        compiled = super().compile(gm, mode="regional", cudagraph=cudagraph)
        return dataclasses.replace(compiled, compiled_nodes=compiled.compiled_nodes | compiled.eager_nodes, eager_nodes=frozenset())


class CompiledButEager(ReferenceBackend):
    """Reports the tagged regions as compiled but runs the whole graph eagerly."""

    name = "mutant-compiled-but-eager"
    KILLED_BY = "NUM-003"

    def compile(self, gm, *, mode, cudagraph=False):
        compiled = super().compile(gm, mode=mode, cudagraph=cudagraph)
        return dataclasses.replace(compiled, fn=gm) if mode == "regional" else compiled


def _report_echoing_tags(backend, gm, compiled: Compiled) -> Compiled:
    """``compiled`` with a report that names exactly the nodes the backend tags as compiled."""
    probe = copy_graph_module(gm)
    backend.regions(probe)
    tagged = {n.name for n in probe.graph.nodes if "compile_with_inductor" in (n.meta.get("custom") or {})}
    names = compiled.compiled_nodes | compiled.eager_nodes
    return dataclasses.replace(compiled, compiled_nodes=frozenset(names & tagged), eager_nodes=frozenset(names - tagged))


class RegionalCompilesAround(ReferenceBackend):
    """Regional compile that, for speed, compiles each region together with the untagged nodes
    around it, yet reports only the tagged nodes as compiled."""

    name = "mutant-regional-compiles-around"
    KILLED_BY = "NUM-003"

    def compile(self, gm, *, mode, cudagraph=False):
        if mode != "regional":
            return super().compile(gm, mode=mode, cudagraph=cudagraph)
        around = fp8conf.compile_joint(gm, mode="regional", strict=True, cudagraph=cudagraph, remainder="inductor")
        return _report_echoing_tags(self, gm, Compiled(around, around.compiled_nodes, around.eager_nodes))


class RegionalCompilesWholeGraph(ReferenceBackend):
    """Regional compile that runs the fully compiled graph while reporting the regional split."""

    name = "mutant-regional-compiles-whole-graph"
    KILLED_BY = "NUM-003"

    def compile(self, gm, *, mode, cudagraph=False):
        compiled = super().compile(gm, mode=mode, cudagraph=cudagraph)
        if mode != "regional":
            return compiled
        return dataclasses.replace(compiled, fn=super().compile(gm, mode="full", cudagraph=cudagraph).fn)


def _region_sources(gm) -> list:
    """The pointwise nodes where a complete region starts (every input made outside it), casts
    to FP8 left out: the ``abs`` before an amax, say."""
    import torch

    found = []
    for region in identify_fp8_regions(gm):
        inside = set(region.nodes)
        for node in region.nodes:
            target = node.target
            pointwise = isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags
            if region.complete and pointwise and not is_fp8_cast(node) and not inside.intersection(node.all_input_nodes):
                found.append(node)
    return found


class RegionSourcesEager(ReferenceBackend):
    """Leaves the first pointwise op of each region (the ``abs`` before an amax) out of what it
    compiles, so it runs eagerly, while reporting every tagged node compiled: the casts to FP8
    stay compiled, and the results are the same."""

    name = "mutant-region-sources-eager"
    KILLED_BY = "NUM-003"

    def compile(self, gm, *, mode, cudagraph=False):
        if mode != "regional":
            return super().compile(gm, mode=mode, cudagraph=cudagraph)
        thinned = copy_graph_module(gm)
        for node in _region_sources(thinned):
            node.meta.pop(fp8conf.PROVENANCE_META_KEY, None)
        return _report_echoing_tags(self, gm, super().compile(thinned, mode=mode, cudagraph=cudagraph))


class RegionalLeavesV2Eager(ReferenceBackend):
    """Regional compile whose region finder knows the first scaled-matmul API only: every region
    of a linear on ``F.scaled_mm`` stays eager, while the report names every tagged node compiled."""

    name = "mutant-regional-leaves-v2-eager"
    KILLED_BY = "NUM-003"

    def compile(self, gm, *, mode, cudagraph=False):
        from mutants.scaled_mm_v2 import _v1_compute_only  # tests/ is on sys.path

        if mode != "regional":
            return super().compile(gm, mode=mode, cudagraph=cudagraph)
        with _v1_compute_only(fp8conf.graph.regions):
            compiled = super().compile(gm, mode=mode, cudagraph=cudagraph)
        return _report_echoing_tags(self, gm, compiled)


MUTANTS = [
    BackwardRegionsMissing,
    ModulesMerged,
    OneIdPerModule,
    CastsAndMatmulsOnly,
    NoRegionIds,
    BackwardRegionsJudgedPartial,
    IncompleteRegionsTagged,
    UntrackedValuesAreBoundaries,
    NameDependentIds,
    AnnotationsReplaced,
    CompileOptionsReplaced,
    StaleFullCompile,
    StaleRegionalCompile,
    ParametersFrozenFullCompile,
    ParametersFrozenRegionalCompile,
    RunJointIgnoresCompiled,
    FullCompileReturnsGraph,
    FullCompileRegionsOnly,
    CompiledButEager,
    RegionalCompilesAround,
    RegionalCompilesWholeGraph,
    RegionSourcesEager,
    RegionalLeavesV2Eager,
]
