"""A small Llama for the tests: an embedding, blocks of RMSNorm, causal SDPA attention with
q/k/v/o projections, RMSNorm and SwiGLU, then a norm and an output head; every linear but the
head converted to FP8 by TorchAO's tensorwise recipe."""

from __future__ import annotations

import functools

import torch

DIM, TOKENS, HEADS = 32, 16, 2


class RMSNorm(torch.nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps, self.weight = eps, torch.nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class LlamaBlock(torch.nn.Module):
    """RMSNorm, causal SDPA attention with q/k/v/o projections, RMSNorm, SwiGLU."""

    def __init__(self, dim):
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)
        self.wq, self.wk, self.wv, self.wo = (torch.nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.w1, self.w3 = (torch.nn.Linear(dim, 2 * dim, bias=False) for _ in range(2))
        self.w2 = torch.nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x):
        h = self.attention_norm(x)
        q, k, v = (w(h).view(1, TOKENS, HEADS, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(1, TOKENS, -1))
        h = self.ffn_norm(x)
        return x + self.w2(torch.nn.functional.silu(self.w1(h)) * self.w3(h))


class Llama(torch.nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.embedding = torch.nn.Embedding(64, DIM)
        self.layers = torch.nn.ModuleList(LlamaBlock(DIM) for _ in range(blocks))
        self.norm, self.output = RMSNorm(DIM), torch.nn.Linear(DIM, 64, bias=False)

    def forward(self, tokens):
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def fp8(model):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"), module_filter_fn=lambda m, fqn: fqn != "output")
    return model


def llama(blocks):
    """``(model, args, container)``: a ``blocks``-block FP8 Llama, its token input, its blocks' container."""
    torch.manual_seed(0)
    return fp8(Llama(blocks)), (torch.randint(0, 64, (1, TOKENS)),), "layers"


@functools.lru_cache(maxsize=None)
def traced_llama(blocks):
    """``(model, args, joint graph)`` of :func:`llama`, traced once per process (tests that share
    it must not change the model or the graph)."""
    import fp8conf

    model, args, _ = llama(blocks)
    return model, args, fp8conf.trace_joint(model, args)
