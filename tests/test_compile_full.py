"""compile_joint's ``full`` mode against ``torch.compile`` on the same model (CPU): the same
numerics as the eager joint graph, the same forward and backward graphs as ``torch.compile``
cuts, no more saved for the backward than it saves, and saved values freed while the backward
runs, as its runtime frees them."""

from __future__ import annotations

import collections
import contextlib
import weakref

import pytest
import torch
import torch._inductor.compile_fx

import fp8conf
import fp8conf.compile.assemble as assemble_stage
from conformance.draw.strategies import runnable_recipes
from fp8conf.compile.partition import partition_joint
from fp8conf.graph.trace import flat_graph_module
from fp8conf.tools.example_models import build_stack
from fp8conf.tools.saved import saved_by_compiled_joint, saved_by_torch_compile

DIM, BLOCKS, TOKENS = 32, 2, 16


def _model_and_inputs(recipe, seed=0):
    model = build_stack(DIM, BLOCKS, recipe, seed=seed)
    x = torch.randn(TOKENS, DIM, requires_grad=True)
    return model, x


# Tensorwise: tests/test_compile_paths.py::test_full_compiles_forward_and_backward_through_the_partitioner.
@pytest.mark.parametrize("recipe", ["rowwise"])
def test_full_matches_the_eager_joint_graph(recipe):
    if recipe not in runnable_recipes():
        pytest.skip(f"this torch's CPU _scaled_mm cannot run {recipe} scales (torch 2.11: tensorwise only)")
    model, x = _model_and_inputs(recipe)
    gm = fp8conf.trace_joint(model, (x,))
    compiled = fp8conf.compile_joint(gm, mode="full")
    for step in range(2):
        torch.manual_seed(step)
        args, grad = (torch.randn_like(x).requires_grad_(),), (torch.randn(TOKENS, DIM),)
        (out_e,), grads_e = fp8conf.run_joint(gm, model, args, grad)
        (out_c,), grads_c = fp8conf.run_joint(gm, model, args, grad, fn=compiled.fn)
        torch.testing.assert_close(out_c, out_e, rtol=1e-3, atol=1e-5, msg=lambda m: f"{recipe} full, step {step}, output: {m}")
        assert grads_c.keys() == grads_e.keys()
        for name in grads_e:
            torch.testing.assert_close(grads_c[name], grads_e[name], rtol=1e-3, atol=1e-5,
                                       msg=lambda m: f"{recipe} full, step {step}, grad of {name}: {m}")


def _ops(graph) -> collections.Counter:
    return collections.Counter(str(n.target) for n in graph.graph.nodes if n.op == "call_function")


def _kernels_of_backward(code: list[str]) -> list[str]:
    """The kernel calls, in order, of the last generated module logged (a step's backward is
    compiled after its forward), Inductor's numbering dropped."""
    import re

    modules = [text[text.find("def call("):] for text in code if "def call(" in text]
    return [re.sub(r"_\d+$", "", k) for k in re.findall(r"(cpp_fused_\w+|extern_kernels\.\w+|triton_\w+)\(", modules[-1])] if modules else []


@contextlib.contextmanager
def _generated_code():
    """The modules Inductor generates meanwhile (its output-code log), under a fresh cache: a
    graph loaded from the cache logs no code."""
    import logging

    import torch._logging
    from torch._inductor.codecache import output_code_log

    class Keep(logging.Handler):
        def __init__(self):
            super().__init__()
            self.code = []

        def emit(self, record):
            self.code.append(record.getMessage())

    keep = Keep()
    output_code_log.addHandler(keep)
    torch._logging.set_logs(output_code=True)
    try:
        with torch._inductor.utils.fresh_cache():
            yield keep.code
    finally:
        torch._logging.set_logs()
        output_code_log.removeHandler(keep)


@pytest.mark.slow
def test_full_cuts_the_joint_graph_as_torch_compile_does_and_saves_no_more(monkeypatch):
    """Full makes torch.compile's cut, saves no more for the backward, and compiles the two
    halves as torch.compile compiles them, not traced and decomposed a second time: its backward
    is made of the same kernels in the same order (a second trace regroups them; on a GPU the
    backward then made every layer's FP8 casts up front and held them at its peak)."""
    cuts = []
    real = torch._inductor.compile_fx.partition_fn

    def recording(*args, **kwargs):
        cuts.append(real(*args, **kwargs))
        return cuts[-1]

    model, x = _model_and_inputs("tensorwise")
    with _generated_code() as code:
        with monkeypatch.context() as patch:
            patch.setattr(torch._inductor.compile_fx, "partition_fn", recording)
            torch._dynamo.reset()
            compiled_model = torch.compile(model)
            compiled_model(x).backward(torch.randn(TOKENS, DIM))  # compiles forward and backward
        their_kernels = _kernels_of_backward(code)
        code.clear()
        gm = fp8conf.trace_joint(model, (x,))
        compiled = fp8conf.compile_joint(gm, mode="full")
        our_kernels = _kernels_of_backward(code)
    assert len(cuts) == 1, f"torch.compile partitioned {len(cuts)} joint graphs of the model, expected one"
    theirs = saved_by_torch_compile(compiled_model, model, (x,))

    ours_cut = partition_joint(flat_graph_module(gm), keep_fp8_regions=False)
    for name, mine, torchs in (("forward", ours_cut.forward, cuts[0][0]), ("backward", ours_cut.backward, cuts[0][1])):
        assert _ops(mine) == _ops(torchs), (
            f"full's {name} graph differs from torch.compile's: ops only in full's {dict(_ops(mine) - _ops(torchs))}, "
            f"only in torch.compile's {dict(_ops(torchs) - _ops(mine))}"
        )
    assert their_kernels, "torch.compile's backward code was not seen"
    assert our_kernels == their_kernels, f"full's backward kernels differ from torch.compile's:\nfull:  {our_kernels}\ntorch: {their_kernels}"
    ours = saved_by_compiled_joint(gm, compiled, model, (x,))
    assert theirs.nbytes > 0 and ours.tensors > 0
    assert ours.nbytes <= theirs.nbytes, (
        f"fp8conf full saves {ours.nbytes} bytes in {ours.storages} storages for the backward, "
        f"torch.compile {theirs.nbytes} in {theirs.storages}"
    )


def test_full_backward_frees_saved_values_as_it_consumes_them(monkeypatch):
    """Each saved value handed to the compiled backward dies inside it, after its last use, not
    when the whole backward returns: the list the backward gets is its only holder."""
    events = []
    real = assemble_stage.run_partitioned

    def observed(parts, forward_fn, backward_fn, **options):
        def forward(*primals):
            out = list(forward_fn(*primals))
            inputs = {p.untyped_storage().data_ptr() for p in primals}
            for i, value in enumerate(out[parts.num_forward_outputs:]):
                if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() not in inputs:
                    weakref.finalize(value, events.append, ("freed", i))
            return out

        def backward(*args):
            result = backward_fn(*args)
            events.append(("returned", None))
            return result

        return real(parts, forward, backward, **options)

    monkeypatch.setattr(assemble_stage, "run_partitioned", observed)
    model, x = _model_and_inputs("tensorwise")
    gm = fp8conf.trace_joint(model, (x,))
    compiled = fp8conf.compile_joint(gm, mode="full")
    fp8conf.run_joint(gm, model, (x,), (torch.randn(TOKENS, DIM),), fn=compiled.fn)
    kinds = [kind for kind, _ in events]
    assert "returned" in kinds, f"the backward was never called: {events}"
    freed_inside = kinds.index("returned")
    saved = kinds.count("freed")
    assert saved > 0, "the forward saved no tensor of its own for the backward"
    assert freed_inside >= saved // 2, (
        f"only {freed_inside} of {saved} saved values were freed while the backward ran; "
        f"the rest lived until it returned (events: {events})"
    )


def test_full_compiles_each_half_for_fake_values_without_allocating_inputs(monkeypatch):
    """Without example inputs, both halves compile for the fake values their placeholders record,
    as ``torch.compile`` compiles: no real tensor as large as the parameters or the saved values
    sits beside the model's own while a graph compiles (on a GPU, the first step's peak)."""
    seen = []
    for owner, name in ((torch._inductor, "standalone_compile"), (torch._inductor.compile_fx, "compile_fx_inner")):
        def recording(gm, example_inputs, _real=getattr(owner, name), **kwargs):
            seen.append([type(v).__name__ for v in example_inputs if isinstance(v, torch.Tensor)])
            return _real(gm, example_inputs, **kwargs)

        monkeypatch.setattr(owner, name, recording)
    model, x = _model_and_inputs("tensorwise")
    gm = fp8conf.trace_joint(model, (x,))
    compiled = fp8conf.compile_joint(gm, mode="full")
    assert len(seen) == 2, f"full compiled {len(seen)} graphs, expected its forward and backward"
    for half, kinds in zip(("forward", "backward"), seen):
        real_inputs = [k for k in kinds if k != "FakeTensor"]
        assert kinds and not real_inputs, f"full's {half} compiled for {len(real_inputs)} real example tensors of {len(kinds)}"
    (out_e,), grads_e = fp8conf.run_joint(gm, model, (x,), (torch.ones(TOKENS, DIM),))
    (out_c,), grads_c = fp8conf.run_joint(gm, model, (x,), (torch.ones(TOKENS, DIM),), fn=compiled.fn)
    torch.testing.assert_close(out_c, out_e, rtol=1e-3, atol=1e-5)
    assert grads_c.keys() == grads_e.keys()
