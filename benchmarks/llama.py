"""A Llama-shaped model for the compile benchmarks: RMSNorm, causal SDPA attention with FP8
q/k/v/o projections, a SwiGLU feed-forward with FP8 projections, and a bf16 output head.

The shapes follow the Llama-3 debug model (dim 256, 6 layers, 16 heads, vocab 2048) and a
matmul-bound variant (dim 2048); the feed-forward width is Llama's ``2/3 * 4 * dim`` rounded up
to a multiple of 256.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["Llama", "build_llama"]


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # In float32, as Llama does: bf16 squares lose the small activations.
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class Attention(torch.nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.wq, self.wk, self.wv, self.wo = (torch.nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x):
        batch, seq, dim = x.shape
        q, k, v = (w(x).view(batch, seq, self.heads, dim // self.heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, dim))


class FeedForward(torch.nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = torch.nn.Linear(dim, hidden, bias=False)
        self.w3 = torch.nn.Linear(dim, hidden, bias=False)
        self.w2 = torch.nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(torch.nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)
        self.attention = Attention(dim, heads)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(torch.nn.Module):
    def __init__(self, dim: int, layers: int, heads: int = 16, vocab: int = 2048):
        super().__init__()
        hidden = -(-int(2 * 4 * dim / 3) // 256) * 256
        self.tok_embeddings = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.output = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def build_llama(dim: int, layers: int, recipe: str | None, *, device, heads: int = 16, vocab: int = 2048, seed: int = 0) -> Llama:
    """A bf16 :class:`Llama`; with ``recipe``, every block projection is a torchao
    ``Float8Linear`` (the output head stays bf16)."""
    torch.manual_seed(seed)
    model = Llama(dim, layers, heads, vocab).to(device=device, dtype=torch.bfloat16)
    if recipe is not None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=lambda m, fqn: fqn != "output")
    return model


class PipelineStage(torch.nn.Module):
    """Consecutive :class:`Block` s of a :class:`Llama`, with its token embedding on the first stage
    and its norm and output head on the last; parameters shared with the model, not copied."""

    def __init__(self, model: Llama, first: int, last: int):
        super().__init__()
        self.tok_embeddings = model.tok_embeddings if first == 0 else None
        self.layers = torch.nn.ModuleList(model.layers[first:last])
        head = last == len(model.layers)
        self.norm, self.output = (model.norm, model.output) if head else (None, None)

    def forward(self, x):
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x)) if self.output is not None else x


def pipeline_problem(options: dict, num_stages: int, device, *, heads: int = 4, vocab: int = 256):
    """``fp8conf.tools.pipeline_check.launch``'s ``problem``: a Llama of ``options["blocks"]``
    layers of width ``options["dim"]`` cut into ``num_stages`` stages of consecutive layers, and
    one sequence of ``options["tokens"]`` random token ids per microbatch, with random next-token
    targets."""
    layers = options["blocks"]
    if layers < num_stages:
        raise ValueError(f"cannot cut {layers} Llama layers into {num_stages} stages")
    model = build_llama(options["dim"], layers, options["recipe"], device=device, heads=heads, vocab=vocab)
    bounds = [round(i * layers / num_stages) for i in range(num_stages + 1)]
    stages = [PipelineStage(model, bounds[i], bounds[i + 1]) for i in range(num_stages)]
    generator = torch.Generator().manual_seed(1)
    shape = (options["microbatches"], options["tokens"])
    batch = torch.randint(vocab, shape, generator=generator).to(device)
    target = torch.randint(vocab, shape, generator=generator).to(device)
    return stages, batch, target
