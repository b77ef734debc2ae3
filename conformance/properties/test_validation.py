"""VAL: strict validation catches lost FP8, and only lost FP8."""

from __future__ import annotations

import warnings

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance.judge import rewrites
from conformance.observe.evidence import is_named
from conformance.draw.families import FAMILIES
from conformance.draw.family_examples import family_examples
from conformance.judge.dead_compute import needed_fp8_compute
from conformance.observe.graphs import declared_on_high_precision, fp8_compute_nodes, undeclared_low_precision_compute
from conformance.run.harness import (
    attributed, call_backend, check, declared_ops, fail, fp8_compute_truth, fp8_ops, fresh_copy, names_module, names_pass, strict_error,
    traced, traced_graph,
)
from conformance.draw.strategies import ALL_KINDS
from conformance.draw.strategies import model_specs as _model_specs
from conformance.api.types import ValidationReport

#: Quantized module kinds drawn here: float8 and, for a backend that claims ``mx``, MX layers
#: (about half the models then hold MX layers).
KINDS = ALL_KINDS


def model_specs(**kwargs):
    return _model_specs(kinds=KINDS, families=FAMILIES, **kwargs)

non_emulated = model_specs(emulate=False)



def _report(property_id, backend, gm) -> ValidationReport:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return call_backend(property_id, backend, "validate", gm, strict=False, expect=ValidationReport)


def _lowered_passes(property_id, case, backend, data):
    """Per pass of one drawn module (both, where it computes in both: the passes are a finite
    space, enumerated rather than drawn): ``(pass, graph)``, a copy of the graph with every FP8
    compute of the module in that pass lowered to a plain mm; and the module's FQN."""
    def groups_of(gm, oracle):
        groups = {}
        for node in attributed(property_id, backend, oracle, fp8_compute_nodes(gm, fp8_ops(property_id, backend)), case.spec):
            key = (oracle.issued_by[node], "backward" if backend.is_backward(node) else "forward")
            groups.setdefault(key, []).append(node)
        return groups

    fqn = data.draw(st.sampled_from(sorted({f for f, _ in groups_of(case.gm, case.oracle)})), label="module losing its FP8 compute")
    lowered = []
    for pass_name in ("backward", "forward"):
        gm, oracle = fresh_copy(case)
        nodes = groups_of(gm, oracle).get((fqn, pass_name))
        if nodes:
            for node in nodes:
                rewrites.lower_to_high_precision(gm, node)
            lowered.append((pass_name, gm))
    return fqn, lowered


def _names_location(exc, fqn, pass_name) -> bool:
    return names_module(exc, fqn) and names_pass(exc, pass_name)


@pytest.mark.fp8_property("VAL-001")
@family_examples
@given(spec=model_specs())
def test_VAL_001_strict_validation_accepts_supported_models(fp8_backend, spec):
    """Cheapest defect that a test of broken graphs alone lets through: false alarms, e.g. expecting
    a grad_input matmul where the input needs no gradient, or expecting FP8 compute from a plain
    ``nn.Linear`` nested in a ``Float8Linear`` (as if it were part of its parent). The drawn
    models vary input gradients, recipes, emulation, reuse and nesting with plain adapters,
    and every one of them must pass strict validation."""
    case = traced("VAL-001", fp8_backend, spec)
    exc = strict_error("VAL-001", fp8_backend, case.gm)
    check(exc is None, "VAL-001", f"strict validation rejected the backend's own graph: {type(exc).__name__}: {exc}", spec)


@pytest.mark.fp8_property("VAL-002")
@family_examples
@given(spec=non_emulated, data=st.data())
def test_VAL_002_lost_fp8_compute_fails_naming_module_and_pass(fp8_backend, spec, data):
    """Cheapest defect that passes "some error is raised": an error that names the graph but not
    the module or the pass, or validation that checks provenance only. All FP8 compute of one
    drawn module in one pass is lowered to ``mm`` with its metadata kept, for each pass in turn
    (a validation that checks the backward pass alone fails on every model), and the error must
    carry that FQN and pass in its message and in ``module_fqn`` / ``pass_name``."""
    fqn, lowered = _lowered_passes("VAL-002", traced("VAL-002", fp8_backend, spec), fp8_backend, data)
    for pass_name, gm in lowered:
        exc = strict_error("VAL-002", fp8_backend, gm)
        check(exc is not None, "VAL-002", f"all FP8 compute of {fqn!r} in the {pass_name} pass was lowered to mm, yet strict validation passed", spec)
        check(
            _names_location(exc, fqn, pass_name),
            "VAL-002",
            f"the error must name module {fqn!r} and pass {pass_name!r} (as .module_fqn/.pass_name, or in its message); "
            f"saw module_fqn={getattr(exc, 'module_fqn', None)!r} pass_name={getattr(exc, 'pass_name', None)!r}: {exc}",
            spec,
        )


@pytest.mark.fp8_property("VAL-003")
@family_examples
@given(spec=non_emulated, data=st.data())
def test_VAL_003_fp8_compute_without_provenance_fails(fp8_backend, spec, data):
    """Cheapest defect: skipping FP8 compute that has no provenance (a silent fallback), which a
    check of provenance on attributed nodes never sees. The suite rebuilds one compute node
    without metadata, a drawn one of each pass in turn (the passes are a finite space, enumerated
    rather than drawn); strict validation must fail and name that very node."""
    case = traced("VAL-003", fp8_backend, spec)
    by_pass: dict[str, list] = {}
    for node in fp8_compute_nodes(case.gm, fp8_ops("VAL-003", fp8_backend)):
        by_pass.setdefault("backward" if fp8_backend.is_backward(node) else "forward", []).append(node)
    positions = {node: i for i, node in enumerate(case.gm.graph.nodes)}
    for pass_name, nodes in sorted(by_pass.items()):
        node = data.draw(st.sampled_from(nodes), label=f"{pass_name} compute node stripped of meta")
        gm, _ = fresh_copy(case)
        node = list(gm.graph.nodes)[positions[node]]
        rewrites.rebuild_without_meta(gm, node)
        rebuilt = next(n for n in gm.graph.nodes if n.op == "call_function" and not n.meta.keys() - {"val"} and n.target == node.target)
        exc = strict_error("VAL-003", fp8_backend, gm)
        check(exc is not None, "VAL-003", f"{pass_name} FP8 compute node '{rebuilt.name}' lost its metadata, yet strict validation passed", spec)
        check(
            rebuilt.name in str(exc),
            "VAL-003",
            f"the error must name the node without provenance, '{rebuilt.name}'; saw: {type(exc).__name__}: {exc}",
            spec,
        )


@pytest.mark.fp8_property("VAL-004")
@family_examples
@given(spec=non_emulated, data=st.data())
def test_VAL_004_scaled_op_with_a_high_precision_operand_is_not_fp8_compute(fp8_backend, spec, data):
    """Cheapest defect: counting a scaled matmul as FP8 compute when any operand is FP8. Each
    matrix operand of a drawn compute node (one that counts: its result reaches an output) in
    turn is up-cast to float32 (the two operands are a finite space, enumerated rather than
    drawn); the non-strict count of that module and pass must drop by exactly one from the
    backend's count of the unbroken graph, which must be the truth (so a count of all scaled ops
    fails), and strict validation must fail."""
    case = traced("VAL-004", fp8_backend, spec)
    gm, oracle = fresh_copy(case)
    computes = attributed("VAL-004", fp8_backend, oracle, needed_fp8_compute(gm, fp8_ops("VAL-004", fp8_backend)), spec)
    node = data.draw(st.sampled_from(computes), label="scaled op given a float32 operand")
    key = (oracle.issued_by[node], "backward" if fp8_backend.is_backward(node) else "forward")
    truth = fp8_compute_truth("VAL-004", fp8_backend, spec, case.gm, case.oracle)
    before = _report("VAL-004", fp8_backend, gm).compute_counts.get(key, 0)
    check(
        truth.admits(key, before),
        "VAL-004",
        f"before any operand was changed, the backend counts {before} FP8 compute for {key[0]!r} in the {key[1]} pass; "
        f"the truth is {truth.admitted_counts()}",
        spec,
    )
    at = list(gm.graph.nodes).index(node)
    for index in (0, 1):
        broken, _ = fresh_copy(case)
        target = list(broken.graph.nodes)[at]
        # The argument position of that matrix operand, as the op declares it (an op of the
        # backend's own may take an accumulator first).
        position = fp8_ops("VAL-004", fp8_backend).find(target.target).operands[index]
        rewrites.upcast_operand(broken, target, position)
        seen = _report("VAL-004", fp8_backend, broken).compute_counts.get(key, 0)
        check(
            seen == before - 1,
            "VAL-004",
            f"'{target.name}' now multiplies a float32 operand (argument {position}); FP8 compute of {key[0]!r} in the {key[1]} "
            f"pass should count {before - 1}, the backend counts {seen}",
            spec,
        )
        check(strict_error("VAL-004", fp8_backend, broken) is not None, "VAL-004",
              f"strict validation accepted a scaled op fed a float32 operand (argument {position} of '{target.name}')", spec)


def _meta_snapshot(gm):
    def freeze(value):
        return ("obj", id(value)) if hasattr(value, "shape") else ("repr", repr(value))

    return gm.code, [(n.name, {k: freeze(v) for k, v in n.meta.items()}) for n in gm.graph.nodes], dict(gm.meta)


@pytest.mark.fp8_property("VAL-005")
@family_examples
@given(spec=model_specs())
def test_VAL_005_validation_does_not_change_the_graph(fp8_backend, spec):
    """Cheapest defect: validation marking nodes it checked in ``node.meta`` (or caching a report
    in ``gm.meta``). The code, every node's meta (values by identity, the rest by repr) and the
    graph module's meta are compared before and after strict and non-strict validation."""
    gm, _ = traced_graph("VAL-005", fp8_backend, spec)
    before = _meta_snapshot(gm)
    strict_error("VAL-005", fp8_backend, gm)
    _report("VAL-005", fp8_backend, gm)
    after = _meta_snapshot(gm)
    for label, b, a in zip(("code", "node meta", "graph-module meta"), before, after):
        if b != a:
            changed = [x[0] for x, y in zip(b, a) if x != y] if label == "node meta" else []
            fail("VAL-005", f"validation changed the {label}" + (f" of nodes {changed[:5]}" if changed else ""), spec)


@pytest.mark.fp8_property("VAL-006")
@family_examples
@given(spec=non_emulated, data=st.data())
def test_VAL_006_non_strict_mode_warns_the_same_findings_with_a_summary(fp8_backend, spec, data):
    """Cheapest defect: a summary that says nothing of the findings (a constant line, or one
    written before validation ran). The summary must state how many findings the report holds
    and name the module the suite broke and every module a finding names."""
    fqn, lowered = _lowered_passes("VAL-006", traced("VAL-006", fp8_backend, spec), fp8_backend, data)
    for pass_name, gm in lowered:
        _check_findings_and_summary(fp8_backend, spec, gm, fqn, pass_name)


def _check_findings_and_summary(fp8_backend, spec, gm, fqn, pass_name) -> None:
    """VAL-006 on ``gm``, whose FP8 compute of ``fqn`` in ``pass_name`` was lowered."""
    exc = strict_error("VAL-006", fp8_backend, gm)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = call_backend("VAL-006", fp8_backend, "validate", gm, strict=False, expect=ValidationReport)
    check(exc is not None, "VAL-006", f"strict validation passed a graph whose FP8 compute of {fqn!r} in the {pass_name} pass was lowered", spec)
    located = [f for f in report.findings if names_module(f, fqn) and names_pass(f, pass_name)]
    check(bool(located), "VAL-006", f"non-strict report lacks the finding strict mode raised ({exc}); findings: {report.findings}", spec)
    check(len(caught) >= len(report.findings), "VAL-006", f"{len(report.findings)} finding(s) but {len(caught)} warning(s)", spec)
    check(bool(report.summary.strip()), "VAL-006", "the non-strict report has an empty summary", spec)
    modules = sorted({fqn} | {f.module_fqn for f in report.findings if f.module_fqn})
    unnamed = [m for m in modules if not is_named(report.summary, m)]
    check(not unnamed, "VAL-006", f"the summary does not name module(s) {unnamed} that the findings concern: {report.summary!r}", spec)
    check(
        is_named(report.summary, str(len(report.findings))),
        "VAL-006",
        f"the summary does not state the number of findings, {len(report.findings)}: {report.summary!r}",
        spec,
    )


@pytest.mark.fp8_property("VAL-007")
@family_examples
@given(spec=model_specs(), data=st.data())
def test_VAL_007_compute_counts_per_call_match_the_recipe(fp8_backend, spec, data):
    """Cheapest defects: checking that FP8 compute exists, not how much, so a duplicated matmul
    passes; and a rewrite that leaves a copy of an FP8 matmul in the graph, which nothing reads
    and which the graph's code still runs. The report's counts per (module, pass) must be the
    truth: the recipe's count of what reaches an output, to which a grad_input nobody needs that
    the graph keeps for an in-place op may be added (SPEC.md, "Counting what the outputs need");
    the graph must hold no other FP8 compute that no output needs; and a duplicate whose result
    reaches an output must fail strict validation naming its module."""
    case = traced("VAL-007", fp8_backend, spec)
    truth = fp8_compute_truth("VAL-007", fp8_backend, spec, case.gm, case.oracle)
    seen = {k: v for k, v in _report("VAL-007", fp8_backend, case.gm).compute_counts.items() if v}
    wrong = sorted((k for k in set(seen) | set(truth.needed) if not truth.admits(k, seen.get(k, 0))), key=str)
    check(
        not wrong,
        "VAL-007",
        f"expected FP8 compute counts {truth.admitted_counts()}"
        + (f" (the graph keeps {truth.kept} for in-place ops, by the suite's attribution)" if truth.kept else "")
        + f", the backend reports {seen}",
        spec,
    )
    dead = [f"node '{n.name}' ({n.target}) of {key[0]!r} in the {key[1]} pass" for n, key in truth.dead]
    check(
        not dead,
        "VAL-007",
        f"the backend's graph runs {len(dead)} FP8 compute node(s) that no output needs: " + "; ".join(dead[:4])
        + (f" and {len(dead) - 4} more" if len(dead) > 4 else "")
        + ". A GraphModule executes every node of its code: a copy a rewrite left behind runs for nothing; remove it",
        spec,
    )
    gm, oracle = fresh_copy(case)
    computes = attributed("VAL-007", fp8_backend, oracle, needed_fp8_compute(gm, fp8_ops("VAL-007", fp8_backend)), spec)
    if not computes:
        return  # all emulated: nothing to duplicate
    node = data.draw(st.sampled_from(computes), label="duplicated compute node")
    twin = rewrites.duplicate_compute(gm, node)
    exc = strict_error("VAL-007", fp8_backend, gm)
    check(
        exc is not None and names_module(exc, oracle.issued_by[node]),
        "VAL-007",
        f"'{twin.name}' duplicates '{node.name}' of {oracle.issued_by[node]!r} and its result reaches the outputs "
        f"(added with factor zero), one FP8 matmul more than the recipe issues; strict validation must fail naming that module, "
        f"saw: {exc!r}",
        spec,
    )


@pytest.mark.fp8_property("VAL-008")
@family_examples
@given(spec=model_specs())
def test_VAL_008_low_precision_compute_is_the_compute_the_backend_declares(fp8_backend, spec):
    """Cheapest defects: a backend whose passes know torch's first scaled-matmul API while its
    graphs call the second (or a kernel of its own), so they count, tag and keep nothing of it;
    and an op declared FP8 compute that the step calls on dequantized, high-precision operands.
    The suite finds low-precision compute by dtypes alone (two FP8 or packed FP4 tensors into a
    high-precision result): every such node must be an op the backend declares
    (``fp8_compute_ops``), and every declared op the step calls must take low-precision
    operands at its declared positions."""
    gm, oracle = traced_graph("VAL-008", fp8_backend, spec)
    declared = declared_ops("VAL-008", fp8_backend)
    for what, nodes in (
        ("low-precision compute the backend does not declare (fp8_compute_ops)", undeclared_low_precision_compute(gm, declared)),
        ("a declared FP8 compute op called on high-precision operands", declared_on_high_precision(gm, declared)),
    ):
        named = ", ".join(f"node '{n.name}' ({n.target}) of {oracle.issued_by.get(n)!r}" for n in nodes)
        check(not nodes, "VAL-008", f"{what}: {named}", spec)
