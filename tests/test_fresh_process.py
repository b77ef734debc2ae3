"""A trainer's first steps in a new process, and what a compiled step does with a wrong input.

Every public compile path runs a Llama-shaped FP8 model's first steps in a subprocess of its own
with an empty Inductor cache (tests/fresh_steps.py), as a user meets it: no compile earlier in
the process, no cache to hit. Gradients are compared with the eager module's autograd at every
step. On CPU: ``regional`` and ``full``; on CUDA (``fp8_gpu``) also with CUDA graphs and from a
signed regional artifact written by one process and loaded by the next.

A step fed a wrong input (a Python float for an output's gradient, a tensor of another shape, one
input too few) is refused by fp8conf with a typed error naming that input, before any compiled
code runs: Inductor's own checks, deep inside whichever unit reads the input first, name
neither the input nor the step.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fp8conf
from stack_steps import DIM, TOKENS, traced

SCRIPT = Path(__file__).resolve().parent / "fresh_steps.py"
ROOT = SCRIPT.parent.parent


def _fresh(path: str, device: str, tmp_path: Path, artifact: Path) -> str:
    cache = tmp_path / f"inductor-{path}"
    cache.mkdir()
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache), PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    # A guard against a hang, sized for a loaded 2-core machine; the step's own checks decide.
    result = subprocess.run([sys.executable, str(SCRIPT), path, device, str(artifact)], env=env, capture_output=True, text=True, timeout=540)
    output = result.stdout + result.stderr[-4000:]
    assert result.returncode == 0 and result.stdout.rstrip().endswith("OK"), f"{path} on {device}, fresh process, rc {result.returncode}:\n{output}"
    return result.stdout


def _assert_steps(stdout: str) -> None:
    from fresh_steps import STEPS

    print(stdout)  # the worst error of each step against what it was allowed (pytest -rP shows it)
    assert [line.split()[1] for line in stdout.splitlines() if line.startswith("STEP ")] == [str(i) for i in range(STEPS)], stdout
    assert "REFUSED FP8" in stdout or "REFUSED Artifact" in stdout, stdout


@pytest.mark.slow
@pytest.mark.parametrize("path", ["regional", "full"])
def test_first_steps_in_a_fresh_process_match_eager_on_cpu(path, tmp_path):
    _assert_steps(_fresh(path, "cpu", tmp_path, tmp_path / "unused.fp8"))


@pytest.mark.slow
@pytest.mark.fp8_gpu
@pytest.mark.parametrize("path", ["regional", "full", "regional+cg", "full+cg"])
def test_first_steps_in_a_fresh_process_match_eager_on_cuda(path, tmp_path):
    _assert_steps(_fresh(path, "cuda", tmp_path, tmp_path / "unused.fp8"))


@pytest.mark.slow
@pytest.mark.fp8_gpu
def test_first_steps_from_an_artifact_in_a_fresh_process_match_eager_on_cuda(tmp_path):
    artifact = tmp_path / "llama.fp8"
    _fresh("save", "cuda", tmp_path, artifact)
    _assert_steps(_fresh("load", "cuda", tmp_path, artifact))


# --- a wrong input, refused at the boundary ---------------------------------------------------


@pytest.fixture(scope="module")
def stack():
    model, x, gm = traced(2)
    return model, x, gm, fp8conf.joint_signature(gm), fp8conf.compile_joint(gm, mode="regional")


@pytest.mark.parametrize(
    "tangent, words",
    [
        (0.5, ["tangent of output 0", "must be a tensor", "got float"]),
        (torch.randn(TOKENS, DIM + 1), ["tangent of output 0", "has shape (16, 33)", "(16, 32)"]),
        (torch.randn(TOKENS, DIM, dtype=torch.float64), ["tangent of output 0", "dtype torch.float64"]),
    ],
    ids=["float", "shape", "dtype"],
)
def test_a_compiled_step_refuses_a_wrong_tangent_naming_it(stack, tangent, words):
    model, x, gm, signature, compiled = stack
    primals, tangents = signature.feed(model, (x,), (tangent,))
    for call in (lambda: compiled(primals, tangents), lambda: fp8conf.run_joint(gm, model, (x,), (tangent,), fn=compiled)):
        with pytest.raises(fp8conf.FP8ConfigError) as caught:
            call()
        assert all(w in str(caught.value) for w in words), str(caught.value)


def test_a_compiled_step_refuses_a_wrong_input_count(stack):
    model, x, gm, signature, compiled = stack
    primals, tangents = signature.feed(model, (x,), (torch.randn(TOKENS, DIM),))
    with pytest.raises(fp8conf.FP8ConfigError, match=f"called with {len(primals)} inputs, but the graph takes {len(primals) + 1}"):
        compiled(primals, [])


def test_run_joint_refuses_missing_or_wrong_gradients_naming_them(stack):
    model, x, gm, _, _ = stack
    with pytest.raises(fp8conf.FP8TraceError, match="takes 1 grad_outputs"):
        fp8conf.run_joint(gm, model, (x,), ())
    with pytest.raises(fp8conf.FP8ConfigError, match=r"tangent of output 0 \(flat input \d+\) has shape \(3,\)"):
        fp8conf.run_joint(gm, model, (x,), (torch.randn(3),))
    with pytest.raises(fp8conf.FP8ConfigError, match=r"input 0 \(flat input \d+\) has shape \(16, 8\)"):
        fp8conf.run_joint(gm, model, (torch.randn(TOKENS, 8),), (torch.randn(TOKENS, DIM),))


def test_a_right_step_still_runs_and_matches_eager(stack):
    from stack_steps import assert_matches_eager

    model, x, gm, _, compiled = stack
    assert_matches_eager(gm, model, x, compiled.fn, seed=1)
