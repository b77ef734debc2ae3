"""trace_joint(repeat=...): four blocks traced, the others copied, and the graph the same as
tracing every block (fp8conf/graph/repeat.py)."""

from __future__ import annotations

import functools

import pytest
import torch

import fp8conf
from fp8conf.errors import FP8TraceError
from fp8conf.graph.trace import run_joint
from fp8conf.tools.example_models import build_stack
from joint_shapes import assert_same_joint, joint_shape
from llama_model import DIM, TOKENS, llama as _llama  # tests/ is on sys.path (tests/conftest.py)


def _stack(blocks):
    return build_stack(DIM, blocks), (torch.randn(TOKENS, DIM, requires_grad=True),), "blocks"


MODELS = {"llama": _llama, "stack": _stack}


@functools.lru_cache(maxsize=None)
def _traced(name, blocks, repeat: bool):
    model, args, container = MODELS[name](blocks)
    return model, args, fp8conf.trace_joint(model, args, repeat=container if repeat else False)


@pytest.mark.parametrize("name", list(MODELS))
def test_a_repeated_trace_is_the_graph_of_every_block_traced(name):
    """Node for node the same graph (ops, wiring, blocks, provenance, sequence-number pairing,
    shapes), the same signature and module calls, and bit-equal results: a copy wired to the
    wrong neighbour, or numbered apart from its backward, fails here."""
    model, args, whole = _traced(name, 6, False)
    *_, repeated = _traced(name, 6, True)
    assert_same_joint(model, args, whole, repeated, "the repeated trace")


def test_a_repeated_trace_compiles_regionally_and_matches_its_graph():
    model, args, gm = _traced("llama", 6, True)
    out = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")).meta["val"]
    grad = (torch.randn(out.shape, dtype=out.dtype),)
    compiled = fp8conf.compile_joint(gm, mode="regional")
    (expected,), expected_grads = run_joint(gm, model, args, grad)
    (seen,), seen_grads = run_joint(gm, model, args, grad, fn=compiled)
    torch.testing.assert_close(seen, expected)
    for key, value in expected_grads.items():
        if value is not None:
            torch.testing.assert_close(seen_grads[key], value, msg=lambda m, key=key: f"gradient of {key}: {m}")


def test_four_blocks_or_fewer_are_traced_whole():
    *_, whole = _traced("stack", 3, False)
    *_, repeated = _traced("stack", 3, True)
    assert joint_shape(repeated) == joint_shape(whole)


def test_blocks_that_differ_are_refused_naming_the_difference():
    model, args, _ = _stack(6)
    model.blocks[4].norm.eps = 1e-3
    with pytest.raises(FP8TraceError, match=r"blocks\.4 differs from blocks\.0 \(attribute norm\.eps"):
        fp8conf.trace_joint(model, args, repeat="blocks")
    model, args, _ = _stack(6)
    model.blocks[5].up = torch.nn.Linear(DIM, 2 * DIM, bias=False)
    with pytest.raises(FP8TraceError, match=r"blocks\.5 differs from blocks\.0 \(up is a Float8Linear in blocks\.0, a Linear in blocks\.5\)"):
        fp8conf.trace_joint(model, args, repeat="blocks")


class _SkipStack(torch.nn.Module):
    """Each block's output is added to the one two blocks on: a block reads a value no repeated
    block's neighbour hands it."""

    def __init__(self):
        super().__init__()
        self.blocks = build_stack(DIM, 6, head=False).blocks

    def forward(self, x):
        previous = x
        for block in self.blocks:
            x, previous = block(x) + previous, x
        return x


def test_blocks_wired_past_their_neighbours_are_refused():
    args = (torch.randn(TOKENS, DIM, requires_grad=True),)
    with pytest.raises(FP8TraceError, match=r"cannot be repeated: .*blocks\.1.*trace without repeat="):
        fp8conf.trace_joint(_SkipStack(), args, repeat="blocks")


@pytest.mark.parametrize("repeat, message", [("trunk", "has no submodule 'trunk'"), ("blocks.0", "is a MLPBlock; name a ModuleList")])
def test_a_repeat_that_names_no_container_of_blocks_is_a_usage_error(repeat, message):
    model, args, _ = _stack(6)
    with pytest.raises(FP8TraceError, match=message):
        fp8conf.trace_joint(model, args, repeat=repeat)


def test_attributes_the_forward_does_not_read_may_differ_when_named():
    """torchtitan's blocks carry their ``layer_id``: refused as a difference unless named in
    ``per_block``, and then the graph is still every block's."""
    model, args, _ = _stack(6)
    for i, block in enumerate(model.blocks):
        block.layer_id = i
    with pytest.raises(FP8TraceError, match=r"attribute layer_id: 0 in blocks\.0, 1 in blocks\.1.*per_block="):
        fp8conf.trace_joint(model, args, repeat="blocks")
    repeated = fp8conf.trace_joint(model, args, repeat="blocks", per_block=("layer_id",))
    *_, whole = _traced("stack", 6, False)
    assert joint_shape(repeated) == joint_shape(whole)
    with pytest.raises(FP8TraceError, match="give repeat= too"):
        fp8conf.trace_joint(model, args, per_block=("layer_id",))


class _ReusedBlockStack(torch.nn.Module):
    """Block 1 is called again after the last: its forward is two runs of the graph."""

    def __init__(self):
        super().__init__()
        self.blocks = build_stack(DIM, 6, head=False).blocks

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.blocks[1](x)


def test_a_block_called_twice_is_refused():
    args = (torch.randn(TOKENS, DIM, requires_grad=True),)
    with pytest.raises(FP8TraceError, match=r"the forward of blocks\.1 is not one run of the graph"):
        fp8conf.trace_joint(_ReusedBlockStack(), args, repeat="blocks")
