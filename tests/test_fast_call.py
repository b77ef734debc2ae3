"""Compiled regions and pieces called straight through Inductor's generated code
(:mod:`fp8conf.compile.fast_call`) where AOTAutograd's wrappers have nothing to do, and through
the artifact where they do: same results either way. Functional units compiled by Inductor's
inner compiler compute what their saved (``standalone_compile``) form computes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import fp8conf
from fp8conf.compile import CompiledUnit, region_compile
from fp8conf.compile.fast_call import fast_entry, graph_allows_fast_call, wrapper_work
from fp8conf.tools.example_models import build_stack

DIM, TOKENS = 32, 16


def _call_sites(compiled):
    return [n for g in compiled.artifact for n in g.graph.nodes if n.op == "call_function" and hasattr(n.target, "__wrapped__")]


def _steps(compiled, gm, model, x, grad, steps=2):
    primals, tangents = fp8conf.joint_signature(gm).feed(model, (x,), (grad,))
    outs = [compiled(primals, tangents) for _ in range(steps)]
    return [t for t in torch.utils._pytree.tree_leaves(outs) if isinstance(t, torch.Tensor)]


def test_ordinary_regions_take_the_fast_path_with_equal_results():
    model = build_stack(DIM, 2, seed=0)
    x = torch.randn(TOKENS, DIM, requires_grad=True)
    grad = torch.randn(TOKENS, DIM)
    gm = fp8conf.trace_joint(model, (x,))
    slow = fp8conf.compile_joint(gm, fp8conf.CompileConfig(mode="regional", fast_calls=False))
    fast = fp8conf.compile_joint(gm, fp8conf.CompileConfig(mode="regional", fast_calls=True))
    assert all(n.target.fast is None for n in _call_sites(slow))
    regions = [n for n in _call_sites(fast) if n.name.startswith("region")]
    assert regions and all(n.target.fast is not None for n in regions)
    expected, got = _steps(slow, gm, model, x, grad), _steps(fast, gm, model, x, grad)
    # After the first call, each region calls its fast entry, not the artifact.
    assert all(n.target.current() is n.target.fast for n in regions)
    assert len(expected) == len(got) and all(torch.equal(a, b) for a, b in zip(expected, got))


def test_the_units_of_repeated_blocks_take_the_fast_path():
    # In a graph of repeated blocks the copies of a node share its traced value, so a block's
    # input (the block before's output) and the block's own output look like one storage; the
    # engine's own units have no wrappers that aliasing could concern, and all take the fast path.
    model = build_stack(DIM, 6, seed=0)
    x = torch.randn(TOKENS, DIM, requires_grad=True)
    grad = torch.randn(TOKENS, DIM)
    gm = fp8conf.trace_joint(model, (x,), repeat="blocks")
    compiled = fp8conf.compile_joint(gm, mode="regional")
    sites = _call_sites(compiled)
    assert sites and all(isinstance(n.target.__wrapped__, CompiledUnit) for n in sites)
    slow = [n.name for n in sites if n.target.fast is None]
    assert not slow, f"units of the repeated blocks called through torch's wrappers at every step: {slow}"
    through_wrappers = fp8conf.compile_joint(gm, fp8conf.CompileConfig(mode="regional", fast_calls=False))
    expected, got = _steps(through_wrappers, gm, model, x, grad), _steps(compiled, gm, model, x, grad)
    assert all(n.target.current() is n.target.fast for n in sites)
    assert len(expected) == len(got) and all(torch.equal(a, b) for a, b in zip(expected, got))


def test_saveable_units_of_repeated_blocks_take_the_fast_path():
    # The same graph with every unit compiled by standalone_compile (saveable_units, as compile
    # workers compile them too): the graph is asked whether AOTAutograd's wrappers have work, and
    # must not take the shared traced values of the copies for a block's output aliasing its input
    # (each such unit was called through the wrappers at every step, from the depth at which
    # trace_joint repeats blocks, and nothing said so).
    model = build_stack(DIM, 6, seed=0)
    x = torch.randn(TOKENS, DIM, requires_grad=True)
    grad = torch.randn(TOKENS, DIM)
    gm = fp8conf.trace_joint(model, (x,), repeat="blocks")
    compiled = fp8conf.compile_joint(gm, fp8conf.CompileConfig(mode="regional", saveable_units=True))
    sites = _call_sites(compiled)
    assert sites and not any(isinstance(n.target.__wrapped__, CompiledUnit) for n in sites)
    slow = [n.name for n in sites if n.target.fast is None]
    assert not slow, f"saveable units of the repeated blocks called through torch's wrappers at every step: {slow}"
    through_wrappers = fp8conf.compile_joint(gm, fp8conf.CompileConfig(mode="regional", saveable_units=True, fast_calls=False))
    expected, got = _steps(through_wrappers, gm, model, x, grad), _steps(compiled, gm, model, x, grad)
    assert all(n.target.current() is n.target.fast for n in sites)
    assert len(expected) == len(got) and all(torch.equal(a, b) for a, b in zip(expected, got))


def _view_chain(x):
    y = x * 2
    return y, y.t().detach()  # the second output is a view of the first, through two views


def _unmarked_alias(x):
    y = x * 2
    return y, torch.ops.aten._unsafe_view.default(y, (32,))  # shares y's storage; its schema marks no alias


@pytest.mark.parametrize(("fn", "why"), [(_view_chain, "a view of an input or of another output"),
                                         (_unmarked_alias, "a view of an input or of another output")],
                         ids=["views of an output", "unmarked alias"])
def test_outputs_that_share_storage_keep_calling_the_artifact(fn, why):
    x = torch.randn(4, 8)
    gm = make_fx(fn, tracing_mode="fake")(x)
    assert not graph_allows_fast_call(gm, [x])
    assert why in wrapper_work(gm, [x])  # what the debug log says of the unit


def _aliasing(x):
    return x * 2, x.t()  # the second output is a view of the input: AOTAutograd regenerates it


def _mutating(x):
    y = x * 2
    x.add_(1)  # an input mutation: AOTAutograd's wrapper writes it back
    return (y,)


@pytest.mark.parametrize(("fn", "why"), [(_aliasing, "a view of an input"), (_mutating, "mutates")],
                         ids=["aliased output", "input mutation"])
def test_a_graph_whose_wrappers_matter_keeps_calling_the_artifact(fn, why):
    x = torch.randn(4, 8)
    gm = make_fx(fn, tracing_mode="fake")(x)
    assert not graph_allows_fast_call(gm, [x])
    assert why in wrapper_work(gm, [x])
    artifact = torch._inductor.standalone_compile(gm, [x], dynamic_shapes="from_example_inputs", aot=True)
    assert fast_entry(artifact) is None  # the runtime wrapper has work to do: no fast entry either
    region = region_compile.region_call(artifact, None)
    eager_input, compiled_input = x.clone(), x.clone()
    for _ in range(2):
        expected, got = fn(eager_input), region(compiled_input)
        assert all(torch.equal(a, b) for a, b in zip(expected, got))
        assert torch.equal(eager_input, compiled_input)


def _units(compiled):
    return {id(n.target.__wrapped__): n.target.__wrapped__ for n in _call_sites(compiled)}.values()


def test_functional_units_are_compiled_by_the_inner_compiler_as_their_saved_form_computes():
    model = build_stack(DIM, 2, seed=0)
    x = torch.randn(TOKENS, DIM, requires_grad=True)
    grad = torch.randn(TOKENS, DIM)
    gm = fp8conf.trace_joint(model, (x,))
    inner = fp8conf.compile_joint(gm, mode="regional")
    saved_form = fp8conf.compile_joint(gm, fp8conf.CompileConfig(mode="regional", saveable_units=True))
    assert inner.inductor_compiles == saved_form.inductor_compiles > 0
    kinds = {type(u).__name__ for u in _units(inner)}
    assert kinds == {"InnerCompiledUnit"}, f"every unit of the block stack is functional, yet some were compiled otherwise: {kinds}"
    assert {type(u).__name__ for u in _units(saved_form)} == {"AOTCompiledArtifact"}
    expected, got = _steps(saved_form, gm, model, x, grad), _steps(inner, gm, model, x, grad)
    # The same decompositions and passes as AOTAutograd's: the same kernels, bit for bit.
    assert len(expected) == len(got) and all(torch.equal(a, b) for a, b in zip(expected, got))
    # What a regional artifact stores of an inner-compiled unit: the unit compiled the other way, once.
    unit = next(iter(_units(inner)))
    assert type(unit.saveable()).__name__ == "AOTCompiledArtifact" and unit.saveable() is unit.saveable()


def _views_of_the_input(x):
    return x * 2, x.t(), x.t().detach()  # outputs aliasing the input and each other


def _unit_of(fn, x):
    """``fn`` traced on ``x`` and compiled as a regional compile compiles a unit."""
    gm = make_fx(fn, tracing_mode="fake")(x)
    with region_compile.tracing_fake_mode(gm):
        return region_compile.compile_unit(gm, [p.meta["val"] for p in gm.graph.find_nodes(op="placeholder")])


def test_a_unit_whose_outputs_alias_is_inner_compiled_with_the_traced_values_and_strides():
    x = torch.randn(4, 8)
    unit = _unit_of(_views_of_the_input, x)
    assert isinstance(unit, region_compile.InnerCompiledUnit) and isinstance(unit, CompiledUnit)
    for _ in range(2):
        expected, got = _views_of_the_input(x), unit(x)
        for a, b in zip(expected, got):
            assert torch.equal(a, b) and a.stride() == b.stride()


def test_a_unit_that_mutates_or_takes_a_grad_input_goes_through_standalone_compile():
    x = torch.randn(4, 8)
    unit = _unit_of(_mutating, x)
    assert not isinstance(unit, region_compile.InnerCompiledUnit) and not isinstance(unit, CompiledUnit)
    eager_input, compiled_input = x.clone(), x.clone()
    assert torch.equal(_mutating(eager_input)[0], unit(compiled_input)[0]) and torch.equal(eager_input, compiled_input)
    with torch._subclasses.FakeTensorMode() as mode:
        grad_input = mode.from_tensor(x.requires_grad_())
    doubling = make_fx(lambda t: (t * 2,), tracing_mode="fake")(x.detach())
    assert not region_compile._functional_unit(doubling, [grad_input])


_PUT_OFF_WAIT = """
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from fp8conf.compile import region_compile

def f(x):
    return (torch.relu(x) * 3 + 1).sum(0), x.sin().t()

x = torch.randn(64, 32)
gm = make_fx(f, tracing_mode="fake")(x)
fakes = [p.meta["val"] for p in gm.graph.find_nodes(op="placeholder")]
with region_compile.tracing_fake_mode(gm):
    unit = region_compile.compile_unit(gm, fakes)
assert isinstance(unit, region_compile.InnerCompiledUnit)
assert unit._waits, "the generated code waited for its kernels while the unit compiled"
got = unit(x)
assert not unit._waits
for a, b in zip(f(x), got):  # a compiled sum adds in another order than eager's
    torch.testing.assert_close(b, a)
    assert a.stride() == b.stride()
print("ok")
"""


@pytest.mark.slow
def test_an_inner_compiled_units_kernel_wait_is_put_off_until_it_is_bound_or_called(tmp_path):
    # Inductor builds kernels in worker processes (and its generated code waits for them) only
    # with more than one compile thread: a process of its own, so that no pool outlives the test.
    env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS="2", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    done = subprocess.run([sys.executable, "-c", _PUT_OFF_WAIT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
