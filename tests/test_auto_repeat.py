"""trace_joint with no repeat=: a deep model's container of equal blocks found, proven on the
model (its graph at five blocks is its graph at four with a block copied) and repeated; every
model the proof refuses traced whole, saying why (fp8conf/graph/auto_repeat.py)."""

from __future__ import annotations

import logging
import math
import re
import sys
from pathlib import Path

import pytest
import torch

import fp8conf
from fp8conf import log
from fp8conf.errors import FP8TraceError
from fp8conf.graph import auto_repeat
from fp8conf.graph.repeat import untagged_backward
from fp8conf.graph.trace import trace_info
from fp8conf.tools.example_models import BlockStack, MLPBlock, build_stack
from joint_shapes import assert_same_joint, joint_shape
from llama_model import DIM, TOKENS, fp8, llama  # tests/ is on sys.path (tests/conftest.py)


@pytest.fixture
def said(monkeypatch, caplog):
    """The fp8conf logger's warnings, each said again here however often this process said it."""
    monkeypatch.setattr(log, "_said", set())
    caplog.set_level(logging.WARNING, logger="fp8conf")
    return lambda: [r.getMessage() for r in caplog.records if r.name == "fp8conf"]


@pytest.fixture
def repeat_from_six(monkeypatch):
    """Containers of six blocks repeated unasked, so that a test traces six blocks, not twelve."""
    monkeypatch.setattr(auto_repeat, "AUTO_REPEAT_MIN_BLOCKS", 6)


def _stack_args():
    return (torch.randn(TOKENS, DIM, requires_grad=True),)


def test_a_llama_is_repeated_with_no_flag_and_is_its_whole_trace(repeat_from_six, said):
    model, args, _ = llama(6)
    found = fp8conf.trace_joint(model, args)
    assert trace_info(found).repeated == "layers" and trace_info(found).fallbacks == ()
    whole = fp8conf.trace_joint(model, args, repeat=False)
    assert trace_info(whole).repeated is None
    assert_same_joint(model, args, whole, found, "the trace with no flag")
    assert said() == []


def test_a_rowwise_llama_with_grouped_experts_is_repeated_and_is_its_whole_trace(repeat_from_six, said):
    """Three things of real models that a plain tensorwise Llama lacks. Its projections are TorchAO
    rowwise ``Float8Linear`` s in bf16: AOT appends, after the whole backward, two transposes per
    rowwise weight gradient that give it the parameter's layout (untagged nodes computed from one
    block's backward: before, the plan took them for the model's own nodes reading block 1). Each
    block's mixture of experts holds a buffer (its expert mask), whose gradient is a None output
    without a descriptor (before, the proof found one None too few), and the first gradient
    accumulations of the backward take the head's sequence number and label amid the last block's
    backward (before, the plan found that backward cut in seven runs). Each made the model traced
    whole."""
    sys.path.append(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from llama import build_llama

    model = build_llama(32, 6, "rowwise", device="cpu", heads=2, vocab=64, ffn="experts", tokens=16, emulate_experts=True)
    args = (torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0)),)
    found = fp8conf.trace_joint(model, args)
    assert trace_info(found).repeated == "layers" and trace_info(found).fallbacks == ()
    tails = untagged_backward(found.graph)
    assert tails and {str(n.target) for n in tails} == {"aten.t.default"}
    whole = fp8conf.trace_joint(model, args, repeat=False)
    assert len(untagged_backward(whole.graph)) == len(tails)
    assert_same_joint(model, args, whole, found, "the experts trace with no flag")
    assert said() == []


@pytest.mark.parametrize("blocks", [auto_repeat.AUTO_REPEAT_MIN_BLOCKS - 1, auto_repeat.AUTO_REPEAT_MIN_BLOCKS])
def test_blocks_are_repeated_unasked_from_where_it_pays(blocks, said):
    """Below :data:`AUTO_REPEAT_MIN_BLOCKS` the proof's two traces cost more than the whole one:
    the model is traced whole, and that is no fallback to speak of."""
    model = build_stack(DIM, blocks)
    gm = fp8conf.trace_joint(model, _stack_args())
    pays = blocks >= auto_repeat.AUTO_REPEAT_MIN_BLOCKS
    assert (auto_repeat.find_block_container(model) is not None) == pays
    assert trace_info(gm).repeated == ("blocks" if pays else None) and trace_info(gm).fallbacks == ()
    assert said() == []


def test_repeat_false_traces_every_block(repeat_from_six, said):
    model, args = build_stack(DIM, 6), _stack_args()
    found = fp8conf.trace_joint(model, args)
    whole = fp8conf.trace_joint(model, args, repeat=False)
    assert trace_info(found).repeated == "blocks" and trace_info(whole).repeated is None
    assert trace_info(whole).fallbacks == () and said() == []
    assert joint_shape(whole) == joint_shape(found)


class _ScaledBlock(MLPBlock):
    def forward(self, x, scale):
        return x + scale * self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class _DepthScaledStack(BlockStack):
    """Each block's update scaled by one over the square root of the depth, as deep-norm models do:
    the forward reads ``len(self.blocks)``."""

    def __init__(self):
        super().__init__(DIM, 6, head=False)
        self.blocks = torch.nn.ModuleList(_ScaledBlock(DIM) for _ in range(6))

    def forward(self, x):
        for block in self.blocks:
            x = block(x, 1 / math.sqrt(len(self.blocks)))
        return x


class _ReusedBlockStack(BlockStack):
    """Block 1 is called again after the last."""

    def __init__(self):
        super().__init__(DIM, 6, head=False)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.blocks[1](x)


def _unequal_stack():
    model = build_stack(DIM, 6, head=False)
    model.blocks[4].norm.eps = 1e-3
    return model


@pytest.mark.parametrize("build, why", [
    (lambda: fp8(_DepthScaledStack()), r"_DepthScaledStack\.blocks is traced whole: copying a block of the 4-block trace does not give the 5-block trace "
                        r"\(node .*\); the forward depends on the depth"),
    (lambda: fp8(_ReusedBlockStack()), r"_ReusedBlockStack\.blocks is traced whole: its blocks cannot be traced four and copied \(.*blocks\.1 is not one run"),
    (_unequal_stack, r"BlockStack\.blocks is traced whole: block blocks\.4 differs from blocks\.0 \(attribute norm\.eps"),
], ids=["depth-scaled", "block-called-twice", "unequal-blocks"])
def test_a_model_the_proof_refuses_is_traced_whole_and_says_why(build, why, repeat_from_six, said):
    """With fp8conf's own torch, nothing but the model can make the proof fail: the fallback is
    said once through the fp8conf logger, kept in the trace's fallbacks, and the graph is every
    block's."""
    model, args = build(), _stack_args()
    gm = fp8conf.trace_joint(model, args)
    assert trace_info(gm).repeated is None
    (line,) = trace_info(gm).fallbacks
    assert line.startswith("equal-blocks trace: ")
    (message,) = said()
    assert "all its 6 blocks are traced, not 4" in message
    for text in (line, message):
        assert re.search(why, text), f"expected {why!r} in {text!r}"
    whole = fp8conf.trace_joint(model, args, repeat=False)
    assert_same_joint(model, args, whole, gm, "the trace that fell back")


def test_the_compiled_step_lists_the_fallback_of_its_trace(repeat_from_six, said):
    model = fp8(_DepthScaledStack())
    gm = fp8conf.trace_joint(model, _stack_args())
    compiled = fp8conf.compile_joint(gm, mode="regional")
    assert compiled.fallbacks[:1] == trace_info(gm).fallbacks


class _Experts(torch.nn.Module):
    def __init__(self, experts: int):
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(DIM, DIM) for _ in range(experts))


def test_the_container_holding_the_most_modules_is_chosen():
    """The layers holding experts, not the experts of one layer, though the experts outnumber
    the layers; not the model itself, and no container of another class's modules; and only
    blocks holding quantized modules, which fp8conf speeds up."""
    model = torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.ReLU())
    model.layers = torch.nn.ModuleList(_Experts(16) for _ in range(12))
    model.mixed = torch.nn.ModuleList([torch.nn.Linear(DIM, DIM), torch.nn.LayerNorm(DIM)] * 20)
    fqn, blocks = auto_repeat.find_block_container(fp8(model))
    assert fqn == "layers" and blocks == [f"layers.{i}" for i in range(12)]
    assert auto_repeat.find_block_container(build_stack(DIM, 12, recipe=None)) is None


def test_a_sharded_model_is_refused_before_tracing(monkeypatch):
    model = build_stack(DIM, 6)
    monkeypatch.setattr(auto_repeat, "layout_of", lambda m: object())
    assert "sharded" in auto_repeat.repeat_refusal(model, "blocks")


@pytest.mark.parametrize("repeat", [True, 1])
def test_a_repeat_that_is_no_container_name_nor_false_is_a_usage_error(repeat):
    model, args = build_stack(DIM, 2), _stack_args()
    with pytest.raises(FP8TraceError, match="pass False to trace every block"):
        fp8conf.trace_joint(model, args, repeat=repeat)
