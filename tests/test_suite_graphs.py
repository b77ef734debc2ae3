"""The suite's own ground truth: its graph copies and the ops it counts as FP8 compute."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conformance.backends.reference import ReferenceBackend
from conformance.observe.graphs import Fp8Ops, copy_graph_module, fp8_compute_nodes, run_for_side_effects_only
from conformance.run.harness import fp8_compute_truth, fp8_ops, traced
from conformance.draw.models import LayerSpec, ModelSpec

SPEC = ModelSpec(in_features=32, layers=(LayerSpec(width=32, recipe="tensorwise"), LayerSpec(width=32, recipe="mxfp8")))
REFERENCE = ReferenceBackend()


def _annotated(gm):
    for node in gm.graph.nodes:
        node.meta["custom"] = {"trainer": {"stage": 0}, "compile_with_inductor": {"inductor_region": 0}}
    return gm


def test_a_copy_owns_its_meta_dicts_and_the_dicts_inside_them():
    gm = _annotated(traced("REG-007", REFERENCE, SPEC).gm)
    copy = copy_graph_module(gm)
    assert copy.code == gm.code
    for old, new in zip(gm.graph.nodes, copy.graph.nodes):
        assert new.meta is not old.meta and new.meta["custom"] is not old.meta["custom"]
        assert new.meta["custom"]["trainer"] is not old.meta["custom"]["trainer"]
        assert new.meta["custom"]["compile_with_inductor"] is not old.meta["custom"]["compile_with_inductor"]
        if "val" in old.meta:  # fake tensors are shared, not copied
            assert new.meta["val"] is old.meta["val"]
        new.meta["custom"]["trainer"]["stage"] = 1
        new.meta["custom"]["compile_with_inductor"]["inductor_region"] = 7
    assert all(n.meta["custom"] == {"trainer": {"stage": 0}, "compile_with_inductor": {"inductor_region": 0}} for n in gm.graph.nodes)


def test_a_copy_is_torchs_graph_copy_node_for_node():
    # The copy sets each call's arguments after making the node (skipping create_node's walk of
    # them for raw SymInts); the graph must be the one torch's own graph_copy makes: names, ops,
    # targets, arguments, types, and each node's users in the same order.
    gm = traced("REG-007", REFERENCE, SPEC).gm
    node = next(n for n in gm.graph.nodes if n.op == "call_function" and n.args)
    node.kwargs = {**node.kwargs, "_probe": node.args[0]}  # a node input held in kwargs too
    torchs = torch.fx.Graph()
    torchs.output(torchs.graph_copy(gm.graph, {}))
    ours = copy_graph_module(gm).graph

    def described(graph):
        return [(n.op, n.name, str(n.target), str(n.args), str(n.kwargs), n.type, [u.name for u in n.users])
                for n in graph.nodes]

    assert described(ours) == described(torchs)


def test_a_copy_writes_its_code_only_when_asked_for_it():
    # Most properties only read a copy's nodes: writing every copy's code was a third of a run.
    from torch.fx._lazy_graph_module import _LazyGraphModule

    case = traced("REG-007", REFERENCE, SPEC)
    copy = copy_graph_module(case.gm)
    assert isinstance(copy, _LazyGraphModule) and copy._needs_recompile()
    assert copy.code == case.gm.code and not copy._needs_recompile()
    copy.graph.eliminate_dead_code()  # a rewrite, then recompile(), as a backend does: deferred again
    copy.recompile()
    assert copy._needs_recompile() and copy.code == case.gm.code


def test_every_traced_case_holds_its_own_copy_of_the_cached_graph():
    first, second = traced("REG-007", REFERENCE, SPEC), traced("REG-007", REFERENCE, SPEC)
    assert first.gm is not second.gm and first.model is second.model
    _annotated(first.gm)
    assert not any("custom" in n.meta for n in second.gm.graph.nodes)
    assert not any("custom" in n.meta for n in traced("REG-007", REFERENCE, SPEC).gm.graph.nodes)
    # The oracle follows the copy it came with.
    assert set(first.oracle.issued_by) <= set(first.gm.graph.nodes)


def test_the_e8m0_op_is_fp8_compute_only_for_the_backend_that_names_it():
    gm = traced("VAL-007", REFERENCE, SPEC).gm
    e8m0 = [n for n in fp8_compute_nodes(gm, fp8_ops("VAL-007", REFERENCE)) if n.target == REFERENCE.e8m0_op()]
    assert e8m0, "the reference's MX layer computes with its e8m0 op"
    assert not any(n.target == REFERENCE.e8m0_op() for n in fp8_compute_nodes(gm, Fp8Ops()))
    # torch's scaled matmuls count for every backend.
    assert {str(n.target) for n in fp8_compute_nodes(gm, Fp8Ops())} == {str(torch.ops.aten._scaled_mm.default)}


def test_a_backend_without_e8m0_is_never_asked_for_its_op():
    class Float8(ReferenceBackend):
        capabilities = frozenset({"provenance", "validation"})

        def e8m0_op(self):
            raise AssertionError("e8m0_op() of a backend that does not claim e8m0")

    declared = Fp8Ops.of(Float8()).ops
    # torch's scaled matmuls, and whatever this process registered with fp8conf (the worked
    # example's kernel, once imported), never the e8m0 op.
    assert declared[: len(Fp8Ops().ops)] == Fp8Ops().ops
    assert not any("scaled_mm_e8m0" in op.name for op in declared)


def test_what_runs_is_what_the_outputs_need_plus_side_effects_and_their_inputs():
    from conformance.observe.graphs import live_nodes
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(x, w):
        kept = x * 2  # only an in-place op, whose result nothing returns, uses it
        kept.mul_(w)
        x.sin()  # dead: pure, and nothing uses it
        return x + w

    gm = make_fx(step)(torch.randn(4), torch.randn(4))
    names = {n.name: n for n in gm.graph.nodes}
    live = {n.name for n in live_nodes(gm)}
    in_place = [n for n in names if n.startswith("mul_")]
    assert in_place and set(in_place) <= live, (in_place, live)
    assert "mul" in live  # what the in-place op needs runs too
    assert not any(n.startswith("sin") for n in live), live
    # run only for the side effect: the in-place op and its input, not the output's add
    only = {n.name for n in run_for_side_effects_only(gm)}
    assert only == set(in_place) | {"mul"}, only


#: A first rowwise layer whose input needs no gradient: autograd computes its grad_input anyway,
#: and TorchAO scales that rowwise matmul's result in place.
FIRST_ROWWISE = ModelSpec(
    in_features=16, layers=(LayerSpec(width=16, recipe="rowwise"), LayerSpec(width=16, recipe="tensorwise")), input_requires_grad=False
)


def _makefx_with_torchao_linears():
    """The makefx backend shown TorchAO's float8 linears (not its own): TorchAO's rowwise recipe
    scales a grad_input in place, which make_fx keeps."""
    from conformance.backends.makefx import MakeFxBackend

    class MakeFxWithTorchAO(MakeFxBackend):
        capabilities = MakeFxBackend.capabilities - {"float8_modules"}

    return MakeFxWithTorchAO()


def test_the_ground_truth_is_the_recipes_and_admits_a_grad_input_kept_by_an_in_place_op():
    recipe = FIRST_ROWWISE.expected_compute_counts()
    assert recipe[("layers.0", "backward")] == 1  # grad_weight only: the step needs no grad_input
    # make_fx keeps the in-place op, and with it the matmul it scales, which no output needs: the
    # truth is the recipe's, and a count may add that matmul (attributed by the suite's oracle).
    makefx = _makefx_with_torchao_linears()
    case = traced("VAL-007", makefx, FIRST_ROWWISE)
    truth = fp8_compute_truth("VAL-007", makefx, FIRST_ROWWISE, case.gm, case.oracle)
    assert truth.needed == recipe and truth.kept == {("layers.0", "backward"): 1} and not truth.dead, truth
    assert truth.admits(("layers.0", "backward"), 1) and truth.admits(("layers.0", "backward"), 2)
    assert not truth.admits(("layers.0", "backward"), 3) and not truth.admits(("layers.0", "forward"), 2)
    # AOT export is functional: nothing is kept, the truth is the recipe's.
    case = traced("VAL-007", REFERENCE, FIRST_ROWWISE)
    truth = fp8_compute_truth("VAL-007", REFERENCE, FIRST_ROWWISE, case.gm, case.oracle)
    assert (truth.needed, truth.kept, truth.dead) == (recipe, {}, ())


def test_a_kept_matmul_beyond_an_unneeded_grad_input_is_dead_compute():
    # The same graph judged as if the input needed a gradient: no grad_input goes unneeded, so
    # the kept matmul is not admitted; it runs for nothing, and the graph holding it fails VAL-007.
    makefx = _makefx_with_torchao_linears()
    case = traced("VAL-007", makefx, FIRST_ROWWISE)
    needs_grad = dataclasses.replace(FIRST_ROWWISE, input_requires_grad=True)
    truth = fp8_compute_truth("VAL-007", makefx, needs_grad, case.gm, case.oracle)
    assert truth.needed == needs_grad.expected_compute_counts() and truth.kept == {}
    assert [key for _, key in truth.dead] == [("layers.0", "backward")]


def test_fp8_compute_the_suites_attribution_gives_to_no_module_is_a_verdict_with_its_evidence():
    # A pass that rebuilt the node without its metadata leaves the suite's ground truth blank: the
    # property fails naming the node, its pass and sequence number, never a TypeError in the suite.
    from conformance.observe.graphs import Oracle
    from conformance.run.harness import attributed

    def step(a, b, sa, sb):
        return torch._scaled_mm(a, b, sa, sb, out_dtype=torch.float32)

    e4m3 = torch.float8_e4m3fn
    gm = torch.fx.experimental.proxy_tensor.make_fx(step)(
        torch.zeros(16, 16).to(e4m3), torch.zeros(16, 16).to(e4m3).t(), torch.ones(()), torch.ones(()))
    (node,) = [n for n in gm.graph.nodes if n.op == "call_function" and "scaled_mm" in str(n.target)]
    oracle = Oracle({node: None}, frozenset({7}), {node: None})
    assert attributed("VAL-002", REFERENCE, Oracle({node: "layers.0"}, frozenset(), {}), [node]) == [node]
    with pytest.raises(pytest.fail.Exception) as failed:
        attributed("VAL-002", REFERENCE, oracle, [node])
    text = str(failed.value)
    assert "[VAL-002]" in text and f"'{node.name}'" in text and "forward" in text and "module annotations" in text
