"""MXFP8 training for ``nn.Linear``: quantize-to-MX helpers, :class:`MXLinear` and its converter.

MXFP8 (OCP Microscaling v1.0) stores a tensor as ``float8_e4m3fn`` elements plus one E8M0
power-of-two scale per block of 32 consecutive elements. Scales are E8M0 bytes (byte ``b`` means
``2**(b - 127)``). Where Inductor compiles e8m0 (torch 2.14 and newer) they travel as
``torch.float8_e8m0fnu`` tensors, as TorchAO's MX tensors carry them; on older torch, whose CPU
Inductor has no C++ type for e8m0, as ``uint8`` tensors of the same bytes, so that
``torch.compile`` can compile the quantization (:func:`default_scale_dtype` says which, and why).

:class:`MXLinear` quantizes its three matmuls (output, grad_input, grad_weight) to MXFP8, each
operand along the matmul's contraction dim, and runs them through ``fp8conf::scaled_mm_e8m0``
(row-major scales). Its ``"mxfp8_emulated"`` recipe quantizes identically but multiplies the
dequantized tensors with a plain float32 ``torch.mm`` and never calls the op (torchao's
``emulate=True`` analogue). Its ``"mxfp8_swizzled"`` recipe runs them through torch's second
scaled-matmul API instead, as trainers that own their MX linears do: ``F.scaled_mm`` with
``float8_e8m0fnu`` scales, recipe ``BlockWise1x32`` and swizzle ``SWIZZLE_32_4_4`` (cuBLAS's
tiled layout, :func:`~fp8conf.quantized.ops.e8m0.to_cublas_blocked`). Only sm100 GPUs have that
kernel; elsewhere its graphs trace (torch's Meta kernel checks the layout) but do not run, and
Inductor of torch 2.13 does not lower swizzled scales.
:func:`convert_to_mx_training` swaps a model's ``nn.Linear`` modules for it.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from fp8conf import torch_internals
from fp8conf.arguments import require
from fp8conf.errors import MXArgumentError, MXConversionError
from fp8conf.log import logger
from fp8conf.quantized.ops.e8m0 import MX_BLOCK_SIZE, SCALE_DTYPES, apply_e8m0_scale, scaled_mm_e8m0, to_cublas_blocked
from fp8conf.quantized.protocol import QuantizationConfig
from fp8conf.quantized.scaled_mm import has_scaled_mm_v2
from fp8conf.quantized.swap import swap_linears

__all__ = [
    "E4M3_MAX",
    "E4M3_MAX_POW2",
    "RECIPES",
    "SCALE_ROUNDINGS",
    "SCALE_DTYPES",
    "default_scale_dtype",
    "MXArgumentError",
    "MXConversionError",
    "to_mx",
    "from_mx",
    "MXLinear",
    "convert_to_mx_training",
    "swizzled_scaled_mm",
]

#: Largest finite ``float8_e4m3fn`` value.
E4M3_MAX = 448.0
#: ``floor(log2(E4M3_MAX))``: the OCP spec's emax for e4m3.
E4M3_MAX_POW2 = 8
#: Recipes of :class:`MXLinear`.
RECIPES = ("mxfp8", "mxfp8_emulated", "mxfp8_swizzled")
#: Scale roundings: ``floor`` is the OCP MX v1.0 rule; ``rup`` rounds the scale up so no element
#: saturates.
SCALE_ROUNDINGS = ("floor", "rup")
_HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_F32_MANTISSA_BITS = 23
_F32_MANTISSA_MASK = (1 << _F32_MANTISSA_BITS) - 1
# float32 mantissa field of 1.75 (= 448 / 2**8): amax mantissas above it overflow 448 at the floor
# exponent.
_F32_MANTISSA_OF_1_75 = 0x600000
_MAX_FINITE_BYTE = 254
# The largest byte whose inverse scale 2**(127 - b) is a normal float32 (b = 254 would need
# 2**-127). Finite float32 input never needs more than 248, so clamping to it changes nothing.
_MAX_INVERTIBLE_BYTE = 253


# --- quantization ---------------------------------------------------------------------------------


def _check_choice(argument: str, value, choices, where: str) -> None:
    if value not in choices:
        raise MXArgumentError(argument, f"{where}: `{argument}` must be one of {choices}, got {value!r}")


def _scale_bytes(amax: torch.Tensor, scale_rounding: str) -> torch.Tensor:
    """Biased E8M0 exponent (int32) of each block's scale, from its float32 amax, by bit math.

    floor: ``floor(log2(amax)) - 8``, the float32 exponent field minus 8 (a subnormal amax has
    field 0 and lands on the lower clamp anyway). rup: one more when amax's mantissa exceeds
    1.75, i.e. when ``amax / 2**floor_exponent > 448``, giving the smallest power of two with
    ``amax / scale <= 448``. An all-zero block gets byte 0 (2**-127, the smallest scale): its
    elements are exact zeros whatever the scale, and byte 0 keeps every product finite. A block
    with inf or NaN gets byte 255 (NaN) instead of a silently clamped finite value.
    """
    bits = amax.view(torch.int32)
    field = torch.bitwise_right_shift(bits, _F32_MANTISSA_BITS) & 0xFF
    biased = field - E4M3_MAX_POW2
    if scale_rounding == "rup":
        biased = biased + ((bits & _F32_MANTISSA_MASK) > _F32_MANTISSA_OF_1_75).to(torch.int32)
    biased = biased.clamp(0, _MAX_FINITE_BYTE)
    return torch.where(torch.isfinite(amax), biased, 255)


_said_scale_dtype = False


def default_scale_dtype() -> torch.dtype:
    """The dtype MX scales travel in by default: ``torch.float8_e8m0fnu`` where Inductor compiles
    e8m0 (:func:`fp8conf.torch_internals.inductor_lowers_e8m0`), else ``torch.uint8`` (the same
    bytes; said once per process at info, with the reason)."""
    global _said_scale_dtype
    native = torch_internals.inductor_lowers_e8m0()
    if native.found:
        return torch.float8_e8m0fnu
    if not _said_scale_dtype:
        _said_scale_dtype = True
        logger.info("fp8conf MX scales travel as uint8 bytes, not float8_e8m0fnu: Inductor of torch %s does not "
                    "compile e8m0 (%s)", torch.__version__, native.reason)
    return torch.uint8


def to_mx(
    x: torch.Tensor, block_size: int = MX_BLOCK_SIZE, scale_rounding: str = "floor", scale_dtype: torch.dtype = torch.uint8
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to MXFP8 along its last dim, in blocks of ``block_size``.

    Returns ``(elements, scales)``: ``elements`` has ``x``'s shape and dtype ``float8_e4m3fn``
    (``clamp(x / 2**e, -448, 448)`` rounded to nearest), ``scales`` has shape
    ``(*x.shape[:-1], x.shape[-1] // block_size)`` and holds the bytes ``e + 127`` (clamped to
    [0, 254]; 255 for blocks holding inf or NaN) as ``scale_dtype``: ``uint8``, or
    ``float8_e8m0fnu`` (a view of the same bytes). See :func:`_scale_bytes` for ``e``.
    """
    _check_choice("scale_rounding", scale_rounding, SCALE_ROUNDINGS, "to_mx")
    _check_choice("scale_dtype", scale_dtype, SCALE_DTYPES, "to_mx")
    if not isinstance(block_size, int) or block_size <= 0:
        raise MXArgumentError("block_size", f"to_mx: `block_size` must be a positive int, got {block_size!r}")
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or not x.is_floating_point():
        raise MXArgumentError("x", "to_mx: `x` must be a floating tensor with at least one dim")
    k = x.shape[-1]
    if k % block_size != 0:
        raise MXArgumentError(
            "x", f"to_mx: `x`'s last dim ({k}) is not a multiple of block_size={block_size}; pad it with zeros"
        )
    blocks = x.to(torch.float32).reshape(*x.shape[:-1], k // block_size, block_size)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    biased = _scale_bytes(amax, scale_rounding)
    # Multiply by the exact inverse 2**(127 - b) rather than dividing by 2**(b - 127): for b = 0
    # the divisor would be subnormal, which flush-to-zero hardware reads as 0.
    inverse = torch.bitwise_left_shift(2 * 127 - biased.clamp(max=_MAX_INVERTIBLE_BYTE), _F32_MANTISSA_BITS)
    scaled = blocks * inverse.view(torch.float32)
    elements = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return elements.reshape(x.shape), biased.squeeze(-1).to(torch.uint8).view(scale_dtype)


def from_mx(
    elements: torch.Tensor,
    scales: torch.Tensor,
    block_size: int = MX_BLOCK_SIZE,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantize :func:`to_mx`'s output: ``elements * 2**(scales - 127)`` blockwise, in ``dtype``.

    ``scales`` are ``uint8`` or ``float8_e8m0fnu`` bytes. The arithmetic is float32 (exact: a
    power-of-two times an e4m3 value), NaN for byte 255.
    """
    k = elements.shape[-1]
    if k % block_size != 0 or tuple(scales.shape) != (*elements.shape[:-1], k // block_size):
        raise MXArgumentError(
            "scales",
            f"from_mx: `scales` has shape {tuple(scales.shape)}, expected "
            f"{(*elements.shape[:-1], k // block_size)} for elements of shape {tuple(elements.shape)}",
        )
    blocks = elements.to(torch.float32).reshape(*elements.shape[:-1], k // block_size, block_size)
    return apply_e8m0_scale(blocks, scales.unsqueeze(-1)).reshape(elements.shape).to(dtype)


# --- the three matmuls ------------------------------------------------------------------------------


def _pad_last_dim(t: torch.Tensor) -> torch.Tensor:
    # Zero padding along the contraction dim adds zero products, so the matmul stays exact.
    pad = -t.shape[-1] % MX_BLOCK_SIZE
    return torch.nn.functional.pad(t, (0, pad)) if pad else t


def swizzled_scaled_mm(lhs_q, lhs_s, rhs_q, rhs_s, out_dtype) -> torch.Tensor:
    """``lhs @ rhs.T`` for MXFP8 ``lhs_q`` (R, C) and ``rhs_q`` (S, C) with row-major e8m0 scale
    bytes ``(R, C / 32)`` and ``(S, C / 32)``, through ``F.scaled_mm`` with the scales swizzled
    (``BlockWise1x32``, ``SWIZZLE_32_4_4``)."""
    functional = torch.nn.functional
    recipe, swizzle = functional.ScalingType.BlockWise1x32, functional.SwizzleType.SWIZZLE_32_4_4
    lhs_blocked = to_cublas_blocked(lhs_s.view(torch.uint8)).view(torch.float8_e8m0fnu)
    rhs_blocked = to_cublas_blocked(rhs_s.view(torch.uint8)).view(torch.float8_e8m0fnu)
    return functional.scaled_mm(lhs_q, rhs_q.t(), lhs_blocked, recipe, rhs_blocked, recipe,
                                swizzle_a=swizzle, swizzle_b=swizzle, output_dtype=out_dtype)


def _mx_matmul(lhs, rhs_t, out_dtype, recipe: str, scale_rounding: str, scale_dtype: torch.dtype) -> torch.Tensor:
    """``lhs @ rhs_t.T`` for ``lhs`` (R, C), ``rhs_t`` (S, C), both quantized to MXFP8 along C."""
    lhs_q, lhs_s = to_mx(_pad_last_dim(lhs), MX_BLOCK_SIZE, scale_rounding, scale_dtype)
    rhs_q, rhs_s = to_mx(_pad_last_dim(rhs_t), MX_BLOCK_SIZE, scale_rounding, scale_dtype)
    if recipe == "mxfp8_emulated":
        return torch.mm(from_mx(lhs_q, lhs_s), from_mx(rhs_q, rhs_s).t()).to(out_dtype)
    if recipe == "mxfp8_swizzled":
        return swizzled_scaled_mm(lhs_q, lhs_s, rhs_q, rhs_s, out_dtype)
    return scaled_mm_e8m0(lhs_q, rhs_q.t(), lhs_s, rhs_s, out_dtype=out_dtype)


# allow_in_graph: Dynamo records the Function as one call and AOTAutograd traces its forward and
# backward through autograd itself. Dynamo's own tracing of autograd.Function (torch 2.11, seen on
# CPU Inductor) fed the backward zeros instead of grad_out for the emulated recipe, whose forward
# holds only aten ops; torchao's MX linear takes the same route.
@torch._dynamo.allow_in_graph
class _MXLinearFunction(torch.autograd.Function):
    """``x @ weight.T`` with all three matmuls of forward+backward in MXFP8.

    Each matmul quantizes both operands along its own contraction dim: K for the output, N for
    grad_input, M (the flattened batch, zero-padded to a multiple of 32) for grad_weight. The
    high-precision ``x`` and ``weight`` are saved, since the backward needs them quantized along
    other dims than the forward did.
    """

    @staticmethod
    def forward(ctx, x, weight, recipe: str, scale_rounding: str, scale_dtype: torch.dtype):
        ctx.save_for_backward(x, weight)
        ctx.recipe = recipe
        ctx.scale_rounding = scale_rounding
        ctx.scale_dtype = scale_dtype
        return _mx_matmul(x, weight, x.dtype, recipe, scale_rounding, scale_dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = _mx_matmul(grad_out, weight.t(), x.dtype, ctx.recipe, ctx.scale_rounding, ctx.scale_dtype)
        if ctx.needs_input_grad[1]:
            grad_w = _mx_matmul(grad_out.t(), x.t(), weight.dtype, ctx.recipe, ctx.scale_rounding, ctx.scale_dtype)
        return grad_x, grad_w, None, None, None


# --- the module -----------------------------------------------------------------------------------


def _features_problem(in_features: int, out_features: int) -> str | None:
    bad = [f"{name}={value}" for name, value in (("in_features", in_features), ("out_features", out_features))
           if value % MX_BLOCK_SIZE != 0]
    return f"{', '.join(bad)} not a multiple of {MX_BLOCK_SIZE}" if bad else None


class MXLinear(nn.Linear):
    """``nn.Linear`` whose forward and backward matmuls run in MXFP8 (block size 32, e4m3).

    Attributes:
        quant_kind: ``"mxfp8_linear"`` (how fp8conf's provenance names this module's kind).
        recipe: ``"mxfp8"`` (matmuls through ``fp8conf::scaled_mm_e8m0``), ``"mxfp8_emulated"``
            (same quantization, float32 ``torch.mm`` on the dequantized operands) or
            ``"mxfp8_swizzled"`` (``F.scaled_mm`` with swizzled ``float8_e8m0fnu`` scales).
        emulate: ``recipe == "mxfp8_emulated"``.
        block_size: 32.
        scale_rounding: ``"floor"`` or ``"rup"`` (see :func:`to_mx`).
        scale_dtype: the dtype its scales travel in, ``float8_e8m0fnu`` or ``uint8`` (the same
            bytes either way); by default :func:`default_scale_dtype`.

    Inputs may have leading batch dims; the output has the input's dtype.
    """

    quant_kind = "mxfp8_linear"
    block_size = MX_BLOCK_SIZE

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        recipe: str = "mxfp8",
        scale_rounding: str = "floor",
        scale_dtype: torch.dtype | None = None,
    ):
        _check_choice("recipe", recipe, RECIPES, "MXLinear")
        _check_choice("scale_rounding", scale_rounding, SCALE_ROUNDINGS, "MXLinear")
        if scale_dtype is not None:
            _check_choice("scale_dtype", scale_dtype, SCALE_DTYPES, "MXLinear")
        problem = _features_problem(in_features, out_features)
        if problem:
            raise MXArgumentError("in_features" if in_features % MX_BLOCK_SIZE else "out_features",
                                  f"MXLinear: {problem}; MXFP8 quantizes both dims in blocks of 32")
        if recipe == "mxfp8_swizzled" and not has_scaled_mm_v2():
            raise MXArgumentError("recipe", f"MXLinear: recipe 'mxfp8_swizzled' needs torch.nn.functional.scaled_mm "
                                            f"(torch 2.12 and newer); this is torch {torch.__version__}")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = recipe
        self.emulate = recipe == "mxfp8_emulated"
        self.scale_rounding = scale_rounding
        self.scale_dtype = default_scale_dtype() if scale_dtype is None else scale_dtype

    @classmethod
    def from_float(cls, linear: nn.Linear, *, recipe: str = "mxfp8", scale_rounding: str = "floor",
                   scale_dtype: torch.dtype | None = None) -> MXLinear:
        """An ``MXLinear`` that takes over ``linear``'s weight and bias Parameters (no copy)."""
        require(linear, nn.Linear, "MXLinear.from_float", "linear", "a torch.nn.Linear")
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                      recipe=recipe, scale_rounding=scale_rounding, scale_dtype=scale_dtype)
        # Same Parameter objects: optimizers, tied weights and FSDP keep pointing at them.
        new.weight = linear.weight
        new.bias = linear.bias
        return new

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.shape[-1] != self.in_features or input.dtype not in _HP_DTYPES:
            raise MXArgumentError(
                "input", f"MXLinear: `input` must end in in_features={self.in_features} and have a dtype in "
                f"{_HP_DTYPES}; got shape {tuple(input.shape)}, dtype {input.dtype}",
            )
        x2d = input.reshape(-1, self.in_features)
        out = _MXLinearFunction.apply(x2d, self.weight, self.recipe, self.scale_rounding, self.scale_dtype)
        out = out.reshape(*input.shape[:-1], self.out_features)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    def fp8_quantization(self) -> QuantizationConfig:
        """The quantized-module protocol: kind, recipe, emulate, and the MX settings that change
        the numerics (block size, scale rounding) for the signature."""
        return QuantizationConfig(
            kind=self.quant_kind, recipe=self.recipe, emulate=self.emulate,
            settings={"block_size": self.block_size, "scale_rounding": self.scale_rounding},
        )

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, recipe={self.recipe}, scale_rounding={self.scale_rounding}, "
                f"scale_dtype={self.scale_dtype}")


# --- conversion -------------------------------------------------------------------------------------


def _linears_to_convert(model: nn.Module, module_filter_fn) -> list[tuple[str, nn.Linear]]:
    found = []
    # remove_duplicate=False: a linear registered under two names must be swapped under both.
    for fqn, module in model.named_modules(remove_duplicate=False):
        if not isinstance(module, nn.Linear) or isinstance(module, MXLinear):
            continue
        if module_filter_fn is not None and not module_filter_fn(module, fqn):
            continue
        problem = _features_problem(module.in_features, module.out_features)
        if problem:
            name = fqn or "<root>"
            raise MXConversionError(
                f"convert_to_mx_training: linear {name!r} has {problem}; MXFP8 needs both multiples of "
                f"{MX_BLOCK_SIZE}. Exclude it with module_filter_fn (e.g. `lambda m, fqn: fqn != {fqn!r}`) "
                "or resize the layer",
                module_fqn=fqn,
            )
        found.append((fqn, module))
    return found


def convert_to_mx_training(
    model: nn.Module,
    *,
    recipe: str = "mxfp8",
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
    scale_rounding: str = "floor",
    scale_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Swap the ``nn.Linear`` modules of ``model`` for :class:`MXLinear`, in place.

    Args:
        model: the model; if it is itself an ``nn.Linear`` the new module is returned.
        recipe: ``"mxfp8"``, ``"mxfp8_emulated"`` or ``"mxfp8_swizzled"`` (see :class:`MXLinear`).
        module_filter_fn: ``(module, fqn) -> bool``; only linears it accepts are converted (the
            same signature as torchao's ``convert_to_float8_training``).
        scale_rounding: ``"floor"`` or ``"rup"``.
        scale_dtype: ``torch.float8_e8m0fnu`` or ``torch.uint8``, the dtype the scales travel in;
            by default :func:`default_scale_dtype` (native e8m0 where Inductor compiles it).

    Every candidate is checked before any is swapped, so a failure leaves ``model`` unchanged.

    Raises:
        MXConversionError: (a ``ValueError``) naming the FQN of a linear whose in/out features
            are not multiples of 32.
        MXArgumentError: for an unknown ``recipe``, ``scale_rounding`` or ``scale_dtype``.
    """
    require(model, "model", "convert_to_mx_training", "model")
    _check_choice("recipe", recipe, RECIPES, "convert_to_mx_training")
    _check_choice("scale_rounding", scale_rounding, SCALE_ROUNDINGS, "convert_to_mx_training")
    if scale_dtype is not None:
        _check_choice("scale_dtype", scale_dtype, SCALE_DTYPES, "convert_to_mx_training")
    return swap_linears(
        model, _linears_to_convert(model, module_filter_fn),
        lambda linear: MXLinear.from_float(linear, recipe=recipe, scale_rounding=scale_rounding, scale_dtype=scale_dtype),
    )
