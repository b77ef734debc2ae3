"""A Llama-shaped model for the compile benchmarks: RMSNorm, causal SDPA attention with FP8
q/k/v/o projections, a SwiGLU feed-forward with FP8 projections, and a bf16 output head.

The shapes follow the Llama-3 debug model (dim 256, 6 layers, 16 heads, vocab 2048) and a
matmul-bound variant (dim 2048); the feed-forward width is Llama's ``2/3 * 4 * dim`` rounded up
to a multiple of 256.

With ``ffn="experts"`` each block's feed-forward is instead a mixture of experts: the MoE layer
the conformance suite draws (``conformance.draw.moe.MoELayer``: a bf16 top-k router, experts up
and down with a ReLU between them, token groups sorted by expert and padded with zero rows to
multiples of 16, all with static shapes), each expert as wide as the dense feed-forward. Its
experts are converted to fp8conf's rowwise FP8 grouped experts
(``fp8conf.convert_to_float8_grouped_experts``), the only recipe they have; the router stays in
bf16 and the attention projections are TorchAO ``Float8Linear`` s as in the dense model. Routing
with static shapes fixes the token count: an experts model is built for ``tokens`` tokens per
step (batch times sequence).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from conformance.draw.moe import MoESpec

__all__ = ["FFN_KINDS", "Llama", "build_llama"]

#: The feed-forward kinds of :func:`build_llama`.
FFN_KINDS = ("dense", "experts")


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


class ExpertsFeedForward(torch.nn.Module):
    """A mixture-of-experts feed-forward: ``conformance.draw.moe.MoELayer`` of ``spec`` on the
    ``(batch, seq, dim)`` activations flattened to ``spec.tokens`` rows, its output shaped back."""

    def __init__(self, spec: MoESpec):
        super().__init__()
        from conformance.draw.moe import MoELayer

        self.moe = MoELayer(spec)

    def forward(self, x):
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] != self.moe.spec.tokens:
            raise ValueError(f"this experts feed-forward routes {self.moe.spec.tokens} tokens per step (its padded token "
                             f"groups have static shapes), got {rows.shape[0]}; build the model with tokens={rows.shape[0]}")
        return self.moe(rows).view_as(x)


class Block(torch.nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, experts: MoESpec | None = None):
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)
        self.attention = Attention(dim, heads)
        self.feed_forward = FeedForward(dim, hidden) if experts is None else ExpertsFeedForward(experts)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


def feed_forward_width(dim: int) -> int:
    """Llama's feed-forward width for ``dim``: ``2/3 * 4 * dim`` rounded up to a multiple of 256."""
    return -(-int(2 * 4 * dim / 3) // 256) * 256


class Llama(torch.nn.Module):
    """``layers`` blocks between a token embedding and a bf16 output head. ``experts``: a
    ``conformance.draw.moe.MoESpec`` for a mixture-of-experts feed-forward in every block (its
    ``dim`` is the model's); ``None``, the dense SwiGLU feed-forward."""

    def __init__(self, dim: int, layers: int, heads: int = 16, vocab: int = 2048, experts: MoESpec | None = None):
        super().__init__()
        hidden = feed_forward_width(dim)
        self.tok_embeddings = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(Block(dim, heads, hidden, experts) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.output = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def experts_spec(dim: int, *, tokens: int, experts: int = 4, top_k: int = 2, emulate: bool = False) -> MoESpec:
    """The ``conformance.draw.moe.MoESpec`` of one block's experts feed-forward: ``experts``
    experts, each as wide as the dense feed-forward, ``top_k`` of them per token, on ``tokens``
    tokens per step; ``emulate``: the experts quantize as FP8 does but multiply in bf16."""
    from conformance.draw.moe import MoESpec

    return MoESpec(dim=dim, hidden=feed_forward_width(dim), experts=experts, top_k=top_k, tokens=tokens, emulate=emulate)


def build_llama(dim: int, layers: int, recipe: str | None, *, device, heads: int = 16, vocab: int = 2048, seed: int = 0,
                ffn: str = "dense", tokens: int | None = None, experts: int = 4, top_k: int = 2,
                emulate_experts: bool | None = None) -> Llama:
    """A bf16 :class:`Llama`; with ``recipe``, every block projection is a torchao
    ``Float8Linear`` (the output head stays bf16).

    With ``ffn="experts"`` every block's feed-forward is a mixture of ``experts`` experts, ``top_k``
    per token, routed over ``tokens`` tokens per step (required); with ``recipe`` its experts are
    fp8conf's ``Float8GroupedExperts`` of that recipe and its router stays bf16. Only recipe
    ``rowwise`` exists for grouped experts: another raises ``fp8conf.errors.GroupedExpertsError``
    (a ``ValueError``) rather than build a model that is not what it says.
    ``emulate_experts``: the experts quantize identically but multiply in bf16, as they must where
    torch has no FP8 grouped-GEMM kernel; ``None`` emulates them on any device but CUDA."""
    if ffn not in FFN_KINDS:
        raise ValueError(f"ffn must be one of {FFN_KINDS}, got {ffn!r}")
    spec = None
    if ffn == "experts":
        if tokens is None:
            raise ValueError("an experts Llama routes a fixed number of tokens per step: pass tokens=")
        emulate = str(device).split(":")[0] != "cuda" if emulate_experts is None else emulate_experts
        spec = experts_spec(dim, tokens=tokens, experts=experts, top_k=top_k, emulate=emulate)
    torch.manual_seed(seed)
    model = Llama(dim, layers, heads, vocab, spec).to(device=device, dtype=torch.bfloat16)
    if recipe is not None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        if spec is None:
            convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=lambda m, fqn: fqn != "output")
        else:
            import fp8conf

            # The experts first: a recipe grouped experts do not have is refused before any change.
            fp8conf.convert_to_float8_grouped_experts(model, recipe=recipe, emulate=spec.emulate,
                                                      module_filter_fn=lambda m, fqn: fqn.endswith((".experts_up", ".experts_down")))
            convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                                       module_filter_fn=lambda m, fqn: fqn != "output" and not fqn.endswith(".router"))
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
