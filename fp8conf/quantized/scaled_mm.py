"""FP8 training for ``nn.Linear`` through torch's second scaled-matmul API, ``F.scaled_mm``.

torch 2.12 added ``torch.nn.functional.scaled_mm`` (lowering to ``aten._scaled_mm_v2``), which
names each operand's scaling (``ScalingType.TensorWise``, ``RowWise``, ``BlockWise1x32``...) where
``torch._scaled_mm`` guessed it from the scales' shapes. Trainers written against today's API
(torchtitan's MXFP8 linear, for one) call it directly instead of going through TorchAO's
``Float8Linear``. :class:`ScaledMMLinear` is such a linear: kind ``float8_scaled_mm_linear``,
recipes

* ``tensorwise``: one power-of-two scale per operand;
* ``rowwise``: one power-of-two scale per row of each operand along the matmul's contraction dim.

All three matmuls (output, grad_input, grad_weight) run in FP8, each operand quantized to
``float8_e4m3fn`` along that matmul's contraction dim (the weight-gradient's, the tokens, is
zero-padded to a multiple of 16, which adds zero products). Scales are powers of two, rounded by
clearing mantissa bits, so eager and every compiled kernel quantize to the same bytes. CPU runs
both recipes (torch's CPU kernels of ``_scaled_mm_v2`` take tensorwise and rowwise scales).
:func:`convert_to_scaled_mm_training` swaps a model's ``nn.Linear`` modules for it; on a torch
without ``F.scaled_mm`` it raises :class:`~fp8conf.errors.ScaledMMConversionError` naming the
torch release.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from fp8conf.arguments import require
from fp8conf.errors import ScaledMMConversionError
from fp8conf.quantized.grouped import to_float8_rowwise
from fp8conf.quantized.protocol import QuantizationConfig
from fp8conf.quantized.swap import plain_linears, swap_linears

__all__ = [
    "SCALED_MM_KIND",
    "SCALED_MM_RECIPES",
    "has_scaled_mm_v2",
    "ScaledMMLinear",
    "convert_to_scaled_mm_training",
]

#: The quantized module kind of :class:`ScaledMMLinear`.
SCALED_MM_KIND = "float8_scaled_mm_linear"
#: Its recipes.
SCALED_MM_RECIPES = ("tensorwise", "rowwise")
#: FP8 matmuls need every dim of both operands a multiple of 16 (16-byte alignment of e4m3 rows).
ALIGNMENT = 16
_HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def has_scaled_mm_v2() -> bool:
    """Whether this torch has ``torch.nn.functional.scaled_mm`` (torch 2.12 and newer)."""
    functional = torch.nn.functional
    return hasattr(functional, "scaled_mm") and hasattr(functional, "ScalingType")


def _pad_last_dim(t: torch.Tensor) -> torch.Tensor:
    pad = -t.shape[-1] % ALIGNMENT
    return torch.nn.functional.pad(t, (0, pad)) if pad else t


def _quantize(t: torch.Tensor, recipe: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` (R, C) as e4m3 and its power-of-two scale: one per tensor (shape ``()``) or one per
    row (``(R, 1)``); ``data / scale`` approximates ``t``."""
    if recipe == "tensorwise":
        data, scale = to_float8_rowwise(t.reshape(1, -1), dim=-1)
        return data.reshape(t.shape), scale.reshape(())
    return to_float8_rowwise(t, dim=-1)


def _matmul(lhs: torch.Tensor, rhs_t: torch.Tensor, recipe: str, out_dtype: torch.dtype) -> torch.Tensor:
    """``lhs @ rhs_t.T`` for ``lhs`` (R, C) and ``rhs_t`` (S, C), both quantized along C, through
    ``F.scaled_mm``."""
    functional = torch.nn.functional
    # Row-major operands (the backward's are transposed views): elementwise quantization keeps a
    # view's strides, and the scaled matmul takes a row-major left and a column-major right one.
    lhs_q, lhs_s = _quantize(_pad_last_dim(lhs).contiguous(), recipe)
    rhs_q, rhs_s = _quantize(_pad_last_dim(rhs_t).contiguous(), recipe)
    kind = functional.ScalingType.TensorWise if recipe == "tensorwise" else functional.ScalingType.RowWise
    # The right operand column-major (rhs_q is row-major (S, C)); the scales are the inverses,
    # (R, 1) and (1, S) for rowwise.
    return functional.scaled_mm(
        lhs_q, rhs_q.t(), lhs_s.reciprocal(), kind, rhs_s.reciprocal().t(), kind, output_dtype=out_dtype
    )


# allow_in_graph: Dynamo records the Function as one call, and AOTAutograd traces its forward and
# backward through autograd itself (as for MXLinear).
@torch._dynamo.allow_in_graph
class _ScaledMMLinearFunction(torch.autograd.Function):
    """``x @ weight.T`` with all three matmuls of forward+backward in FP8 through ``F.scaled_mm``.

    The high-precision ``x`` and ``weight`` are saved: the backward quantizes them along other
    dims than the forward did.
    """

    @staticmethod
    def forward(ctx, x, weight, recipe: str):
        ctx.save_for_backward(x, weight)
        ctx.recipe = recipe
        return _matmul(x, weight, recipe, x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = _matmul(grad_out, weight.t(), ctx.recipe, x.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = _matmul(grad_out.t(), x.t(), ctx.recipe, weight.dtype)
        return grad_x, grad_w, None


def _features_problem(in_features: int, out_features: int) -> str | None:
    bad = [f"{name}={value}" for name, value in (("in_features", in_features), ("out_features", out_features))
           if value % ALIGNMENT != 0]
    return f"{', '.join(bad)} not a multiple of {ALIGNMENT}" if bad else None


class ScaledMMLinear(nn.Linear):
    """``nn.Linear`` whose forward and backward matmuls run in FP8 through ``F.scaled_mm``.

    Attributes:
        quant_kind: ``"float8_scaled_mm_linear"`` (the kind fp8conf's provenance names).
        recipe: ``"tensorwise"`` or ``"rowwise"``.
        emulate: False (every matmul is an FP8 one).

    Inputs may have leading batch dims; the output has the input's dtype.
    """

    quant_kind = SCALED_MM_KIND
    emulate = False

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 recipe: str = "tensorwise"):
        if recipe not in SCALED_MM_RECIPES:
            raise ScaledMMConversionError(f"ScaledMMLinear: recipe must be one of {SCALED_MM_RECIPES}, got {recipe!r}", module_fqn=None)
        problem = _features_problem(in_features, out_features)
        if problem:
            raise ScaledMMConversionError(f"ScaledMMLinear: {problem}", module_fqn=None)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = recipe

    @classmethod
    def from_float(cls, linear: nn.Linear, *, recipe: str = "tensorwise") -> ScaledMMLinear:
        """A ``ScaledMMLinear`` that takes over ``linear``'s weight and bias Parameters (no copy)."""
        require(linear, nn.Linear, "ScaledMMLinear.from_float", "linear", "a torch.nn.Linear")
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, recipe=recipe)
        new.weight = linear.weight
        new.bias = linear.bias
        return new

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.shape[-1] != self.in_features or input.dtype not in _HP_DTYPES:
            raise ScaledMMConversionError(
                f"ScaledMMLinear: `input` must end in in_features={self.in_features} and have a dtype in {_HP_DTYPES}; "
                f"got shape {tuple(input.shape)}, dtype {input.dtype}",
                module_fqn=None,
            )
        out = _ScaledMMLinearFunction.apply(input.reshape(-1, self.in_features), self.weight, self.recipe)
        out = out.reshape(*input.shape[:-1], self.out_features)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    def fp8_quantization(self) -> QuantizationConfig:
        """The quantized-module protocol: kind ``float8_scaled_mm_linear``, its recipe."""
        return QuantizationConfig(kind=self.quant_kind, recipe=self.recipe, emulate=self.emulate)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}"


def convert_to_scaled_mm_training(
    model: nn.Module,
    *,
    recipe: str = "tensorwise",
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> nn.Module:
    """Swap the plain ``nn.Linear`` modules of ``model`` for :class:`ScaledMMLinear`, in place.

    ``module_filter_fn(module, fqn)`` picks among them (torchao's signature); subclasses of
    ``nn.Linear`` (TorchAO's ``Float8Linear``, :class:`~fp8conf.MXLinear`) are left alone. Every
    candidate is checked before any is swapped, so a failure leaves ``model`` unchanged. Returns
    ``model`` (or the new module when ``model`` itself is converted).

    Raises:
        ScaledMMConversionError: (a ``ValueError``) on a torch without ``F.scaled_mm``, for an
            unknown ``recipe``, or naming a linear whose features are not multiples of 16.
    """
    require(model, "model", "convert_to_scaled_mm_training", "model")
    if not has_scaled_mm_v2():
        raise ScaledMMConversionError(
            f"convert_to_scaled_mm_training: torch {torch.__version__} has no torch.nn.functional.scaled_mm "
            "(torch 2.12 and newer have it); convert with TorchAO's convert_to_float8_training instead",
            module_fqn=None,
        )
    if recipe not in SCALED_MM_RECIPES:
        raise ScaledMMConversionError(
            f"convert_to_scaled_mm_training: recipe must be one of {SCALED_MM_RECIPES}, got {recipe!r}", module_fqn=None
        )
    def refuse(fqn, problem):
        return ScaledMMConversionError(
            f"convert_to_scaled_mm_training: linear {fqn or '<root>'!r} has {problem}; FP8 matmuls need both "
            f"multiples of {ALIGNMENT}. Exclude it with module_filter_fn (e.g. `lambda m, fqn: fqn != {fqn!r}`) "
            "or resize the layer",
            module_fqn=fqn,
        )

    found = plain_linears(model, module_filter_fn, _features_problem, refuse)
    return swap_linears(model, found, lambda linear: ScaledMMLinear.from_float(linear, recipe=recipe))
