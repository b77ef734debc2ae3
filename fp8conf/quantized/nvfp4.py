"""NVFP4 training for ``nn.Linear``: quantize-to-NVFP4 helpers, :class:`NVFP4Linear` and its converter.

NVFP4 stores a tensor as packed ``float4_e2m1fn_x2`` elements (two e2m1 values a byte, the first
element in the low nibble) with two levels of scale: one ``float8_e4m3fn`` scale per block of 16
consecutive elements along the contraction dim, and one float32 global scale per tensor. An
element dequantizes to ``e2m1 * block_scale * global_scale``. The global scale is
``amax / (448 * 6)``, so that every block scale (``block_amax / 6 / global``) fits e4m3.

Torch's second scaled-matmul API runs it: ``F.scaled_mm`` with, per operand, the scales
``[block, global]``, recipes ``[BlockWise1x16, TensorWise]`` and swizzles
``[SWIZZLE_32_4_4, NO_SWIZZLE]``: the block scales in cuBLAS's tiled layout of 128 rows by 4
scale columns (:func:`swizzle_block_scales`, the layout of MX scales, :func:`~fp8conf.quantized.ops.e8m0.to_cublas_blocked`).
Only sm100 GPUs have the kernel. On CPU, graphs with these matmuls trace (torch's Meta kernel
checks the layout) and compile, but do not run; recipe ``nvfp4_emulated`` quantizes identically
and multiplies the dequantized operands in float32, and runs everywhere.

:class:`NVFP4Linear` quantizes its three matmuls (output, grad_input, grad_weight), each operand
along that matmul's contraction dim, zero-padded to a multiple of 32 (a packed row of a float4
operand is 16-byte aligned). :func:`convert_to_nvfp4_training` swaps a model's ``nn.Linear``
modules for it.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from fp8conf.arguments import require
from fp8conf.errors import NVFP4ConversionError
from fp8conf.quantized.ops.e8m0 import to_cublas_blocked
from fp8conf.quantized.protocol import QuantizationConfig
from fp8conf.quantized.scaled_mm import has_scaled_mm_v2
from fp8conf.quantized.swap import plain_linears, swap_linears

__all__ = [
    "NVFP4_KIND",
    "NVFP4_RECIPES",
    "NVFP4_BLOCK_SIZE",
    "E2M1_MAX",
    "has_nvfp4",
    "to_nvfp4",
    "from_nvfp4",
    "swizzle_block_scales",
    "swizzled_scales_numel",
    "nvfp4_scaled_mm",
    "NVFP4Linear",
    "convert_to_nvfp4_training",
]

#: The quantized module kind of :class:`NVFP4Linear`.
NVFP4_KIND = "nvfp4_linear"
#: Its recipes: ``nvfp4`` runs torch's NVFP4 scaled matmul, ``nvfp4_emulated`` a float32 one on
#: the dequantized operands.
NVFP4_RECIPES = ("nvfp4", "nvfp4_emulated")
#: Elements per e4m3 block scale along the contraction dim.
NVFP4_BLOCK_SIZE = 16
#: Largest e2m1 magnitude.
E2M1_MAX = 6.0
_E4M3_MAX = 448.0
#: Contraction dims are padded to this (16 bytes of packed float4).
ALIGNMENT = 32
_HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# e2m1 magnitudes by code (sign is bit 3), and the midpoints between neighbours.
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_SCALE_TILE = (128, 4)


def has_nvfp4() -> bool:
    """Whether this torch has the packed FP4 dtype and ``F.scaled_mm`` (torch 2.12 and newer)."""
    return hasattr(torch, "float4_e2m1fn_x2") and has_scaled_mm_v2()


def swizzled_scales_numel(rows: int, k: int) -> int:
    """How many block scales an operand of ``rows`` rows and contraction dim ``k`` has in the
    swizzled layout: rows padded to 128, ``k / 16`` scale columns padded to 4."""
    blocks = -(-k // NVFP4_BLOCK_SIZE)
    tile_rows, tile_cols = _SCALE_TILE
    return -(-rows // tile_rows) * tile_rows * (-(-blocks // tile_cols) * tile_cols)


def swizzle_block_scales(scales: torch.Tensor) -> torch.Tensor:
    """``(rows, k / 16)`` e4m3 block scales in ``SWIZZLE_32_4_4`` layout: a 1-D tensor of
    :func:`swizzled_scales_numel` scales, padding zero."""
    return to_cublas_blocked(scales.view(torch.uint8)).view(torch.float8_e4m3fn)


def to_nvfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x`` (R, C), C a multiple of 16, to NVFP4 along C.

    Returns ``(packed, block_scales, global_scale)``: ``packed`` (R, C / 2) ``float4_e2m1fn_x2``,
    ``block_scales`` (R, C / 16) ``float8_e4m3fn`` (row-major, not swizzled) and ``global_scale``
    a float32 scalar, with ``x ≈ e2m1 * block_scale * global_scale``. Elements round to the
    nearest e2m1 value (ties to the smaller magnitude); an all-zero tensor gets global scale 1.
    """
    rows, k = x.shape
    if k % NVFP4_BLOCK_SIZE != 0:
        raise ValueError(f"to_nvfp4: the last dim ({k}) is not a multiple of {NVFP4_BLOCK_SIZE}; pad it with zeros")
    blocks = x.to(torch.float32).reshape(rows, k // NVFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE)
    amax = blocks.abs().amax()
    global_scale = torch.where(amax > 0, amax / (_E4M3_MAX * E2M1_MAX), torch.ones_like(amax))
    block_amax = blocks.abs().amax(dim=-1)
    block_scales = (block_amax / E2M1_MAX / global_scale).clamp(max=_E4M3_MAX).to(torch.float8_e4m3fn)
    divisor = block_scales.to(torch.float32) * global_scale
    divisor = torch.where(divisor > 0, divisor, torch.ones_like(divisor))
    scaled = (blocks / divisor.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX)
    boundaries = torch.tensor(_E2M1_MIDPOINTS, dtype=torch.float32, device=x.device)
    codes = torch.bucketize(scaled.abs(), boundaries).to(torch.uint8) | (scaled < 0).to(torch.uint8) << 3
    codes = codes.reshape(rows, k)
    packed = codes[:, 0::2] | codes[:, 1::2] << 4
    return packed.view(torch.float4_e2m1fn_x2), block_scales, global_scale


def from_nvfp4(packed: torch.Tensor, block_scales: torch.Tensor, global_scale: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize :func:`to_nvfp4`'s output (row-major block scales): ``(R, C)`` in ``dtype``."""
    rows = packed.shape[0]
    data = packed.view(torch.uint8)
    codes = torch.stack((data & 0xF, data >> 4), dim=-1).reshape(rows, -1).to(torch.int64)
    values = torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=packed.device)
    elements = values[codes & 0x7] * torch.where(codes >= 8, -1.0, 1.0)
    k = elements.shape[1]
    blocks = elements.reshape(rows, k // NVFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE)
    scale = block_scales.to(torch.float32) * global_scale
    return (blocks * scale.unsqueeze(-1)).reshape(rows, k).to(dtype)


def _pad_last_dim(t: torch.Tensor) -> torch.Tensor:
    pad = -t.shape[-1] % ALIGNMENT
    return torch.nn.functional.pad(t, (0, pad)) if pad else t


def nvfp4_scaled_mm(lhs_q, lhs_scales, lhs_global, rhs_q, rhs_scales, rhs_global, out_dtype) -> torch.Tensor:
    """``lhs @ rhs.T`` for NVFP4 operands (``lhs_q`` (R, C/2), ``rhs_q`` (S, C/2) packed,
    row-major block scales), through ``F.scaled_mm`` with swizzled block scales."""
    functional = torch.nn.functional
    recipes = [functional.ScalingType.BlockWise1x16, functional.ScalingType.TensorWise]
    swizzles = [functional.SwizzleType.SWIZZLE_32_4_4, functional.SwizzleType.NO_SWIZZLE]
    return functional.scaled_mm(
        lhs_q, rhs_q.t(),
        [swizzle_block_scales(lhs_scales), lhs_global], recipes,
        [swizzle_block_scales(rhs_scales), rhs_global], recipes,
        swizzle_a=swizzles, swizzle_b=swizzles, output_dtype=out_dtype,
    )


def _matmul(lhs: torch.Tensor, rhs_t: torch.Tensor, out_dtype: torch.dtype, emulate: bool) -> torch.Tensor:
    """``lhs @ rhs_t.T`` for ``lhs`` (R, C), ``rhs_t`` (S, C), both quantized to NVFP4 along C."""
    lhs_q = to_nvfp4(_pad_last_dim(lhs).contiguous())
    rhs_q = to_nvfp4(_pad_last_dim(rhs_t).contiguous())
    if emulate:
        return torch.mm(from_nvfp4(*lhs_q), from_nvfp4(*rhs_q).t()).to(out_dtype)
    return nvfp4_scaled_mm(*lhs_q, *rhs_q, out_dtype)


@torch._dynamo.allow_in_graph
class _NVFP4LinearFunction(torch.autograd.Function):
    """``x @ weight.T`` with all three matmuls of forward+backward in NVFP4, each operand quantized
    along its matmul's contraction dim; the high-precision ``x`` and ``weight`` are saved."""

    @staticmethod
    def forward(ctx, x, weight, emulate: bool):
        ctx.save_for_backward(x, weight)
        ctx.emulate = emulate
        return _matmul(x, weight, x.dtype, emulate)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = _matmul(grad_out, weight.t(), x.dtype, ctx.emulate)
        if ctx.needs_input_grad[1]:
            grad_w = _matmul(grad_out.t(), x.t(), weight.dtype, ctx.emulate)
        return grad_x, grad_w, None


def _features_problem(in_features: int, out_features: int) -> str | None:
    bad = [f"{name}={value}" for name, value in (("in_features", in_features), ("out_features", out_features))
           if value % ALIGNMENT != 0]
    return f"{', '.join(bad)} not a multiple of {ALIGNMENT}" if bad else None


class NVFP4Linear(nn.Linear):
    """``nn.Linear`` whose forward and backward matmuls run in NVFP4.

    Attributes:
        quant_kind: ``"nvfp4_linear"`` (the kind fp8conf's provenance names).
        recipe: ``"nvfp4"`` or ``"nvfp4_emulated"``.
        emulate: whether the recipe is the emulated one.

    Inputs may have leading batch dims; the output has the input's dtype.
    """

    quant_kind = NVFP4_KIND

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 recipe: str = "nvfp4"):
        if recipe not in NVFP4_RECIPES:
            raise NVFP4ConversionError(f"NVFP4Linear: recipe must be one of {NVFP4_RECIPES}, got {recipe!r}", module_fqn=None)
        problem = _features_problem(in_features, out_features)
        if problem:
            raise NVFP4ConversionError(f"NVFP4Linear: {problem}", module_fqn=None)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = recipe
        self.emulate = recipe == "nvfp4_emulated"

    @classmethod
    def from_float(cls, linear: nn.Linear, *, recipe: str = "nvfp4") -> NVFP4Linear:
        """An ``NVFP4Linear`` that takes over ``linear``'s weight and bias Parameters (no copy)."""
        require(linear, nn.Linear, "NVFP4Linear.from_float", "linear", "a torch.nn.Linear")
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, recipe=recipe)
        new.weight = linear.weight
        new.bias = linear.bias
        return new

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.shape[-1] != self.in_features or input.dtype not in _HP_DTYPES:
            raise NVFP4ConversionError(
                f"NVFP4Linear: `input` must end in in_features={self.in_features} and have a dtype in {_HP_DTYPES}; "
                f"got shape {tuple(input.shape)}, dtype {input.dtype}",
                module_fqn=None,
            )
        out = _NVFP4LinearFunction.apply(input.reshape(-1, self.in_features), self.weight, self.emulate)
        out = out.reshape(*input.shape[:-1], self.out_features)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    def fp8_quantization(self) -> QuantizationConfig:
        """The quantized-module protocol: kind ``nvfp4_linear``, its recipe, emulated or not."""
        return QuantizationConfig(kind=self.quant_kind, recipe=self.recipe, emulate=self.emulate)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}"


def convert_to_nvfp4_training(
    model: nn.Module,
    *,
    recipe: str = "nvfp4",
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> nn.Module:
    """Swap the plain ``nn.Linear`` modules of ``model`` for :class:`NVFP4Linear`, in place.

    ``module_filter_fn(module, fqn)`` picks among them (torchao's signature); subclasses of
    ``nn.Linear`` are left alone. Every candidate is checked before any is swapped, so a failure
    leaves ``model`` unchanged. Returns ``model`` (or the new module when ``model`` itself is
    converted).

    Raises:
        NVFP4ConversionError: (a ``ValueError``) on a torch without ``float4_e2m1fn_x2`` or
            ``F.scaled_mm``, for an unknown ``recipe``, or naming a linear whose features are
            not multiples of 32.
    """
    require(model, "model", "convert_to_nvfp4_training", "model")
    if not has_nvfp4():
        raise NVFP4ConversionError(
            f"convert_to_nvfp4_training: torch {torch.__version__} has no torch.float4_e2m1fn_x2 or "
            "torch.nn.functional.scaled_mm (torch 2.12 and newer have both)",
            module_fqn=None,
        )
    if recipe not in NVFP4_RECIPES:
        raise NVFP4ConversionError(
            f"convert_to_nvfp4_training: recipe must be one of {NVFP4_RECIPES}, got {recipe!r}", module_fqn=None
        )
    def refuse(fqn, problem):
        return NVFP4ConversionError(
            f"convert_to_nvfp4_training: linear {fqn or '<root>'!r} has {problem}; NVFP4 matmuls need both "
            f"multiples of {ALIGNMENT}. Exclude it with module_filter_fn (e.g. `lambda m, fqn: fqn != {fqn!r}`) "
            "or resize the layer",
            module_fqn=fqn,
        )

    found = plain_linears(model, module_filter_fn, _features_problem, refuse)
    return swap_linears(model, found, lambda linear: NVFP4Linear.from_float(linear, recipe=recipe))
