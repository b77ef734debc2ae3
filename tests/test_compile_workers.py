"""Regional units compiled in helper processes beside this one (``compile_joint(..., workers=N)``):
the same units as in this process alone, shared out between the helpers and this process,
giving the same numbers; a failed
worker reported as the region's compile error; a bad ``workers`` refused before anything is compiled. On CPU, on the block stack."""

from __future__ import annotations

import shutil
import sys

import pytest
import torch

import fp8conf
from fp8conf.compile import region_compile
from stack_steps import DIM, TOKENS, traced


@pytest.fixture
def units_compiled_here(monkeypatch):
    """How many units this process compiles (a worker's compiles are not counted)."""
    calls = []
    compile_unit = region_compile.compile_unit

    def counted(*args, **kwargs):
        calls.append(args[0])
        return compile_unit(*args, **kwargs)

    monkeypatch.setattr(region_compile, "compile_unit", counted)
    return calls


@pytest.mark.slow
def test_units_compiled_in_workers_are_the_units_compiled_here_and_give_the_same_step(units_compiled_here):
    model, x, gm = traced(2)
    here = fp8conf.compile_joint(gm, mode="regional")
    compiled_here = len(units_compiled_here)
    assert compiled_here == here.inductor_compiles > 0
    workers = fp8conf.compile_joint(gm, mode="regional", workers=1)
    # Shared out: the largest units go to the helpers, the rest are compiled here meanwhile.
    helped_here = len(units_compiled_here) - compiled_here
    assert 0 < helped_here < here.inductor_compiles, (
        f"with 1 helper, {helped_here} of {here.inductor_compiles} units were compiled in this process: "
        "expected the helpers and this process each to take some")
    assert workers.inductor_compiles == here.inductor_compiles
    assert workers.compiled_nodes == here.compiled_nodes and workers.eager_nodes == here.eager_nodes
    torch.manual_seed(3)
    args, grad = (torch.randn(TOKENS, DIM, requires_grad=True),), (torch.randn(TOKENS, DIM),)
    (out_here,), grads_here = fp8conf.run_joint(gm, model, args, grad, fn=here)
    (out_workers,), grads_workers = fp8conf.run_joint(gm, model, args, grad, fn=workers)
    # The same graphs compiled by the same Inductor: the same kernels, bit for bit.
    assert torch.equal(out_workers, out_here)
    assert grads_workers.keys() == grads_here.keys()
    for name, value in grads_here.items():
        assert torch.equal(grads_workers[name], value), f"grad of {name} differs between in-process and worker compiles"


def test_a_unit_torch_cannot_send_to_a_helper_is_compiled_here_and_said(monkeypatch, caplog, units_compiled_here):
    import logging

    from torch.fx._graph_pickler import GraphPickler

    _, _, gm = traced(1)

    def refuse(*args, **kwargs):
        raise TypeError("graph refused by the test")

    monkeypatch.setattr(GraphPickler, "dumps", refuse)
    with caplog.at_level(logging.WARNING, logger="fp8conf"):
        compiled = fp8conf.compile_joint(gm, mode="regional", workers=1)
    assert len(units_compiled_here) == compiled.inductor_compiles > 0  # every unit, here
    said = [r.getMessage() for r in caplog.records if "graph refused by the test" in r.getMessage()]
    assert len(said) == 1 and "compiled in this process" in said[0], said


def test_a_worker_that_cannot_compile_is_a_region_compile_error_naming_the_region(monkeypatch):
    _, _, gm = traced(1)
    # Workers started with a program that exits at once instead of serving.
    monkeypatch.setattr(sys, "executable", shutil.which("false"))
    with pytest.raises(fp8conf.RegionCompileError, match=r"compile worker \(pid \d+\) exited \(1\)") as caught:
        fp8conf.compile_joint(gm, mode="regional", workers=1)
    assert caught.value.module_fqn, "the error names the module of the region the unit holds"


@pytest.mark.parametrize("workers", [-1, 1.5, True, "4"])
def test_a_bad_number_of_workers_is_refused_before_compiling(workers):
    _, _, gm = traced(1)
    with pytest.raises(fp8conf.FP8ConfigError, match="workers"):
        fp8conf.compile_joint(gm, mode="regional", workers=workers)
