"""The FP8 block stack's joint training step, shared by the compile tests: traced once per depth
and seed (no test changes the graph or the model it traced), and a check that a compiled
callable of it gives the eager joint graph's outputs and gradients."""

from __future__ import annotations

import functools

import torch

import fp8conf
from fp8conf.tools.example_models import build_stack

DIM, TOKENS = 32, 16


@functools.lru_cache(maxsize=None)
def traced(blocks: int, seed: int = 0):
    """``(model, x, joint graph)`` of a ``blocks``-block stack of width DIM on TOKENS rows."""
    model = build_stack(DIM, blocks, seed=seed)
    x = torch.randn(TOKENS, DIM, requires_grad=True)
    return model, x, fp8conf.trace_joint(model, (x,))


def assert_matches_eager(gm, model, x, fn, *, seed):
    torch.manual_seed(seed)
    args, grad = (torch.randn_like(x).requires_grad_(),), (torch.randn(TOKENS, DIM),)
    (out_e,), grads_e = fp8conf.run_joint(gm, model, args, grad)
    (out_c,), grads_c = fp8conf.run_joint(gm, model, args, grad, fn=fn)
    torch.testing.assert_close(out_c, out_e, rtol=1e-3, atol=1e-5)
    assert grads_c.keys() == grads_e.keys()
    for name in grads_e:
        torch.testing.assert_close(grads_c[name], grads_e[name], rtol=1e-3, atol=1e-5, msg=lambda m: f"grad of {name}: {m}")
