"""A regional unit Inductor cannot compile: compiled again where its CPU C++ code did not build,
else kept eager (strict=False) or refused naming its region and torch's error (strict=True);
each said once on the ``fp8conf`` logger and counted in ``CompiledJoint.fallbacks``
(:mod:`fp8conf.compile.unit_failures`). On CPU."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import fp8conf
from conformance.draw.strategies import runnable_recipes
from fp8conf import log
from fp8conf.compile import region_compile
from fp8conf.compile.unit_failures import RETRY_PATCHES
from stack_steps import assert_matches_eager, traced

DIM, HIDDEN, TOKENS = 64, 128, 32
RETRY = "Inductor's cpp.max_horizontal_fusion_size=1"
assert RETRY_PATCHES == {"cpp.max_horizontal_fusion_size": 1}  # what the messages below name


@pytest.fixture
def fresh_log(monkeypatch, caplog):
    monkeypatch.setattr(log, "_said", set())  # what this process already said is said again here
    caplog.set_level(logging.WARNING, logger="fp8conf")
    return caplog


def _said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "fp8conf"]


class SwiGLU(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = torch.nn.Linear(DIM, HIDDEN, bias=False)
        self.w3 = torch.nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = torch.nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        return x + self.w2(F.silu(self.w1(x)) * self.w3(x))


def _swiglu_step():
    """A bf16 SwiGLU block under TorchAO's rowwise Float8Linear, traced: its backward's unit holds
    two equal column-wise amax reductions of the input (w1's and w3's weight-gradient casts),
    whose fused vectorized bf16 store Inductor's C++ code generation declares twice (torch 2.13)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if "rowwise" not in runnable_recipes():
        pytest.skip("this torch's CPU _scaled_mm cannot run rowwise scales (torch 2.11: tensorwise only)")
    torch.manual_seed(0)
    model = convert_to_float8_training(SwiGLU().to(torch.bfloat16), config=Float8LinearConfig.from_recipe_name("rowwise"))
    x = torch.randn(TOKENS, DIM, dtype=torch.bfloat16, requires_grad=True)
    return model, x, fp8conf.trace_joint(model, (x,))


@pytest.mark.parametrize("workers", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_a_bf16_rowwise_swiglu_block_compiles_regionally_by_the_retry_and_matches_eager(workers, fresh_log):
    model, x, gm = _swiglu_step()
    # Inductor computes bf16 ops in float32 between loads and stores unless told to round as
    # eager does: so told, the compiled step must give eager's values bit for bit, which the
    # retry's setting (a scheduling choice) may not change.
    with torch._inductor.config.patch(emulate_precision_casts=True):
        compiled = fp8conf.compile_joint(gm, mode="regional", strict=True, workers=workers)
    retried = [f for f in compiled.fallbacks if f.startswith("CPU C++ codegen:")]
    assert len(retried) == 1, compiled.fallbacks
    assert "FP8 region w2/backward/call0/0" in retried[0] and "CppCompileError" in retried[0], retried
    assert f"compiled again with {RETRY}" in retried[0], retried
    said = [line for line in _said(fresh_log) if "CPU C++ codegen" in line]
    assert len(said) == 1 and "conflicting declaration" in said[0], _said(fresh_log)
    assert not {n.name for r in compiled.regions for n in r.nodes} & compiled.eager_nodes  # every region compiled
    torch.manual_seed(1)
    args, grad = (torch.randn_like(x).requires_grad_(),), (torch.randn(TOKENS, DIM, dtype=torch.bfloat16),)
    (out_eager,), grads_eager = fp8conf.run_joint(gm, model, args, grad)
    (out_compiled,), grads_compiled = fp8conf.run_joint(gm, model, args, grad, fn=compiled.fn)
    assert torch.equal(out_compiled, out_eager)
    assert grads_compiled.keys() == grads_eager.keys()
    for name, value in grads_eager.items():
        assert torch.equal(grads_compiled[name], value), f"grad of {name}"


class _Attempts(list):
    """The Inductor settings of each compile of the failing unit; ``factory`` makes its error."""

    factory = None


@pytest.fixture
def failing_unit(monkeypatch):
    """The first unit compiled fails every time it is compiled, with a C++ compile error of
    Inductor's (a test may set another ``factory``): the unit's compiles, each the Inductor
    settings it was asked for."""
    from torch._inductor.exc import CppCompileError

    real, attempts, failing = region_compile.compile_unit, _Attempts(), []
    attempts.factory = lambda: CppCompileError(["g++", "kernel.cpp"], "kernel.cpp:7:3: error: forced by the test\n")

    def compile_unit(submodule, fake_inputs, **kwargs):
        if not failing:
            failing.append(submodule)
        if submodule is failing[0]:
            attempts.append(kwargs.get("config_patches"))
            raise attempts.factory()
        return real(submodule, fake_inputs, **kwargs)

    monkeypatch.setattr(region_compile, "compile_unit", compile_unit)
    return attempts


def test_a_unit_whose_cpp_code_never_compiles_runs_eagerly_when_not_strict(failing_unit, fresh_log):
    model, x, gm = traced(1)
    compiled = fp8conf.compile_joint(gm, mode="regional", strict=False)
    assert failing_unit == [None, RETRY_PATCHES], "compiled once as usual, then once more under the retry's settings"
    (fallback,) = [f for f in compiled.fallbacks if f.startswith("regional compile:")]
    assert "Inductor could not compile FP8 region blocks.0." in fallback, fallback
    assert "CppCompileError: C++ compile error: forced by the test" in fallback and f"nor with {RETRY}" in fallback
    said = [line for line in _said(fresh_log) if "regional compile" in line]
    assert len(said) == 1 and "runs eagerly" in said[0], _said(fresh_log)
    assert compiled.eager_nodes & {n.name for r in compiled.regions for n in r.nodes}, "the unit's region is named eager"
    assert_matches_eager(gm, model, x, compiled.fn, seed=0)


def test_a_unit_whose_cpp_code_never_compiles_is_refused_when_strict_naming_region_and_error(failing_unit, fresh_log):
    _, _, gm = traced(1)
    with pytest.raises(fp8conf.RegionCompileError) as caught:
        fp8conf.compile_joint(gm, mode="regional", strict=True)
    assert failing_unit == [None, RETRY_PATCHES]
    message = str(caught.value)
    assert "FP8 region blocks.0." in message and caught.value.module_fqn.startswith("blocks.0."), message
    assert "CppCompileError: C++ compile error: forced by the test" in message and f"nor with {RETRY}" in message, message
    assert "\n" not in message, "one line per error, the whole errors chained"
    assert not [line for line in _said(fresh_log) if "regional compile" in line]


def test_a_unit_inductor_rejects_otherwise_is_not_retried_and_runs_eagerly(failing_unit, fresh_log):
    failing_unit.factory = lambda: NotImplementedError("no lowering for this op (forced by the test)")
    model, x, gm = traced(1)
    compiled = fp8conf.compile_joint(gm, mode="regional", strict=False)
    assert failing_unit == [None], "only a C++ compile error is compiled again"
    (fallback,) = [f for f in compiled.fallbacks if f.startswith("regional compile:")]
    assert "NotImplementedError: no lowering for this op" in fallback, fallback
    assert_matches_eager(gm, model, x, compiled.fn, seed=0)
