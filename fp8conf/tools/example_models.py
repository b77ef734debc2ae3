"""Example models: the transformer-like stack that the region map, the benchmarks and the GraphPP
tests trace. Per block: LayerNorm, up projection, GELU, down projection, residual."""

from __future__ import annotations

import torch

__all__ = ["MLPBlock", "BlockStack", "build_stack", "example_model"]


class MLPBlock(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, 4 * dim, bias=False)
        self.down = torch.nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class BlockStack(torch.nn.Module):
    """``blocks`` MLP blocks, optionally followed by a linear head (kept high precision)."""

    def __init__(self, dim: int, blocks: int, head: bool = True):
        super().__init__()
        self.blocks = torch.nn.ModuleList(MLPBlock(dim) for _ in range(blocks))
        self.head = torch.nn.Linear(dim, dim) if head else None

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x if self.head is None else self.head(x)


def build_stack(
    dim: int,
    blocks: int,
    recipe: str | None = "tensorwise",
    *,
    head: bool = True,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> BlockStack:
    """A :class:`BlockStack` whose block linears are converted to torchao ``Float8Linear`` with
    ``recipe`` (``None``: left high precision)."""
    torch.manual_seed(seed)
    model = BlockStack(dim, blocks, head=head).to(device=device, dtype=dtype)
    if recipe is not None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(
            model,
            config=Float8LinearConfig.from_recipe_name(recipe),
            module_filter_fn=lambda module, fqn: fqn != "head",
        )
    return model


def example_model(blocks: int = 6, dim: int = 64, tokens: int = 32):
    """The region map's default model: tensorwise ``Float8Linear`` blocks and a high-precision
    head; returns ``(model, args)``."""
    model = build_stack(dim, blocks)
    return model, (torch.randn(tokens, dim, requires_grad=True),)
