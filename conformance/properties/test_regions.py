"""REG: FP8 regions are whole, separate, convex, deterministic, and only complete ones are tagged."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance.judge import rewrites
from conformance.draw.families import FAMILIES, user_annotations
from conformance.draw.family_examples import family_examples
from conformance.observe.graphs import fp8_compute_nodes, incompleteness, is_fp8_cast, non_convexity, tagged_groups
from conformance.run.harness import call_backend, check, fail, fp8_ops, fresh_copy, require_subject, traced, traced_graph
from conformance.draw.strategies import ALL_KINDS
from conformance.draw.strategies import model_specs as _model_specs
from conformance.api.types import Region

#: Quantized module kinds drawn here: float8 and, for a backend that claims ``mx``, MX layers
#: (about half the models then hold MX layers).
KINDS = ALL_KINDS


def model_specs(**kwargs):
    return _model_specs(kinds=KINDS, families=FAMILIES, **kwargs)


non_emulated = model_specs(emulate=False)


def _regions(property_id, backend, gm) -> list[Region]:
    regions = call_backend(property_id, backend, "regions", gm, expect=list)
    for region in regions:
        if not isinstance(region, Region):
            fail(property_id, f"backend {backend.name!r}: regions() returned a {type(region).__qualname__}, expected conformance.Region")
    return regions


def _tagged_copy(property_id, backend, spec):
    gm, oracle = traced_graph(property_id, backend, spec)
    return gm, oracle, _regions_of_fp8_graph(property_id, backend, gm, spec)


def _regions_of_fp8_graph(property_id, backend, gm, spec) -> list[Region]:
    """The backend's regions of ``gm``; a graph with FP8 compute and no region reported fails:
    every rule about regions would otherwise pass on nothing."""
    regions = _regions(property_id, backend, gm)
    computes = fp8_compute_nodes(gm, fp8_ops(property_id, backend))
    if computes:
        require_subject(regions, property_id, f"regions() reported no region for a graph with {len(computes)} FP8 compute node(s)", spec)
    return regions


@pytest.mark.fp8_property("REG-001")
@family_examples
@given(spec=model_specs())
def test_REG_001_every_fp8_compute_node_lies_in_exactly_one_region(fp8_backend, spec):
    """Cheapest defect: identifying regions in the forward pass only (or one region per module
    that swallows another's compute). Every FP8 compute node of the graph, forward and
    backward, must be a member of exactly one reported region."""
    gm, _, regions = _tagged_copy("REG-001", fp8_backend, spec)
    membership = collections.Counter(n for r in regions for n in r.nodes)
    for node in fp8_compute_nodes(gm, fp8_ops("REG-001", fp8_backend)):
        check(
            membership[node] == 1,
            "REG-001",
            f"FP8 compute node '{node.name}' lies in {membership[node]} regions, expected exactly one",
            spec,
        )


@pytest.mark.fp8_property("REG-002")
@family_examples
@given(spec=model_specs())
def test_REG_002_a_region_never_mixes_modules_or_passes(fp8_backend, spec):
    """Cheapest defect once let through: one region id per module (``layers.0``), so the forward
    and backward regions of a call, or both calls of a reused module, carry one id and regional
    Inductor compiles them as one piece, although every node still comes from one module. The
    suite now knows each node's call (its own per-call annotation, paired into the backward by
    ``seq_nr``) and fails a region or a tag id that spans two calls or both passes."""
    gm, oracle, regions = _tagged_copy("REG-002", fp8_backend, spec)
    for region in regions:
        owners = {oracle.issued_by.get(n) for n in region.nodes if n.op == "call_function"}
        calls = {oracle.call_of.get(n) for n in region.nodes if n.op == "call_function"}
        passes = {fp8_backend.is_backward(n) for n in region.nodes}
        check(
            len(owners) == 1 and None not in owners and len(calls) == 1 and len(passes) == 1,
            "REG-002",
            f"region {region.id!r} mixes modules {sorted(map(str, owners))}, calls {sorted(map(str, calls))} and/or "
            f"passes {sorted('backward' if p else 'forward' for p in passes)}",
            spec,
        )
    for region_id, nodes in tagged_groups(gm).items():
        calls = {oracle.call_of.get(n) for n in nodes}
        passes = {"backward" if fp8_backend.is_backward(n) else "forward" for n in nodes}
        check(
            len(calls) == 1 and len(passes) == 1,
            "REG-002",
            f"nodes tagged with region id {region_id!r} come from module calls {sorted(map(str, calls))} in passes "
            f"{sorted(passes)}: one id per module call and pass, or regional compilation merges them",
            spec,
        )


@pytest.mark.fp8_property("REG-003")
@family_examples
@given(spec=model_specs())
def test_REG_003_a_region_is_convex(fp8_backend, spec):
    """Cheapest defect: a region of the casts and matmuls only, dropping the views between them,
    whose cut-out piece would call back into the graph. The suite checks convexity itself: no
    path from a region node through nodes outside it re-enters the region."""
    _, _, regions = _tagged_copy("REG-003", fp8_backend, spec)
    for region in regions:
        reason = non_convexity(set(region.nodes))
        check(reason is None, "REG-003", f"region {region.id!r} is not convex: {reason}", spec)


@pytest.mark.fp8_property("REG-004")
@family_examples
@given(spec=model_specs())
def test_REG_004_only_complete_regions_are_tagged(fp8_backend, spec):
    """Cheapest defects: tagging regions without a region id (regional Inductor then merges them),
    or tagging a region the backend itself reports incomplete; and, with the tags consistent,
    judging complete regions partial (the backward ones, say), so they are reported and never
    compiled. Tagged nodes must carry an id, every tagged group must be complete by the suite's
    own check, every reported region's ``complete`` must equal the suite's own judgement of its
    nodes, and a region is tagged exactly when it is reported complete and tagged."""
    gm, _, regions = _tagged_copy("REG-004", fp8_backend, spec)
    groups = tagged_groups(gm)
    ops = fp8_ops("REG-004", fp8_backend)
    check(None not in groups, "REG-004", "tagged nodes carry no inductor_region id, so regions would merge when compiled", spec)
    for region_id, nodes in groups.items():
        reason = incompleteness(nodes, fp8_backend.is_backward, ops)
        check(reason is None, "REG-004", f"tagged region {region_id!r} is incomplete: {reason}", spec)
    for region in regions:
        # Completeness is the suite's to judge (conformance.observe.graphs.incompleteness), not the backend's.
        reason = incompleteness(set(region.nodes), fp8_backend.is_backward, ops)
        check(
            region.complete == (reason is None),
            "REG-004",
            f"region {region.id!r} is reported complete={region.complete}, but by the suite's own check it is "
            + (f"incomplete: {reason}" if reason else "complete: every FP8 value and scale its compute uses is made inside it or enters at a boundary"),
            spec,
        )
    tagged = set().union(*groups.values()) if groups else set()
    for region in regions:
        reported_tagged = region.tagged and region.complete
        check(
            reported_tagged == bool(set(region.nodes) & tagged) and (not region.tagged or region.complete),
            "REG-004",
            f"region {region.id!r}: complete={region.complete}, tagged={region.tagged}, but its nodes are "
            f"{'' if set(region.nodes) & tagged else 'not '}tagged in the graph",
            spec,
        )


def _region_casts(backend, regions, data, spec=None):
    """A cast to FP8 inside a region of each pass in turn (the passes are a finite space,
    enumerated rather than drawn): ``(region, cast, members)`` per pass that has one."""
    candidates: dict[str, list] = {}
    for region in regions:
        members = set(region.nodes)
        for node in region.nodes:
            # Not a view of bytes as e8m0: an MX scale is a power of two, not FP8 data.
            if is_fp8_cast(node):
                candidates.setdefault("backward" if backend.is_backward(node) else "forward", []).append((region, node, members))
    require_subject(candidates, "REG-005", f"no region of the {len(regions)} reported holds a cast to FP8, so there is no chain to break", spec)
    return [data.draw(st.sampled_from(found), label=f"({pass_name} region, cast) losing its metadata")
            for pass_name, found in sorted(candidates.items())]


@pytest.mark.fp8_property("REG-005")
@family_examples
@given(spec=non_emulated, data=st.data())
def test_REG_005_a_region_missing_part_of_its_chain_is_not_tagged(fp8_backend, spec, data):
    """Cheapest defect once let through: a completeness check that takes any value no module
    tracks for a boundary (an input from outside the stage) as long as that value's own producer
    is untracked too. Rebuilding only the cast leaves its producer tracked, so that check still
    saw the break; the suite now also rebuilds the cast's whole chain (amax, scale, scaling,
    cast) without metadata, where such a check tags a region fed from untracked FP8 and fails."""
    probe, _ = traced_graph("REG-005", fp8_backend, spec)
    probe_regions = _regions_of_fp8_graph("REG-005", fp8_backend, probe, spec)
    probe_computes = set(fp8_compute_nodes(probe, fp8_ops("REG-005", fp8_backend)))
    for region, cast, members in _region_casts(fp8_backend, probe_regions, data, spec):
        downstream = [n.name for n in members if n in probe_computes and _reaches(cast, n)]
        _check_broken_chains(fp8_backend, spec, region, cast, downstream)


def _check_broken_chains(fp8_backend, spec, region, cast, downstream) -> None:
    """REG-005 for ``cast`` of ``region``: its cast alone, then its whole chain, rebuilt without
    metadata on a fresh trace."""
    for scope in ("cast", "whole chain"):
        gm, oracle = traced_graph("REG-005", fp8_backend, spec)
        by_name = {n.name: n for n in gm.graph.nodes}
        target = by_name[cast.name]
        if scope == "cast":
            rewrites.rebuild_without_meta(gm, target)
        else:
            call, backward = oracle.call_of.get(target), fp8_backend.is_backward(target)
            rewrites.rebuild_chain_without_meta(
                gm, target, lambda n: call is not None and oracle.call_of.get(n) == call and fp8_backend.is_backward(n) == backward
            )
        _check_partial_region_untagged(fp8_backend, spec, gm, region, cast, scope, {by_name[n] for n in downstream})


def _check_partial_region_untagged(fp8_backend, spec, gm, region, cast, scope, downstream):
    _regions("REG-005", fp8_backend, gm)
    groups = tagged_groups(gm)
    tagged = set().union(*groups.values()) if groups else set()
    for compute in downstream:
        check(
            compute not in tagged,
            "REG-005",
            f"the {scope} of cast '{cast.name}' of region {region.id!r} was rebuilt without its metadata (a partial "
            f"rewrite), yet the compute node '{compute.name}' that depends on it is still tagged for compilation",
            spec,
        )
    for region_id, nodes in groups.items():
        reason = incompleteness(nodes, fp8_backend.is_backward, fp8_ops("REG-005", fp8_backend))
        check(reason is None, "REG-005", f"after rebuilding the {scope} of '{cast.name}', tagged region {region_id!r} is incomplete: {reason}", spec)


def _reaches(source, target) -> bool:
    stack, seen = [source], {source}
    while stack:
        node = stack.pop()
        if node is target:
            return True
        for user in node.users:
            if user not in seen:
                seen.add(user)
                stack.append(user)
    return False


@pytest.mark.fp8_property("REG-006")
@family_examples
@given(spec=model_specs())
def test_REG_006_identification_is_deterministic_and_ignores_node_names(fp8_backend, spec):
    """Cheapest defect: region ids derived from node names (or from ``id()`` of nodes). The graph
    is identified twice and once more after every node is renamed; ids, members by position
    and tags must not change."""
    case = traced("REG-006", fp8_backend, spec)
    views = []
    for rename in (False, False, True):
        gm, _ = fresh_copy(case)
        if rename:
            for index, node in enumerate(reversed(list(gm.graph.nodes))):
                if node.op == "call_function":
                    node._rename(f"renamed_{index}")
            gm.recompile()
        position = {n: i for i, n in enumerate(gm.graph.nodes)}
        regions = _regions_of_fp8_graph("REG-006", fp8_backend, gm, spec)
        views.append(sorted((r.id, tuple(position[n] for n in r.nodes), r.complete, r.tagged) for r in regions))
    check(views[0] == views[1], "REG-006", "two identifications of the same graph differ", spec)
    check(
        views[0] == views[2],
        "REG-006",
        "renaming the graph's nodes changed the regions (ids, members or tags): identification must not depend on names",
        spec,
    )


@pytest.mark.fp8_property("REG-007")
@family_examples
@given(spec=model_specs(), data=st.data())
def test_REG_007_tagging_keeps_other_annotations(fp8_backend, spec, data):
    """Cheapest defects: writing the tag over ``node.meta["custom"]``, or over a
    ``compile_with_inductor`` value a user already set (a fresh dict holding the region id only).
    Drawn nodes, inside and outside regions, carry annotations of their own before tagging, and
    every FP8 compute node (so, always, nodes that get tagged) and the first drawn node carry
    compile options of their own; every annotation and every option must survive unchanged.
    The ``annotated`` family also annotates itself while traced (``torch.fx.traceback.annotate``
    around each block's attention and MLP): a backend whose own tracing annotations replace the
    user's, rather than add to them, loses those keys on every node its modules issue."""
    gm, oracle = traced_graph("REG-007", fp8_backend, spec)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    chosen = data.draw(st.lists(st.sampled_from(nodes), min_size=1, max_size=8, unique=True), label="annotated nodes")
    for index, node in enumerate(chosen):
        node.meta["custom"] = {**(node.meta.get("custom") or {}), "pp_stage": index, "user_note": f"keep {index}"}
    optioned = [chosen[0]] + [n for n in fp8_compute_nodes(gm, fp8_ops("REG-007", fp8_backend)) if n is not chosen[0]]
    options = {node: _with_user_compile_options(node, index) for index, node in enumerate(optioned)}
    _regions_of_fp8_graph("REG-007", fp8_backend, gm, spec)
    _check_model_annotations(fp8_backend, spec, gm, oracle)
    for index, node in enumerate(chosen):
        custom = node.meta.get("custom") or {}
        check(
            custom.get("pp_stage") == index and custom.get("user_note") == f"keep {index}",
            "REG-007",
            f"node '{node.name}' had custom annotations pp_stage={index}, user_note='keep {index}'; after tagging "
            f"its custom meta is {custom}",
            spec,
        )
    for node, wanted in options.items():
        value = (node.meta.get("custom") or {}).get("compile_with_inductor")
        kept = isinstance(value, dict) and all(value.get(key) == option for key, option in wanted.items())
        check(
            kept,
            "REG-007",
            f"node '{node.name}' carried compile_with_inductor={wanted} of its own before tagging; after tagging it "
            f"carries {value!r}: a region id may be added to those options, none may be dropped or changed",
            spec,
        )


def _check_model_annotations(fp8_backend, spec, gm, oracle):
    """Every forward node a quantized module issued carries the keys the model's own forward
    annotated it with (:func:`conformance.draw.families.user_annotations`, the suite's attribution):
    through the backend's tracing and its tagging. Backward nodes are not asked: whether
    annotations reach them is the torch version's business."""
    for node in gm.graph.nodes:
        fqn = oracle.issued_by.get(node)
        wanted = user_annotations(spec, fqn) if fqn and not fp8_backend.is_backward(node) else {}
        custom = node.meta.get("custom") or {}
        lost = {key: value for key, value in wanted.items() if custom.get(key) != value}
        check(
            not lost,
            "REG-007",
            f"forward node '{node.name}' of {fqn!r} was traced inside the model's own torch.fx.traceback.annotate({wanted}); "
            f"after tracing and tagging its custom meta is {custom}: the model's annotations {sorted(lost)} were lost",
            spec,
        )


def _with_user_compile_options(node, index: int) -> dict:
    """Give ``node`` Inductor options of a user's own (added to any it carries); returns what its
    ``compile_with_inductor`` value now holds besides a region id, copied, to compare with after
    tagging."""
    custom = dict(node.meta.get("custom") or {})
    existing = custom.get("compile_with_inductor")
    value = dict(existing) if isinstance(existing, dict) else {}
    configs = dict(value.get("inductor_configs") or {})
    configs.update({"max_autotune": False, "coordinate_descent_tuning": index % 2 == 0})
    value["inductor_configs"] = configs
    custom["compile_with_inductor"] = value
    node.meta["custom"] = custom
    # The region id is the backend's to set (REG-004), whoever set one before.
    return {key: (dict(option) if isinstance(option, dict) else option) for key, option in value.items() if key != "inductor_region"}
