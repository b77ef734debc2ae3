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

:class:`NVFP4TrainerLinear` is the trainer's own NVFP4 linear (``Backend.convert_nvfp4``,
:func:`convert_nvfp4`), also written apart from fp8conf's: e2m1 elements by a lookup of the
nearest grid value (ties away from zero), e4m3 scales of blocks of 16 over a float32 global
scale, swizzled into cuBLAS's 128x4 tiles by its own index arithmetic, all three matmuls through
``F.scaled_mm``; recipe ``nvfp4_emulated`` multiplies the dequantized operands in float32.

:class:`MXTrainerLinear` is the trainer's own MX linear (``Backend.convert_mx``,
:func:`convert_mx`; recipe ``mxfp8_swizzled`` only): e4m3 elements under power-of-two scales of
blocks of 32, the exponent read off ``torch.frexp`` of each block's amax, the scales as
``float8_e8m0fnu`` bytes in the same tiled layout, all three matmuls through ``F.scaled_mm``.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = [
    "FLOAT8_KIND", "FLOAT8_RECIPES", "KIND", "NVFP4_KIND", "NVFP4_RECIPES", "RECIPES", "Float8TrainerLinear", "NVFP4TrainerLinear",
    "ScaledMMTrainerLinear", "convert_float8", "convert_linears", "convert_nvfp4", "MX_KIND", "MX_RECIPES", "MXTrainerLinear",
    "convert_mx",
]

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


# --- NVFP4 ----------------------------------------------------------------------------------------

#: The kind and recipes of the trainer's own NVFP4 linear.
NVFP4_KIND = "nvfp4_linear"
NVFP4_RECIPES = ("nvfp4", "nvfp4_emulated")
_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _to_nvfp4(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``t`` (R, C), C a multiple of 32: packed e2m1 (R, C/2), e4m3 block scales (R, C/16) and the
    float32 global scale. Each element takes the nearest grid value (ties away from zero)."""
    rows, cols = t.shape
    blocks = t.float().view(rows, cols // 16, 16)
    glob = (t.abs().amax().float() / (6.0 * 448.0)).clamp(min=2.0**-126)
    scale = (blocks.abs().amax(-1) / (6.0 * glob)).to(torch.float8_e4m3fn)
    denominator = (scale.float() * glob).clamp(min=2.0**-126).unsqueeze(-1)
    unit = (blocks / denominator).clamp(-6.0, 6.0)
    grid = torch.tensor(_GRID, device=t.device)
    distance = (unit.abs().unsqueeze(-1) - grid).abs()
    # The last of the nearest grid values: a tie goes to the larger magnitude.
    code = (grid.numel() - 1 - distance.flip(-1).argmin(-1)).to(torch.uint8)
    code = (code | ((unit < 0) & (code > 0)).to(torch.uint8) * 8).view(rows, cols)
    packed = (code[:, 1::2] << 4) | code[:, 0::2]
    return packed.view(torch.float4_e2m1fn_x2), scale, glob


def _swizzled(scale: torch.Tensor) -> torch.Tensor:
    """(R, C) one-byte block scales (e4m3 or e8m0) in cuBLAS's tiled layout, in their own dtype:
    zero-padded to 128-row, 4-column tiles, tiles row-major, row ``32g + i`` and column ``c`` of
    a tile at ``16i + 4g + c``."""
    rows, cols = scale.shape
    padded_rows, padded_cols = -(-rows // 128) * 128, -(-cols // 4) * 4
    out = torch.zeros(padded_rows, padded_cols, dtype=torch.uint8, device=scale.device)
    out[:rows, :cols] = scale.view(torch.uint8)
    r = torch.arange(padded_rows, device=scale.device).unsqueeze(1)
    c = torch.arange(padded_cols, device=scale.device).unsqueeze(0)
    tile = (r // 128) * (padded_cols // 4) + c // 4
    index = tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
    flat = torch.zeros(padded_rows * padded_cols, dtype=torch.uint8, device=scale.device)
    flat[index.reshape(-1)] = out.reshape(-1)
    return flat.view(scale.dtype)


def _dequantized(packed: torch.Tensor, scale: torch.Tensor, glob: torch.Tensor) -> torch.Tensor:
    data = packed.view(torch.uint8)
    code = torch.stack((data & 0xF, data >> 4), -1).view(data.shape[0], -1).long()
    grid = torch.tensor(_GRID, device=packed.device)
    value = grid[code & 7] * (1 - 2 * (code >> 3)).float()
    rows, cols = value.shape
    return (value.view(rows, cols // 16, 16) * (scale.float() * glob).unsqueeze(-1)).view(rows, cols)


def _nvfp4_matmul(lhs: torch.Tensor, rhs_t: torch.Tensor, out_dtype: torch.dtype, emulate: bool) -> torch.Tensor:
    """``lhs @ rhs_t.T``, both quantized to NVFP4 along their last dim, zero-padded to 32."""
    functional = torch.nn.functional
    pad = -lhs.shape[-1] % 32
    lhs_q = _to_nvfp4(functional.pad(lhs, (0, pad)).contiguous())
    rhs_q = _to_nvfp4(functional.pad(rhs_t, (0, pad)).contiguous())
    if emulate:
        return (_dequantized(*lhs_q) @ _dequantized(*rhs_q).t()).to(out_dtype)
    recipes = [functional.ScalingType.BlockWise1x16, functional.ScalingType.TensorWise]
    swizzles = [functional.SwizzleType.SWIZZLE_32_4_4, functional.SwizzleType.NO_SWIZZLE]
    return functional.scaled_mm(
        lhs_q[0], rhs_q[0].t(), [_swizzled(lhs_q[1]), lhs_q[2]], recipes, [_swizzled(rhs_q[1]), rhs_q[2]], recipes,
        swizzle_a=swizzles, swizzle_b=swizzles, output_dtype=out_dtype,
    )


class _NVFP4Matmuls(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, emulate: bool):
        ctx.save_for_backward(x, weight)
        ctx.emulate = emulate
        return _nvfp4_matmul(x, weight, x.dtype, emulate)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = _nvfp4_matmul(grad_out, weight.t(), x.dtype, ctx.emulate) if ctx.needs_input_grad[0] else None
        grad_w = _nvfp4_matmul(grad_out.t(), x.t(), weight.dtype, ctx.emulate) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


class NVFP4TrainerLinear(nn.Linear):
    """The trainer's own NVFP4 linear: ``recipe`` one of :data:`NVFP4_RECIPES`. Features multiples of 32."""

    def __init__(self, linear: nn.Linear, recipe: str):
        if recipe not in NVFP4_RECIPES:
            raise ValueError(f"NVFP4TrainerLinear: recipe must be one of {NVFP4_RECIPES}, got {recipe!r}")
        with torch.device("meta"):
            super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None)
        self.weight, self.bias = linear.weight, linear.bias
        self.recipe, self.emulate = recipe, recipe == "nvfp4_emulated"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _NVFP4Matmuls.apply(x.reshape(-1, self.in_features), self.weight, self.emulate)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias


def convert_nvfp4(model: nn.Module, *, module_filter_fn, recipe: str) -> None:
    """Swap, in place, the plain ``nn.Linear`` modules ``module_filter_fn(module, fqn)`` accepts
    for :class:`NVFP4TrainerLinear`."""
    if not hasattr(torch, "float4_e2m1fn_x2") or not hasattr(torch.nn.functional, "scaled_mm"):
        raise RuntimeError(f"torch {torch.__version__} has no float4_e2m1fn_x2 or torch.nn.functional.scaled_mm")
    chosen = [(fqn, m) for fqn, m in model.named_modules() if type(m) is nn.Linear and fqn and module_filter_fn(m, fqn)]
    for fqn, linear in chosen:
        parent, _, name = fqn.rpartition(".")
        setattr(model.get_submodule(parent), name, NVFP4TrainerLinear(linear, recipe))


# --- MXFP8 with swizzled scales --------------------------------------------------------------------

#: The kind and recipe of the trainer's own MX linear.
MX_KIND = "mxfp8_linear"
MX_RECIPES = ("mxfp8_swizzled",)


def _to_mx(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` (R, C), C a multiple of 32: e4m3 elements and (R, C/32) e8m0 scales. A block's scale
    is ``2**(e - 9)`` for its amax ``m * 2**e`` (``0.5 <= m < 1``), so the amax lands in [256, 512)
    and saturates to 448 at most."""
    rows, cols = t.shape
    blocks = t.float().view(rows, cols // 32, 32)
    _mantissa, exponent = torch.frexp(blocks.abs().amax(-1))
    biased = (exponent - 9 + 127).clamp(1, 254)
    elements = (blocks * torch.ldexp(torch.ones_like(blocks), (127 - biased).unsqueeze(-1))).clamp(-448.0, 448.0)
    return elements.to(torch.float8_e4m3fn).view(rows, cols), biased.to(torch.uint8).view(torch.float8_e8m0fnu)


def _mx_matmul(lhs: torch.Tensor, rhs_t: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``lhs @ rhs_t.T``, both quantized to MXFP8 along their last dim, zero-padded to 32."""
    functional = torch.nn.functional
    pad = -lhs.shape[-1] % 32
    lhs_q, lhs_s = _to_mx(functional.pad(lhs, (0, pad)).contiguous())
    rhs_q, rhs_s = _to_mx(functional.pad(rhs_t, (0, pad)).contiguous())
    block, swizzle = functional.ScalingType.BlockWise1x32, functional.SwizzleType.SWIZZLE_32_4_4
    return functional.scaled_mm(lhs_q, rhs_q.t(), _swizzled(lhs_s), block, _swizzled(rhs_s), block,
                                swizzle_a=swizzle, swizzle_b=swizzle, output_dtype=out_dtype)


class _MXMatmuls(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return _mx_matmul(x, weight, x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = _mx_matmul(grad_out, weight.t(), x.dtype) if ctx.needs_input_grad[0] else None
        grad_w = _mx_matmul(grad_out.t(), x.t(), weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w


class MXTrainerLinear(nn.Linear):
    """The trainer's own MX linear, recipe ``mxfp8_swizzled``. Features multiples of 32."""

    def __init__(self, linear: nn.Linear, recipe: str):
        if recipe not in MX_RECIPES:
            raise ValueError(f"MXTrainerLinear: recipe must be one of {MX_RECIPES}, got {recipe!r}")
        with torch.device("meta"):
            super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None)
        self.weight, self.bias = linear.weight, linear.bias
        self.recipe, self.emulate = recipe, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _MXMatmuls.apply(x.reshape(-1, self.in_features), self.weight)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias


def convert_mx(model: nn.Module, *, module_filter_fn, recipe: str) -> None:
    """Swap, in place, the plain ``nn.Linear`` modules ``module_filter_fn(module, fqn)`` accepts
    for :class:`MXTrainerLinear`."""
    chosen = [(fqn, m) for fqn, m in model.named_modules() if type(m) is nn.Linear and fqn and module_filter_fn(m, fqn)]
    for fqn, linear in chosen:
        parent, _, name = fqn.rpartition(".")
        setattr(model.get_submodule(parent), name, MXTrainerLinear(linear, recipe))
