"""Compiled regions and pieces called straight through Inductor's generated code
(:mod:`fp8conf.graph.fast_call`) where AOTAutograd's wrappers have nothing to do, and through
the artifact where they do: same results either way."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import fp8conf
from fp8conf.graph import region_compile
from fp8conf.graph.fast_call import fast_entry, graph_allows_fast_call
from fp8conf.tools.example_models import build_stack

DIM, TOKENS = 32, 16


def _call_sites(compiled):
    return [n for g in compiled.artifact for n in g.graph.nodes if n.op == "call_function" and hasattr(n.target, "__wrapped__")]


def _steps(compiled, gm, model, x, grad, steps=2):
    primals, tangents = fp8conf.joint_signature(gm).feed(model, (x,), (grad,))
    outs = [compiled(primals, tangents) for _ in range(steps)]
    return [t for t in torch.utils._pytree.tree_leaves(outs) if isinstance(t, torch.Tensor)]


def test_ordinary_regions_take_the_fast_path_with_equal_results(monkeypatch):
    model = build_stack(DIM, 2, seed=0)
    x = torch.randn(TOKENS, DIM, requires_grad=True)
    grad = torch.randn(TOKENS, DIM)
    gm = fp8conf.trace_joint(model, (x,))
    monkeypatch.setattr(region_compile, "FAST_CALLS", False)
    slow = fp8conf.compile_joint(gm, mode="regional")
    monkeypatch.setattr(region_compile, "FAST_CALLS", True)
    fast = fp8conf.compile_joint(gm, mode="regional")
    assert all(n.target.fast is None for n in _call_sites(slow))
    regions = [n for n in _call_sites(fast) if n.name.startswith("region")]
    assert regions and all(n.target.fast is not None for n in regions)
    expected, got = _steps(slow, gm, model, x, grad), _steps(fast, gm, model, x, grad)
    # After the first call, each region calls its fast entry, not the artifact.
    assert all(n.target.current() is n.target.fast for n in regions)
    assert len(expected) == len(got) and all(torch.equal(a, b) for a, b in zip(expected, got))


def _aliasing(x):
    return x * 2, x.t()  # the second output is a view of the input: AOTAutograd regenerates it


def _mutating(x):
    y = x * 2
    x.add_(1)  # an input mutation: AOTAutograd's wrapper writes it back
    return (y,)


@pytest.mark.parametrize("fn", [_aliasing, _mutating], ids=["aliased output", "input mutation"])
def test_a_graph_whose_wrappers_matter_keeps_calling_the_artifact(fn):
    x = torch.randn(4, 8)
    gm = make_fx(fn, tracing_mode="fake")(x)
    assert not graph_allows_fast_call(gm, [x])
    artifact = torch._inductor.standalone_compile(gm, [x], dynamic_shapes="from_example_inputs", aot=True)
    assert fast_entry(artifact) is None  # the runtime wrapper has work to do: no fast entry either
    region = region_compile.region_call(artifact, None)
    eager_input, compiled_input = x.clone(), x.clone()
    for _ in range(2):
        expected, got = fn(eager_input), region(compiled_input)
        assert all(torch.equal(a, b) for a, b in zip(expected, got))
        assert torch.equal(eager_input, compiled_input)
