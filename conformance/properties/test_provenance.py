"""PROV: provenance, the link from every node back to the quantized module that issued it."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given

from conformance.draw.families import FAMILIES
from conformance.draw.family_examples import family_examples
from conformance.observe.graphs import fp8_compute_nodes, no_fp8_compute_reason, surely_backward, tangent_placeholders
from conformance.run.harness import call_backend, check, fail, fp8_ops, fresh_args as _fresh_args, grad_outputs as _grad_outputs, traced, traced_graph
from conformance.report.notes import note
from conformance.draw.strategies import ALL_KINDS
from conformance.draw.strategies import model_specs as _model_specs
from conformance.api.types import Provenance

#: Quantized module kinds drawn here: float8 and, for a backend that claims ``mx``, MX layers
#: (about half the models then hold MX layers).
KINDS = ALL_KINDS


def model_specs(**kwargs):
    return _model_specs(kinds=KINDS, families=FAMILIES, **kwargs)


def _provenance(property_id, backend, node):
    return call_backend(property_id, backend, "provenance", node, expect=(Provenance, type(None)))


def _fqn(property_id, backend, node):
    found = _provenance(property_id, backend, node)
    return None if found is None else found.module_fqn


@pytest.mark.fp8_property("PROV-001")
@family_examples
@given(spec=model_specs(emulate=False))
def test_PROV_001_every_fp8_compute_node_names_its_module(fp8_backend, spec):
    """Cheapest defect that would pass a weaker test: provenance on forward nodes only, relying on
    the torch version to carry annotations into the backward. Every FP8 compute node, forward and
    backward, is checked against the suite's own ground truth (its annotation, paired into the
    backward by ``seq_nr``), so a backward matmul without provenance or naming another module fails."""
    case = traced("PROV-001", fp8_backend, spec)
    computes = fp8_compute_nodes(case.gm, fp8_ops("PROV-001", fp8_backend))
    check(bool(computes), "PROV-001", no_fp8_compute_reason(case.gm, fp8_ops("PROV-001", fp8_backend)), spec)
    for node in computes:
        passes = "backward" if fp8_backend.is_backward(node) else "forward"
        seen = _fqn("PROV-001", fp8_backend, node)
        expected = case.oracle.issued_by.get(node)
        check(
            seen is not None and seen == expected,
            "PROV-001",
            f"{passes} FP8 compute node '{node.name}' ({node.target}): expected provenance naming "
            f"{expected!r}, saw {seen!r}",
            spec,
        )


@pytest.mark.fp8_property("PROV-002")
@family_examples
@given(spec=model_specs())
def test_PROV_002_provenance_config_equals_module_config(fp8_backend, spec):
    """Cheapest defect once let through: a nested module described with its parent's config (every
    drawn adapter used to copy its parent's recipe and flag, so such provenance was right by
    accident). Adapters now draw their own recipe and ``emulate`` flag, so provenance copied from
    the parent names the wrong config; a recipe reported as a constant (tensorwise) fails as
    soon as another recipe is drawn, also from a backend that declares it records no recipe
    (``provenance_has_recipe = False``) and gives one all the same."""
    case = traced("PROV-002", fp8_backend, spec)
    configs = spec.quantized_modules()
    if not fp8_backend.provenance_has_recipe:
        note("recipe not checked: the backend records no recipe in its provenance (provenance_has_recipe = False)")
    seen_any = False
    for node in case.gm.graph.nodes:
        found = _provenance("PROV-002", fp8_backend, node)
        if found is None:
            continue
        seen_any = True
        expected = configs.get(found.module_fqn)
        if expected is None:
            fail("PROV-002", f"node '{node.name}' names {found.module_fqn!r}, which is not a quantized module of the model", spec)
        # A backend that says it records no recipe is not asked for one; a recipe it gives
        # anyway describes the module all the same, and must be right.
        if not fp8_backend.provenance_has_recipe and found.recipe is None:
            expected = (expected[0], None, expected[2])
        check(
            (found.kind, found.recipe, found.emulate) == expected,
            "PROV-002",
            f"node '{node.name}' of module {found.module_fqn!r}: expected (kind, recipe, emulate) = {expected}, "
            f"saw {(found.kind, found.recipe, found.emulate)}",
            spec,
        )
    check(seen_any, "PROV-002", "no node of the graph carries provenance", spec)


@pytest.mark.fp8_property("PROV-003")
@family_examples
@given(spec=model_specs())
def test_PROV_003_backward_nodes_carry_the_provenance_of_their_forward_op(fp8_backend, spec):
    """Cheapest defect that passes a check of compute nodes alone: gradient-accumulation nodes
    credited to the module whose gradient they add (inherited from an input). Every backward
    node is checked, and one whose ``seq_nr`` no forward op has must carry none; a backend that
    drops ``seq_nr`` cannot pass by making the pairing unknowable, since that fails first.
    Which nodes are backward is not the backend's word alone (``is_backward``): one that says the
    backward starts late (at its first FP8 matmul, say) keeps the gradient-of-output cast out of
    this check and out of its backward regions. Every node the gradients of the step's outputs
    reach, fed in as its runner feeds them, is backward, and ``is_backward`` must say so."""
    case = traced("PROV-003", fp8_backend, spec)
    _check_backward_pass_covers_what_the_output_gradients_reach(fp8_backend, spec, case)
    backward = [n for n in case.gm.graph.nodes if n.op == "call_function" and fp8_backend.is_backward(n)]
    check(
        all("seq_nr" in n.meta for n in backward),
        "PROV-003",
        "backward nodes lack node.meta['seq_nr'], the autograd sequence number that pairs them with the "
        "forward op they differentiate; keep it when rewriting",
        spec,
    )
    attributed = 0
    for node in backward:
        seen = _fqn("PROV-003", fp8_backend, node)
        if case.oracle.is_accumulation(node):
            check(
                seen is None,
                "PROV-003",
                f"backward node '{node.name}' ({node.target}) accumulates gradients (no forward op has its seq_nr "
                f"{node.meta.get('seq_nr')}), so it carries no provenance; saw {seen!r}",
                spec,
            )
            continue
        expected = case.oracle.issued_by[node]
        check(
            seen == expected,
            "PROV-003",
            f"backward node '{node.name}' ({node.target}, seq_nr {node.meta.get('seq_nr')}) differentiates a forward op "
            f"of {expected!r}, but carries provenance {seen!r}",
            spec,
        )
        attributed += expected is not None
    check(attributed > 0, "PROV-003", "no backward node differentiates a quantized module's op", spec)


def _check_backward_pass_covers_what_the_output_gradients_reach(fp8_backend, spec, case) -> None:
    """``is_backward`` against the suite's own ground truth: the nodes that the placeholders fed
    the gradients of the step's outputs reach (:func:`conformance.observe.graphs.surely_backward`)."""
    grad_out = _grad_outputs(spec, 100)

    def run(fn):
        fp8_backend.run_joint(case.gm, case.model, _fresh_args(spec, 0), grad_out, fn=fn)

    try:
        tangents = tangent_placeholders(run, case.gm, grad_out)
    except Exception as exc:
        fail("PROV-003", f"backend {fp8_backend.name!r}: run_joint() with an observing callable raised {type(exc).__name__}: {exc}", spec)
    check(
        bool(tangents),
        "PROV-003",
        "no placeholder of the graph received the gradients of the step's outputs that run_joint was given, so the "
        "suite cannot tell which nodes are backward",
        spec,
    )
    reached = surely_backward(tangents)
    late = [n for n in case.gm.graph.nodes if n in reached and not fp8_backend.is_backward(n)]
    check(
        not late,
        "PROV-003",
        f"{len(late)} node(s) depend on the gradient of the step's outputs (placeholder(s) "
        f"{sorted(t.name for t in tangents)}), so they belong to the backward, but is_backward() says forward: "
        + ", ".join(f"'{n.name}' ({n.target})" for n in late[:6]),
        spec,
    )


@pytest.mark.fp8_property("PROV-004")
@family_examples
@given(spec=model_specs())
def test_PROV_004_no_node_carries_provenance_of_a_module_that_did_not_issue_it(fp8_backend, spec):
    """Cheapest defect that PROV-001 lets through: provenance leaking forward onto the op that
    consumes a module's output (its activation, a residual add). Every forward call_function
    node, not only compute, must carry exactly the suite's ground truth: the consumer was issued
    by no quantized module, and a plain adapter nested in a quantized layer by none either."""
    case = traced("PROV-004", fp8_backend, spec)
    for node in case.gm.graph.nodes:
        if node.op != "call_function" or fp8_backend.is_backward(node):
            continue
        seen = _fqn("PROV-004", fp8_backend, node)
        expected = case.oracle.issued_by[node]
        check(
            seen == expected,
            "PROV-004",
            f"forward node '{node.name}' ({node.target}) was issued by "
            f"{'no quantized module' if expected is None else repr(expected)}, but carries provenance {seen!r}",
            spec,
        )


@pytest.mark.fp8_property("PROV-006")
@family_examples
@given(spec=model_specs(require_reuse=True, require_nesting=True, emulate=False))
def test_PROV_006_reused_modules_keep_their_fqn_nested_ones_the_innermost(fp8_backend, spec):
    """Cheapest defect that passes per-node checks on flat models: nested nodes attributed to the
    outermost quantized module, or the second call of a reused module credited to a fresh name.
    Only models with both a reused and a nested quantized module are drawn; each compute node is
    held to the innermost issuer, and the forward matmuls per FQN must equal the calls made."""
    case = traced("PROV-006", fp8_backend, spec)
    per_module = collections.Counter()
    for node in fp8_compute_nodes(case.gm, fp8_ops("PROV-006", fp8_backend)):
        seen = _fqn("PROV-006", fp8_backend, node)
        expected = case.oracle.issued_by.get(node)
        check(
            seen == expected,
            "PROV-006",
            f"FP8 compute node '{node.name}' was issued by {expected!r} (innermost quantized module of the call), "
            f"but carries provenance {seen!r}",
            spec,
        )
        if not fp8_backend.is_backward(node):
            per_module[seen] += 1
    calls = collections.Counter(fqn for fqn, _ in spec.calls() if not spec.quantized_modules()[fqn][2])
    check(
        per_module == calls,
        "PROV-006",
        f"forward FP8 compute attributed per module {dict(per_module)}, but the modules were called {dict(calls)} times",
        spec,
    )


@pytest.mark.fp8_property("PROV-005")
@family_examples
@given(spec=model_specs())
def test_PROV_005_provenance_survives_dce_and_cse(fp8_backend, spec):
    from torch.fx.passes.dialect.common.cse_pass import CSEPass

    gm, _ = traced_graph("PROV-005", fp8_backend, spec)
    before = {n.name: _provenance("PROV-005", fp8_backend, n) for n in gm.graph.nodes if n.op == "call_function"}
    rewritten = CSEPass()(gm).graph_module
    rewritten.graph.eliminate_dead_code()
    kept = 0
    for node in rewritten.graph.nodes:
        if node.op != "call_function" or node.name not in before:
            continue
        seen = _provenance("PROV-005", fp8_backend, node)
        check(
            seen == before[node.name],
            "PROV-005",
            f"node '{node.name}' carried {before[node.name]} before CSE + DCE and {seen} after",
            spec,
        )
        kept += seen is not None
    check(kept > 0, "PROV-005", "no node with provenance survived CSE + DCE", spec)
