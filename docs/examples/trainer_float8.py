"""A graph trainer's own FP8 linear, written the way trainers now write them.

This file imports torch only: it stands for a trainer that owns its quantization and cannot
import fp8conf in its model code. fp8conf learns what the module computes from a registration
made elsewhere (``fp8conf.register_quantized_module``; see ``docs/own_modules.md``).

What makes it unlike TorchAO's ``Float8Linear``, and hard on a pass that looks for FP8:

* its recipes are ``rowwise`` and ``rowwise_with_gw_hp`` only (no tensorwise);
* the weight is quantized under ``torch.no_grad()``, outside the ``autograd.Function``, so the
  cast records no autograd node of its own;
* the forward matmul runs on ``F.scaled_mm`` (``aten._scaled_mm_v2``) and the backward ones on
  ``torch._scaled_mm``: two APIs in one module;
* ``rowwise_with_gw_hp`` computes the weight gradient in high precision;
* ``emulate=True`` quantizes exactly as the real path does and multiplies the dequantized
  operands in high precision: no FP8 matmul, for machines without FP8 kernels.

Scales are powers of two (clearing the mantissa bits of ``max / amax``), so eager and compiled
code quantize to the same bytes.
"""

from __future__ import annotations

import torch
from torch import nn

RECIPES = ("rowwise", "rowwise_with_gw_hp")
_E4M3 = torch.float8_e4m3fn
_MAX = torch.finfo(_E4M3).max


def quantize_rowwise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` (R, C) as e4m3 with one power-of-two scale per row; returns ``(data, 1 / scale)``,
    the inverse scale being what the scaled matmuls multiply by."""
    amax = t.abs().amax(dim=-1, keepdim=True).to(torch.float32).clamp(min=1e-12)
    scale = ((_MAX / amax).view(torch.int32) & 0x7F800000).view(torch.float32)
    data = (t.to(torch.float32) * scale).clamp(-_MAX, _MAX).to(_E4M3)
    return data, scale.reciprocal()


def _dequantized_mm(a_data, a_inv, b_data, b_inv, out_dtype) -> torch.Tensor:
    """``a @ b.T`` of the dequantized operands, in float32: what the scaled matmuls compute."""
    return ((a_data.to(torch.float32) * a_inv) @ (b_data.to(torch.float32) * b_inv).t()).to(out_dtype)


def _forward_mm(x: torch.Tensor, w_data: torch.Tensor, w_inv: torch.Tensor, emulate: bool) -> torch.Tensor:
    x_data, x_inv = quantize_rowwise(x)
    if emulate:
        return _dequantized_mm(x_data, x_inv, w_data, w_inv, x.dtype)
    rowwise = torch.nn.functional.ScalingType.RowWise
    return torch.nn.functional.scaled_mm(x_data, w_data.t(), x_inv, rowwise, w_inv.t(), rowwise, output_dtype=x.dtype)


def _backward_mm(lhs: torch.Tensor, rhs_t: torch.Tensor, out_dtype: torch.dtype, emulate: bool) -> torch.Tensor:
    """``lhs @ rhs_t.T`` through ``torch._scaled_mm``, both quantized rowwise along the contraction."""
    lhs_data, lhs_inv = quantize_rowwise(lhs.contiguous())
    rhs_data, rhs_inv = quantize_rowwise(rhs_t.contiguous())
    if emulate:
        return _dequantized_mm(lhs_data, lhs_inv, rhs_data, rhs_inv, out_dtype)
    return torch._scaled_mm(lhs_data, rhs_data.t(), lhs_inv, rhs_inv.t(), out_dtype=out_dtype)


class _Float8LinearFunction(torch.autograd.Function):
    """``x @ weight.T`` for ``x`` of any leading dims, from the weight quantized beforehand."""

    @staticmethod
    def forward(ctx, x, weight, w_data, w_inv, recipe: str, emulate: bool):
        ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.emulate = recipe, emulate
        out = _forward_mm(x.reshape(-1, x.shape[-1]), w_data, w_inv, emulate)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        shape = x.shape
        x, grad_out = x.reshape(-1, shape[-1]), grad_out.reshape(-1, weight.shape[0])
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = _backward_mm(grad_out, weight.t(), x.dtype, ctx.emulate).reshape(shape)
        if ctx.needs_input_grad[1]:
            if ctx.recipe == "rowwise_with_gw_hp":
                grad_w = (grad_out.t() @ x).to(weight.dtype)
            else:
                grad_w = _backward_mm(grad_out.t(), x.t(), weight.dtype, ctx.emulate)
        return grad_x, grad_w, None, None, None, None


class TrainerFloat8Linear(nn.Linear):
    """``nn.Linear`` computing in FP8 with a trainer's own autograd. ``recipe`` is ``rowwise`` or
    ``rowwise_with_gw_hp``; ``emulate=True`` quantizes alike and multiplies in high precision (no
    FP8 compute), for machines without FP8 kernels."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, recipe: str = "rowwise",
                 emulate: bool = False, device=None, dtype=None):
        if recipe not in RECIPES:
            raise ValueError(f"TrainerFloat8Linear: recipe must be one of {RECIPES}, got {recipe!r}")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = recipe
        self.emulate = emulate

    @classmethod
    def from_float(cls, linear: nn.Linear, *, recipe: str = "rowwise", emulate: bool = False) -> TrainerFloat8Linear:
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, recipe=recipe, emulate=emulate)
        new.weight, new.bias = linear.weight, linear.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The weight's cast is made outside the autograd function and records no autograd node:
        # its ops carry the sequence number of whatever ran before (the previous call's
        # function, when the module is called twice in a row).
        with torch.no_grad():
            w_data, w_inv = quantize_rowwise(self.weight)
        out = _Float8LinearFunction.apply(x, self.weight, w_data, w_inv, self.recipe, self.emulate)
        return out if self.bias is None else out + self.bias.to(out.dtype)


def convert(model: nn.Module, *, recipe: str = "rowwise", emulate: bool = False, module_filter_fn=None) -> nn.Module:
    """Swap ``model``'s plain ``nn.Linear`` modules for :class:`TrainerFloat8Linear`, in place."""
    swapped: dict[int, TrainerFloat8Linear] = {}
    for fqn, module in list(model.named_modules(remove_duplicate=False)):
        if type(module) is not nn.Linear or (module_filter_fn is not None and not module_filter_fn(module, fqn)):
            continue
        new = swapped.setdefault(id(module), TrainerFloat8Linear.from_float(module, recipe=recipe, emulate=emulate))
        parent, _, name = fqn.rpartition(".")
        setattr(model.get_submodule(parent), name, new)
    return model
