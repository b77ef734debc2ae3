"""The contract points a peer trainer relies on, checked directly: error locations read from a
message, empty subjects as failures, a split runner watched, notes reaching the report."""

from __future__ import annotations

import pytest
import torch
import torch.fx

from conformance.report import notes
from conformance.api import StageSplit, ValidationFailure
from conformance.run.harness import names_module, names_pass, require_subject
from conformance.plugin.report import NOTE_KEY, TestRecord, property_row, record_outcome
from conformance.api.spec import get_property
from conformance.run.stages import split_step


def test_a_location_is_read_from_the_attribute_when_set_else_from_the_message():
    plain = ValidationFailure("('layers.1', 'float8_linear', 'backward'): 0 FP8 matmul(s), expected 2")
    assert names_module(plain, "layers.1") and names_pass(plain, "backward")
    assert not names_module(plain, "layers.10") and not names_pass(plain, "forward")
    assert not names_module(ValidationFailure("module layers.10 lost FP8"), "layers.1")
    wrong = ValidationFailure("layers.1 backward")
    wrong.module_fqn = "layers.2"  # an attribute that is set must be right
    assert not names_module(wrong, "layers.1")


def test_an_empty_subject_fails_the_property_saying_so():
    assert require_subject([1], "REG-002", "regions") == [1]
    with pytest.raises(pytest.fail.Exception, match=r"(?s)\[REG-002\].*regions\(\) reported no region.*nothing to check"):
        require_subject([], "REG-002", "regions() reported no region")


def _part(fn):
    return torch.fx.symbolic_trace(fn)


def _split(run):
    return StageSplit(_part(lambda x: x * 2), _part(lambda y: y + 1), _part(lambda z: z - 1), run=run)


def test_a_runner_that_calls_its_graphs_once_in_order_passes_the_watch():
    def run(x):
        a = split.forward(x)
        b = split.backward_input(a)
        return split.backward_weight(b)

    split = _split(run)
    step, violation = split_step(split)
    assert torch.equal(step(torch.ones(2)), torch.full((2,), 2.0))
    assert violation() is None
    assert "forward" not in vars(split.forward)  # the watch is taken off again


def test_a_runner_that_skips_a_graph_or_feeds_dw_its_own_values_is_caught():
    split = _split(lambda x: split.backward_weight(split.forward(x)))
    step, violation = split_step(split)
    step(torch.ones(2))
    assert "once each, in that order" in violation()

    def computes(x):
        split2.backward_input(split2.forward(x))
        return split2.backward_weight(x * 3)  # a value none of the graphs returned

    split2 = _split(computes)
    step, violation = split_step(split2)
    step(torch.ones(2))
    assert "computed them itself" in violation()


def test_a_split_without_runner_must_give_the_aot_convention():
    bare = StageSplit(_part(lambda x: x), _part(lambda x: x), _part(lambda x: x))
    assert "num_outputs" in bare.missing_convention()
    assert _split(lambda x: x).missing_convention() == ()


def test_notes_of_a_test_reach_its_report_row():
    notes.note("recipe not checked: no recipe recorded")
    notes.note("recipe not checked: no recipe recorded")
    taken = notes.take()
    assert taken == ["recipe not checked: no recipe recorded"] and notes.take() == []

    class Report:
        nodeid, when, failed, skipped, passed, longrepr = "t::PROV", "call", False, False, True, None
        user_properties = [("fp8_property", "PROV-002"), (NOTE_KEY, taken[0])]

    records: dict[str, TestRecord] = {}
    record_outcome(records, Report())
    row = property_row(get_property("PROV-002"), list(records.values()))
    assert row["status"] == "pass" and row["notes"] == taken


def test_the_run_device_is_the_one_serving_names_and_cpu_otherwise():
    from conformance.run import harness
    from conformance.backends.makefx import MakeFxBackend

    assert harness.device() == "cpu"
    with harness.serving(MakeFxBackend(), "cuda"):
        assert harness.device() == "cuda"
    assert harness.device() == "cpu"


def test_the_watch_sees_deferred_graph_modules_such_as_fp8confs_own_split_parts():
    # fp8conf's split parts write their code on first call and then call self.forward again;
    # a watch that only replaced forward on the instance recursed forever on them.
    import fp8conf
    from stack_steps import DIM, TOKENS, traced

    from torch.fx._lazy_graph_module import _LazyGraphModule

    model, x, gm = traced(1)
    parts = fp8conf.split_stage(gm)
    deferred = [p for p in parts.parts.values() if isinstance(p, _LazyGraphModule) and p._needs_recompile()]
    assert deferred, "the parts were to write their code on first call"
    split = StageSplit(parts.forward, parts.backward_input, parts.backward_weight, run=lambda primals, tangents: parts.run(primals, tangents))
    step, violation = split_step(split)
    grad = torch.randn(TOKENS, DIM)
    (out,), grads = fp8conf.run_joint(gm, model, (x,), (grad,), fn=step)
    assert violation() is None
    (want,), want_grads = fp8conf.run_joint(gm, model, (x,), (grad,))
    torch.testing.assert_close(out, want)
    assert grads.keys() == want_grads.keys()
