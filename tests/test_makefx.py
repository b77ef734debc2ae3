"""The second in-tree backend, ``makefx`` (a make_fx + torch.autograd.grad trainer), passes every
property it claims, and the mutants of its contract points are caught on it.

The run is the suite itself in a subprocess, as the reference's is (tests/test_mutants.py), with
its profile, ``fp8conf-mutants`` (``fp8conf-ci`` without shrinking: derandomized), at 10
examples per structural property instead of 25. The whole-suite run is made once, by a module
fixture, and read by each test that judges it; makefx's mutants run with 25, on the properties
they break.
"""

from __future__ import annotations

import pytest

from mutants import peers
from suite_runs import OTHER_BACKENDS, POWER_EXAMPLES, TEST_TIMEOUT_S, Run, failing, reads_shared_run, run_suite

BACKEND = "conformance.backends.makefx:MakeFxBackend"
#: Models per property of its whole run: as many as the mutants built on it have in theirs
#: (tests/test_mutants.py), so each is caught on models this backend passes.
EXAMPLES = POWER_EXAMPLES
CLAIMED_AT_LEAST = {"provenance", "validation", "emulation", "regions", "graphpp", "fingerprint"}


def test_makefx_claims_the_contract_points_a_peer_needs():
    from conformance.backends.makefx import MakeFxBackend

    assert CLAIMED_AT_LEAST <= MakeFxBackend.capabilities
    assert not MakeFxBackend.provenance_has_recipe


def _first_rowwise_step():
    from conformance.backends.makefx_trainer import trace_train_step
    from conformance.draw.models import LayerSpec, ModelSpec, build_model

    # The first layer's input needs no gradient; autograd computes its grad_input anyway, and
    # TorchAO scales that rowwise matmul's result in place (``output *= scale``).
    spec = ModelSpec(in_features=16, layers=(LayerSpec(width=16, recipe="rowwise"),), input_requires_grad=False)
    model, args = build_model(spec)
    return trace_train_step(model, args), model, args


def _kept_in_place_ops(gm):
    """In-place ops of the step that no output depends on, with the FP8 matmul each scales."""
    from conformance.backends.makefx_trainer import is_fp8_matmul
    from conformance.observe.graphs import output_dependencies

    needed = output_dependencies(gm)
    return [(n, n.args[0]) for n in gm.graph.nodes
            if n.op == "call_function" and n.is_impure() and n not in needed and is_fp8_matmul(n.args[0])]


def test_a_traced_step_keeps_the_in_place_op_and_the_fp8_matmul_it_scales():
    import torch

    from conformance.backends.makefx_trainer import check_fp8_graph, module_provenance, phase_of

    gm, _, _ = _first_rowwise_step()
    kept = _kept_in_place_ops(gm)
    assert len(kept) == 1, gm.code
    in_place, matmul = kept[0]
    assert in_place.target == torch.ops.aten.mul_.Tensor and not in_place.users
    assert module_provenance(matmul)[0] == "layers.0" and phase_of(matmul) == "backward"
    # It runs, so the trainer's own check expects it: grad_weight and the kept grad_input.
    report = check_fp8_graph(gm, strict=True)
    assert report.counts[("layers.0", "backward")] == 2, report.counts


def test_the_split_runs_the_kept_in_place_op_in_backward_weight():
    from conformance.draw.strategies import runnable_recipes

    if "rowwise" not in runnable_recipes():
        pytest.skip("this torch's CPU _scaled_mm cannot run rowwise scales (torch 2.11: tensorwise only)")
    import torch

    from conformance.backends.makefx_stages import split_train_step
    from conformance.backends.makefx_trainer import run_train_step

    gm, model, args = _first_rowwise_step()
    (in_place, matmul), = _kept_in_place_ops(gm)
    runner = split_train_step(gm)
    placed = {name: {n.name for n in getattr(runner, name).graph.nodes} for name in ("forward", "backward_input", "backward_weight")}
    assert {in_place.name, matmul.name} <= placed["backward_weight"], placed
    assert not {in_place.name, matmul.name} & (placed["forward"] | placed["backward_input"]), placed
    grads = (torch.randn(16, 16),)
    (joint_out, joint_grads), (split_out, split_grads) = (run_train_step(gm, model, args, grads, fn=fn) for fn in (None, runner.run))
    assert all(torch.equal(a, b) for a, b in zip(joint_out, split_out))
    assert joint_grads.keys() == split_grads.keys() and all(torch.equal(joint_grads[k], split_grads[k]) for k in joint_grads)


#: Its whole run, in the plan of the other backends (tests/suite_runs.py: other_backend_runs).
SHARED_RUNS = [Run("makefx", BACKEND, examples=EXAMPLES)]


@pytest.fixture(scope="module")
def makefx_run(other_backend_runs):
    """The whole suite against makefx, once for the tests that read it."""
    return other_backend_runs["makefx"]


@reads_shared_run(OTHER_BACKENDS)
def test_makefx_passes_every_property_it_claims(makefx_run):
    statuses, out = makefx_run.require()
    failed = failing(statuses)
    assert not failed, f"makefx fails {failed}:\n{out[-4000:]}"
    # Its own MX linears (swizzled scales only) are drawn and judged; the MX recipes it lacks are not asked.
    assert statuses["MXS-001"]["status"] == statuses["MXS-002"]["status"] == "pass"
    assert statuses["NUM-005"]["status"] == "not_supported"
    assert "mxfp8_linear as conformance.backends.makefx_linear.MXTrainerLinear (built by convert_mx" in out, out[-3000:]


@reads_shared_run(OTHER_BACKENDS)
def test_makefx_passes_every_property_its_mutants_break(makefx_run):
    statuses, out = makefx_run.require()
    passed = {k for k, v in statuses.items() if v["status"] == "pass"}
    wanted = {m.KILLED_BY for m in peers.MAKEFX_MUTANTS}
    assert wanted <= passed, f"not passed: {sorted(wanted - passed)}"


@reads_shared_run(OTHER_BACKENDS)
def test_makefx_report_notes_that_the_recipe_is_not_checked(makefx_run):
    # The recipe is not checked for a backend that records none, and the report says so.
    statuses, _ = makefx_run.require()
    assert any("recipe not checked" in note for note in statuses["PROV-002"].get("notes", ())), statuses["PROV-002"]


@reads_shared_run(OTHER_BACKENDS)
def test_makefx_passes_the_fingerprint_rules_as_a_whole_step_key_over_recipe_names(makefx_run):
    # Its key covers registration order, structure and the whole job, its signature the modules
    # only: the rules of a whole-step scope pass, saying what they did not compare; its jobs
    # express no config field and its float8 linears are its own, so those changes are
    # not_supported, not failed.
    statuses, out = makefx_run.require()
    for property_id in ("FPR-001", "FPR-002", "FPR-003", "FPR-005", "FPR-006"):
        assert statuses[property_id]["status"] == "pass", out[-4000:]
    for property_id in ("FPR-002", "FPR-003", "FPR-005", "FPR-006"):
        assert any("whole_step" in note for note in statuses[property_id].get("notes", ())), statuses[property_id]
    assert statuses["FPR-005"]["outcomes"] == {"pass": 7, "not_supported": 2}, statuses["FPR-005"]
    assert statuses["FPR-001"]["outcomes"] == {"pass": 9, "not_supported": 3}, statuses["FPR-001"]
    # FPR-005 flips only what the jobs can express (nothing); FPR-001 flips any field (drawn, and
    # every one enumerated), which the trainer's own float8 linears (float8_modules) have no
    # TorchAO config to hold; its enumerations of every recipe change and emulate flip and of
    # every version change pass.
    assert any("expressible_config_fields []" in note for note in statuses["FPR-005"]["notes"])
    assert any("float8_modules" in note for note in statuses["FPR-001"]["notes"])


@reads_shared_run(OTHER_BACKENDS)
def test_makefx_artifacts_are_not_supported(makefx_run):
    statuses, _ = makefx_run.require()
    assert statuses["FPR-004"]["status"] == "not_supported", statuses["FPR-004"]  # artifacts are not claimed


@pytest.mark.timeout(TEST_TIMEOUT_S)  # above run_suite's hang guard, which speaks first
def test_a_backend_reporting_no_region_fails_the_region_rules_saying_so(tmp_path):
    statuses, out = run_suite("mutants.peers:NoRegions", ["REG-002", "REG-005"], tmp_path)
    for property_id in ("REG-002", "REG-005"):
        row = statuses[property_id]
        assert row["status"] == "fail", out[-3000:]
        assert "reported no region" in row["reproducer"]["message"], row["reproducer"]["message"]
        assert "Cannot sample" not in row["reproducer"]["message"]
