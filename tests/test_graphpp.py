"""GraphPP: the split's API, its bad-input errors, and torch.distributed.pipelining schedules over
GraphPP stages in 2 gloo processes."""

from __future__ import annotations

import functools

import pytest
import torch

import fp8conf
from conformance.judge import rewrites
from conformance.draw.strategies import runnable_recipes
from fp8conf.tools.example_models import build_stack
from fp8conf.compile import compile_split
from fp8conf.graph.split import split_stage
from fp8conf.graph.trace import JOINT_SIGNATURE_META_KEY
from fp8conf.graph.validate import SIBLING_COMPUTE_META_KEY
from fp8conf.tools.pipeline_check import launch, stage_indices
from fp8conf.torch_internals import v_schedules_start_on_gloo


@functools.lru_cache(maxsize=None)
def _traced(recipe, first):
    model = build_stack(32, 2, recipe)
    x = torch.randn(16, 32, requires_grad=not first)
    return model, x, fp8conf.trace_joint(model, (x,))


def _stage(recipe="tensorwise", *, first=False, cse=False):
    """A 2-block stage traced once per (recipe, first); each call gets its own graph to change."""
    model, x, gm = _traced(recipe, first)
    gm = fp8conf.copy_graph_module(gm)
    return model, x, (rewrites.eliminate_common_subexpressions(gm) if cse else gm)


def _same(a, b):
    (out_a, grads_a), (out_b, grads_b) = a, b
    return all(torch.equal(x, y) for x, y in zip(out_a, out_b)) and grads_a.keys() == grads_b.keys() and all(
        torch.equal(grads_a[k], grads_b[k]) for k in grads_a
    )


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
@pytest.mark.parametrize("first", [False, True], ids=["middle-stage", "first-stage"])
def test_split_reproduces_the_joint_step_bitwise(recipe, first):
    if recipe not in runnable_recipes():
        pytest.skip(f"this torch's CPU _scaled_mm cannot run {recipe} scales (torch 2.11: tensorwise only)")
    model, x, gm = _stage(recipe, first=first, cse=True)
    split = split_stage(gm)
    grad = torch.randn(16, 32)
    assert _same(fp8conf.run_joint(gm, model, (x,), (grad,)), fp8conf.run_joint(gm, model, (x,), (grad,), fn=split.run))
    assert split.input_grads == (() if first else ("input.0",))


def test_regionally_compiled_callables_match_the_joint_step():
    model, x, gm = _stage("tensorwise", cse=True)
    split = split_stage(gm)
    compiled = compile_split(split, mode="regional")
    grad = torch.randn(16, 32)
    expected = fp8conf.run_joint(gm, model, (x,), (grad,))
    seen = fp8conf.run_joint(gm, model, (x,), (grad,), fn=lambda p, t: split.run(p, t, compiled))
    for key in expected[1]:
        torch.testing.assert_close(seen[1][key], expected[1][key], rtol=1e-2, atol=1e-2)


def test_first_stage_backward_input_is_empty_and_carries_the_output_gradient():
    _, _, gm = _stage(first=True)
    split = split_stage(gm)
    assert not [n for n in split.backward_input.graph.nodes if n.op == "call_function"]
    assert split.input_grads == ()


def test_shared_quantization_crosses_into_backward_weight_as_fp8_placeholders():
    _, _, gm = _stage("tensorwise", cse=True)
    split = split_stage(gm)
    fp8_placeholders = [
        p for p in split.backward_weight.graph.find_nodes(op="placeholder") if fp8conf.graph.roles.is_fp8_dtype(getattr(p.meta["val"], "dtype", None))
    ]
    assert len(fp8_placeholders) == 4  # the output gradient of each of the 4 linears, cast once in dI
    regions = fp8conf.identify_fp8_regions(split.backward_weight)
    assert len(regions) == 4 and all(r.complete for r in regions)
    casts = lambda g: sum(1 for n in g.graph.nodes if fp8conf.classify_node(n) is fp8conf.OpRole.CAST)
    assert casts(split.backward_input) + casts(split.backward_weight) == sum(
        1 for n in gm.graph.nodes if fp8conf.classify_node(n) is fp8conf.OpRole.CAST and fp8conf.node_passes(gm.graph)[n] == "backward"
    )


def test_callables_validate_strictly_only_with_their_siblings_counted():
    _, _, gm = _stage()
    split = split_stage(gm)
    for part in split.parts.values():
        fp8conf.validate_fp8_graph(part, strict=True)
    alone = split.backward_weight
    with pytest.raises(fp8conf.UnsupportedLoweringError, match="forward pass"):
        fp8conf.validate_fp8_graph(alone, strict=True, sibling_compute={})
    alone.meta.pop(SIBLING_COMPUTE_META_KEY)
    with pytest.raises(fp8conf.UnsupportedLoweringError, match="forward pass"):
        fp8conf.validate_fp8_graph(alone, strict=True)


def test_strict_validation_runs_on_the_whole_stage_before_the_cut():
    _, _, gm = _stage()
    compute = next(n for n in gm.graph.nodes if fp8conf.is_fp8_compute(n))
    rewrites.rebuild_without_meta(gm, compute)
    with pytest.raises(fp8conf.MissingProvenanceError):
        split_stage(gm)


def test_a_stage_without_parameter_gradients_is_refused_with_a_clear_error():
    class NoParams(torch.nn.Module):
        def forward(self, x):
            return torch.relu(x) * 2

    gm = fp8conf.trace_joint(NoParams(), (torch.randn(4, 4, requires_grad=True),))
    with pytest.raises(fp8conf.NoQuantizedModulesError):
        split_stage(gm)  # strict: no FP8 at all is a validation error first
    with pytest.warns(fp8conf.FP8ValidationWarning), pytest.raises(fp8conf.FP8GraphSplitError, match="no parameter gradient"):
        split_stage(gm, strict=False)


def test_a_graph_without_its_joint_signature_is_refused_not_guessed():
    _, _, gm = _stage()
    for node in gm.graph.find_nodes(op="placeholder"):
        node.meta.pop("desc")  # descriptors are read once, when tracing
    split_stage(gm)
    gm.meta.pop(JOINT_SIGNATURE_META_KEY)
    with pytest.raises(fp8conf.FP8GraphSplitError, match="joint signature"):
        split_stage(gm)


def test_stages_are_placed_as_the_schedules_place_them():
    assert stage_indices("Interleaved1F1B", 1, 2, 2) == [1, 3]  # looped
    assert stage_indices("ZBVZeroBubble", 1, 2, 2) == [1, 2]  # V-shaped
    with pytest.raises(fp8conf.FP8ConfigError, match="one stage per rank"):
        stage_indices("1F1B", 0, 2, 2)
    with pytest.raises(fp8conf.FP8ConfigError, match="exactly two stages per rank"):
        stage_indices("DualPipeV", 0, 2, 1)
    with pytest.raises(fp8conf.FP8ConfigError, match="ZBVZeroBubble"):
        stage_indices("NoSuchSchedule", 0, 2, 1)


def _assert_matches_the_unsplit_step(check, *, stages, parameters):
    # Eager stages match bitwise; compiled ones run the remainder between their FP8 regions
    # through Inductor, which rounds float32 differently from eager (2e-10 seen on CPU).
    assert check.bitwise_equal or (check.compile and check.max_abs_diff <= 1e-6), check.summary()
    assert check.parameters == parameters and check.microbatches == 4
    # No cast repeated (or dropped) because the schedule ran dW apart from dI, on every stage.
    assert check.casts_run == check.casts_unsplit and len(check.casts_run) == stages, check.summary()
    assert check.each_part_once, check.summary()
    # Every rank computed during its profiled step and waited at some point of it.
    assert sorted(check.idle_share) == [0, 1] and all(0 < v < 1 for v in check.idle_share.values()), check.summary()


def test_idle_share_counts_the_time_a_real_trace_spends_outside_compute_ops():
    import time

    from torch.profiler import profile, record_function

    from fp8conf.tools.pipeline_idle import STEP_LABEL, idle_share

    a = torch.randn(256, 256)
    with profile() as prof:
        with record_function(STEP_LABEL):
            start = time.perf_counter()
            a @ a
            time.sleep(0.05)  # no operator runs: idle
            for label in ("PP:0F0", "Forward 1"):  # a schedule's action labels are not compute by themselves
                with record_function(label):
                    time.sleep(0.05)
            a @ a
            wall = time.perf_counter() - start
    share = idle_share(prof.events(), device="cpu")
    assert 0.15 / wall - 0.05 <= share < 1, (share, wall)


@pytest.mark.slow
def test_zero_bubble_schedule_over_regionally_compiled_stages_matches_the_unsplit_step():
    # InterleavedZeroBubble: I and W as separate actions, W deferred; FP8 regions compiled per callable.
    check = launch(schedule="InterleavedZeroBubble", ranks=2, stages_per_rank=1, microbatches=4, compile="regional")
    _assert_matches_the_unsplit_step(check, stages=2, parameters=10)
    assert check.deferred_weight_steps > 0, check.summary()


@pytest.mark.slow
def test_v_shaped_schedule_with_two_stages_per_rank_matches_the_unsplit_step_bitwise():
    starts = v_schedules_start_on_gloo()
    if not starts.found:
        with pytest.raises(fp8conf.FP8ConfigError, match="ZBVZeroBubble cannot start over gloo"):
            launch(schedule="ZBVZeroBubble", ranks=2, stages_per_rank=2, microbatches=4)
        pytest.skip(f"refused before any process starts: {starts.reason}")
    # ZBVZeroBubble: stages 0 and 3 on rank 0, 1 and 2 on rank 1 (handed over locally), I and W apart.
    check = launch(schedule="ZBVZeroBubble", ranks=2, stages_per_rank=2, microbatches=4)
    _assert_matches_the_unsplit_step(check, stages=4, parameters=18)
    assert check.deferred_weight_steps > 0, check.summary()
