"""Dead FP8 compute (SPEC.md, "Counting what the outputs need"): FP8 compute counts when its result
reaches an output of its graph; a backend may drop the rest anywhere, and only a grad_input that
the recipe computes though the step does not need it may stay, kept by an in-place op.

The suite's definitions on small graphs, the suite's own duplicate, and backends that drop dead
FP8 compute (tests/dead_compute_backends.py) run through the VAL and BND rules. The mutants
that leave dead copies running are in tests/mutants/ (``DeadWeightMatmulCopies``,
``DeadCopiesLeftByRewrite``, ``DeadCopiesKeptInPlace``).
"""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from conformance.judge import rewrites
from conformance.judge.dead_compute import dead_fp8_compute, keepable_dead_compute, needed_fp8_compute
from conformance.observe.graphs import Fp8Ops, output_dependencies
from suite_runs import OTHER_BACKENDS, Run, failing, reads_shared_run

E4M3 = torch.float8_e4m3fn


def _operands():
    a = torch.randn(16, 16).to(E4M3)
    b = torch.randn(16, 16).to(E4M3).t()  # column-major, as _scaled_mm takes its second operand
    return a, b, torch.tensor(0.5), torch.tensor(2.0), torch.tensor(4.0)


def _step(a, b, scale_a, scale_b, other_scale):
    needed = torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=torch.float32)
    # Another computation whose result only an in-place op reads, as TorchAO scales a grad_input
    # nobody needs.
    kept = torch._scaled_mm(a, b, other_scale, scale_b, out_dtype=torch.float32)
    kept.mul_(2.0)
    # A copy of the needed matmul, read only by an in-place op.
    copy = torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=torch.float32)
    copy.mul_(2.0)
    return needed.relu()


def _traced_step():
    gm = make_fx(_step, tracing_mode="fake")(*_operands())
    computes = [n for n in gm.graph.nodes if n.target == torch.ops.aten._scaled_mm.default]
    needed, kept, copy = computes
    # A pure copy nothing reads, as a rewrite that rebuilt the matmul and kept the original leaves.
    with gm.graph.inserting_after(needed):
        unread = gm.graph.node_copy(needed)
    gm.recompile()
    return gm, needed, kept, copy, unread


def test_fp8_compute_counts_when_its_result_reaches_an_output():
    gm, needed, kept, copy, unread = _traced_step()
    ops = Fp8Ops()
    assert needed_fp8_compute(gm, ops) == [needed]
    assert set(dead_fp8_compute(gm, ops)) == {kept, copy, unread}
    # The in-place user of `kept` reaches nothing, so it does not make `kept` count, yet the
    # graph's code runs all three dead matmuls.
    assert "_scaled_mm" in gm.code and gm.code.count("torch.ops.aten._scaled_mm.default") == 4


def test_only_what_a_side_effect_alone_keeps_and_nothing_else_computes_may_stay():
    gm, _needed, kept, copy, unread = _traced_step()
    # `copy` is kept by its in-place op too, but computes what the needed matmul computes: a copy
    # of needed compute is never the grad_input the allowance covers; `unread` has no side effect.
    assert keepable_dead_compute(gm, Fp8Ops()) == [kept]
    assert copy not in keepable_dead_compute(gm, Fp8Ops()) and unread not in keepable_dead_compute(gm, Fp8Ops())


def test_the_suites_duplicate_reaches_the_outputs_and_changes_no_value():
    gm = make_fx(_step, tracing_mode="fake")(*_operands())
    needed = needed_fp8_compute(gm, Fp8Ops())[0]
    args = _operands()
    before = gm(*args)
    twin = rewrites.duplicate_compute(gm, needed)
    assert twin in output_dependencies(gm) and needed in output_dependencies(gm)
    assert needed_fp8_compute(gm, Fp8Ops()) == [needed, twin]
    assert torch.equal(gm(*args), before)
    gm.graph.lint()


def test_a_split_that_drops_the_grad_input_kept_in_place_is_bitwise_right_and_places_what_is_needed():
    from conformance.draw.strategies import runnable_recipes

    if "rowwise" not in runnable_recipes():
        pytest.skip("this torch's CPU _scaled_mm cannot run rowwise scales (torch 2.11: tensorwise only)")
    from conformance.backends.makefx_trainer import check_fp8_graph, run_train_step
    from conformance.run.harness import fp8_ops
    from conformance.draw.models import build_model
    from conformance.draw.models import LayerSpec, ModelSpec
    from dead_compute_backends import MakeFxSplitWithoutDeadCode

    # A first rowwise layer whose input needs no gradient: autograd computes its grad_input,
    # TorchAO scales it in place, and torch's dead-code elimination keeps both in the step.
    spec = ModelSpec(in_features=16, layers=(LayerSpec(width=16, recipe="rowwise"), LayerSpec(width=16, recipe="tensorwise")),
                     input_requires_grad=False)
    backend = MakeFxSplitWithoutDeadCode()
    model, args = build_model(spec)
    gm = backend.trace_joint(model, args)
    ops = fp8_ops("BND-002", backend)
    (kept,) = dead_fp8_compute(gm, ops)
    assert keepable_dead_compute(gm, ops) == [kept]
    split = backend.split_stage(gm)
    assert all(not dead_fp8_compute(part, ops) for part in split.parts.values())
    assert kept.name not in {n.name for part in split.parts.values() for n in part.graph.nodes}
    assert sum(len(needed_fp8_compute(part, ops)) for part in split.parts.values()) == len(needed_fp8_compute(gm, ops))
    for part in split.parts.values():  # each callable alone passes the trainer's own check
        check_fp8_graph(part, strict=True)
    grads = (torch.randn(16, 16),)
    (joint_out, joint_grads), (split_out, split_grads) = (run_train_step(gm, model, args, grads, fn=fn) for fn in (None, split.run))
    assert all(torch.equal(a, b) for a, b in zip(joint_out, split_out))
    assert joint_grads.keys() == split_grads.keys() and all(torch.equal(joint_grads[k], split_grads[k]) for k in joint_grads)


#: The VAL and BND rules that count FP8 compute or casts, and those that run what was dropped.
_RULES = ("VAL-001", "VAL-004", "VAL-007", "BND-001", "BND-002", "BND-003", "BND-004", "BND-005", "BND-006", "BND-007")
#: Models per property: enough to show a backend conforms; whether a rule bites is its mutants'.
_EXAMPLES = 5
#: In the plan of the other backends (tests/suite_runs.py: other_backend_runs): one process.
SHARED_RUNS = _RUNS = [
    Run("reference-eliminating-dead-code", "dead_compute_backends:ReferenceEliminatingDeadCode", _RULES, _EXAMPLES),
    Run("makefx-without-dead-code", "dead_compute_backends:MakeFxWithoutDeadCode", _RULES, _EXAMPLES),
    Run("makefx-split-without-dead-code", "dead_compute_backends:MakeFxSplitWithoutDeadCode", _RULES, _EXAMPLES),
    Run("makefx-counting-what-outputs-need", "dead_compute_backends:MakeFxCountingWhatOutputsNeed", ("VAL-004", "VAL-007"), _EXAMPLES),
]


@pytest.fixture(scope="module")
def dead_compute_runs(other_backend_runs):
    return other_backend_runs


@reads_shared_run(OTHER_BACKENDS)
@pytest.mark.parametrize("run", _RUNS, ids=lambda r: r.label)
def test_a_backend_that_drops_dead_fp8_compute_passes_the_rules_that_count_it(dead_compute_runs, run):
    statuses, out = dead_compute_runs[run.label].require()
    assert not failing(statuses), f"{run.backend} fails {failing(statuses)}:\n{out[-4000:]}"
    assert {p for p, row in statuses.items() if row["status"] == "pass"} >= set(run.properties), statuses
