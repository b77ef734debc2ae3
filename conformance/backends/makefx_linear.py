"""The make_fx trainer's own FP8 linear on torch's second scaled-matmul API, ``F.scaled_mm``.

Trainers written against today's API quantize in their own code and call
``torch.nn.functional.scaled_mm`` (``aten._scaled_mm_v2``) with the scaling named per operand,
instead of going through TorchAO. :class:`ScaledMMTrainerLinear` is such a layer, written apart
from fp8conf's (the suite reads FP8 compute from operand dtypes, so any such layer must do):
recipe ``tensorwise`` (one scale per operand) or ``rowwise`` (one per row along each matmul's
contraction dim), scales ``amax / 448`` as they come (no rounding to powers of two), and all
three matmuls of a step in FP8. :func:`convert_linears` swaps a model's ``nn.Linear`` modules
for it (the adapter's ``Backend.convert_scaled_mm``).

:class:`Float8TrainerLinear` is the trainer's own float8 linear (the adapter's
``Backend.convert_float8``, :func:`convert_float8`): TorchAO's recipe names
(``tensorwise``, ``rowwise``, ``rowwise_with_gw_hp``, whose weight gradient is high precision)
on the same matmuls, and an emulated mode that quantizes alike and multiplies in high precision.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["FLOAT8_KIND", "FLOAT8_RECIPES", "KIND", "RECIPES", "Float8TrainerLinear", "ScaledMMTrainerLinear", "convert_float8", "convert_linears"]

#: The quantized module kind the trainer records for it.
KIND = "float8_scaled_mm_linear"
RECIPES = ("tensorwise", "rowwise")
#: The kind and recipes of the trainer's own float8 linear.
FLOAT8_KIND = "float8_linear"
FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
_E4M3 = torch.float8_e4m3fn
_E4M3_MAX = torch.finfo(_E4M3).max


def _quantize(t: torch.Tensor, recipe: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` (R, C), row-major, as e4m3 and its decoding scale (``()`` or ``(R, 1)``)."""
    amax = t.abs().amax() if recipe == "tensorwise" else t.abs().amax(dim=-1, keepdim=True)
    decode = amax.float().clamp(min=1e-12) / _E4M3_MAX
    return (t.float() / decode).clamp(-_E4M3_MAX, _E4M3_MAX).to(_E4M3), decode


def _fp8_matmul(lhs: torch.Tensor, rhs_t: torch.Tensor, recipe: str, out_dtype: torch.dtype, emulate: bool = False) -> torch.Tensor:
    """``lhs @ rhs_t.T``, both quantized along their last dim (the contraction dim); emulated:
    the dequantized operands multiplied in float32."""
    functional = torch.nn.functional
    recipe = "rowwise" if recipe == "rowwise_with_gw_hp" else recipe
    lhs_q, lhs_s = _quantize(lhs.contiguous(), recipe)
    rhs_q, rhs_s = _quantize(rhs_t.contiguous(), recipe)
    if emulate:
        return ((lhs_q.float() * lhs_s) @ (rhs_q.float() * rhs_s).t()).to(out_dtype)
    scaling = functional.ScalingType.TensorWise if recipe == "tensorwise" else functional.ScalingType.RowWise
    return functional.scaled_mm(lhs_q, rhs_q.t(), lhs_s, scaling, rhs_s.t(), scaling, output_dtype=out_dtype)


class _Matmuls(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, recipe: str):
        ctx.save_for_backward(x, weight)
        ctx.recipe = recipe
        return _fp8_matmul(x, weight, recipe, x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = _fp8_matmul(grad_out, weight.t(), ctx.recipe, x.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = _fp8_matmul(grad_out.t(), x.t(), ctx.recipe, weight.dtype)
        return grad_x, grad_w, None


class _Float8Matmuls(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, recipe: str, emulate: bool):
        ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.emulate = recipe, emulate
        return _fp8_matmul(x, weight, recipe, x.dtype, emulate)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = _fp8_matmul(grad_out, weight.t(), ctx.recipe, x.dtype, ctx.emulate)
        if ctx.needs_input_grad[1]:
            if ctx.recipe == "rowwise_with_gw_hp":
                grad_w = (grad_out.t() @ x).to(weight.dtype)
            else:
                grad_w = _fp8_matmul(grad_out.t(), x.t(), ctx.recipe, weight.dtype, ctx.emulate)
        return grad_x, grad_w, None, None


class ScaledMMTrainerLinear(nn.Linear):
    """``nn.Linear`` whose forward and backward matmuls run in FP8 through ``F.scaled_mm``.
    Features and the number of tokens per step must be multiples of 16."""

    def __init__(self, linear: nn.Linear, recipe: str):
        if recipe not in RECIPES:
            raise ValueError(f"ScaledMMTrainerLinear: recipe must be one of {RECIPES}, got {recipe!r}")
        with torch.device("meta"):
            super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None)
        self.weight, self.bias = linear.weight, linear.bias
        self.recipe = recipe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _Matmuls.apply(x.reshape(-1, self.in_features), self.weight, self.recipe)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias


def convert_linears(model: nn.Module, *, module_filter_fn, recipe: str) -> None:
    """Swap, in place, the plain ``nn.Linear`` modules ``module_filter_fn(module, fqn)`` accepts."""
    if not hasattr(torch.nn.functional, "scaled_mm"):
        raise RuntimeError(f"torch {torch.__version__} has no torch.nn.functional.scaled_mm (2.12 and newer)")
    chosen = [(fqn, m) for fqn, m in model.named_modules() if type(m) is nn.Linear and fqn and module_filter_fn(m, fqn)]
    for fqn, linear in chosen:
        parent, _, name = fqn.rpartition(".")
        setattr(model.get_submodule(parent), name, ScaledMMTrainerLinear(linear, recipe))


class Float8TrainerLinear(nn.Linear):
    """The trainer's own float8 linear: ``recipe`` one of :data:`FLOAT8_RECIPES`, ``emulate`` the
    emulated mode (no FP8 matmul). Features and tokens per step multiples of 16."""

    def __init__(self, linear: nn.Linear, recipe: str, emulate: bool = False):
        if recipe not in FLOAT8_RECIPES:
            raise ValueError(f"Float8TrainerLinear: recipe must be one of {FLOAT8_RECIPES}, got {recipe!r}")
        with torch.device("meta"):
            super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None)
        self.weight, self.bias = linear.weight, linear.bias
        self.recipe, self.emulate = recipe, bool(emulate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _Float8Matmuls.apply(x.reshape(-1, self.in_features), self.weight, self.recipe, self.emulate)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias


def convert_float8(model: nn.Module, *, module_filter_fn, recipe: str, emulate: bool) -> None:
    """Swap, in place, the plain ``nn.Linear`` modules ``module_filter_fn(module, fqn)`` accepts
    for :class:`Float8TrainerLinear`."""
    if not hasattr(torch.nn.functional, "scaled_mm"):
        raise RuntimeError(f"torch {torch.__version__} has no torch.nn.functional.scaled_mm (2.12 and newer)")
    chosen = [(fqn, m) for fqn, m in model.named_modules() if type(m) is nn.Linear and fqn and module_filter_fn(m, fqn)]
    for fqn, linear in chosen:
        parent, _, name = fqn.rpartition(".")
        setattr(model.get_submodule(parent), name, Float8TrainerLinear(linear, recipe, emulate))
