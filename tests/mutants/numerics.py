"""Mutant backends whose quantized modules compute something other than their recipe defines,
the same in eager and compiled steps: every property comparing the backend with itself (compiled
with eager, split with joint) passes them, and so do those bounding the distance from the
high-precision step at 1 (EMU-004, NVF-002, MXS-002); EMU-005 holds each linear, EMU-006 each
experts module, to the recipe's definition. Each class scales the weight gradient of one family
in its autograd function, which tracing records."""

from __future__ import annotations

import torch

from conformance.backends.reference import ReferenceBackend
from fp8conf.quantized.grouped import Float8GroupedExperts, _Float8GroupedMM
from fp8conf.quantized.mx import MXLinear, _MXLinearFunction
from fp8conf.quantized.nvfp4 import NVFP4Linear, _NVFP4LinearFunction
from fp8conf.quantized.scaled_mm import ScaledMMLinear, _ScaledMMLinearFunction

__all__ = ["MUTANTS", "V2WeightGradientScaled", "MXWeightGradientScaled", "NVFP4WeightGradientScaled",
           "GroupedWeightGradientScaled"]

#: The constant factor of the defect: well inside EMU-004's bound of 1 (relative norm 0.5).
_FACTOR = 1.5


@torch._dynamo.allow_in_graph
class _WeightGradientScaled(_ScaledMMLinearFunction):
    """fp8conf's FP8 matmuls on ``F.scaled_mm``, the weight gradient multiplied by a constant."""

    @staticmethod
    def backward(ctx, grad_out):
        grad_x, grad_w, recipe = _ScaledMMLinearFunction.backward(ctx, grad_out)
        return grad_x, None if grad_w is None else grad_w * _FACTOR, recipe


class _ScaledWeightGradientLinear(ScaledMMLinear):
    def forward(self, input):
        out = _WeightGradientScaled.apply(input.reshape(-1, self.in_features), self.weight, self.recipe)
        out = out.reshape(*input.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias.to(out.dtype)


class V2WeightGradientScaled(ReferenceBackend):
    """Its linears on ``F.scaled_mm`` compute the weight gradient x1.5, eager and traced alike
    (the defect is in their autograd function, which tracing records)."""

    name = "mutant-v2-weight-gradient-scaled"
    KILLED_BY = "EMU-005"

    def convert_scaled_mm(self, model, *, module_filter_fn, recipe):
        super().convert_scaled_mm(model, module_filter_fn=module_filter_fn, recipe=recipe)
        for module in model.modules():
            if type(module) is ScaledMMLinear:
                module.__class__ = _ScaledWeightGradientLinear


def _weight_gradient_scaled(function):
    """``function`` (an autograd Function whose second input is the weight) with the weight
    gradient multiplied by :data:`_FACTOR`."""

    @torch._dynamo.allow_in_graph
    class WeightGradientScaled(function):
        @staticmethod
        def backward(ctx, grad_out):
            grads = list(function.backward(ctx, grad_out))
            grads[1] = None if grads[1] is None else grads[1] * _FACTOR
            return tuple(grads)

    return WeightGradientScaled


_MX_SCALED = _weight_gradient_scaled(_MXLinearFunction)
_NVFP4_SCALED = _weight_gradient_scaled(_NVFP4LinearFunction)
_GROUPED_SCALED = _weight_gradient_scaled(_Float8GroupedMM)


def _with_bias(module, out, input):
    out = out.reshape(*input.shape[:-1], module.out_features)
    return out if module.bias is None else out + module.bias.to(out.dtype)


class _ScaledWeightGradientMX(MXLinear):
    def forward(self, input):
        x = input.reshape(-1, self.in_features)
        return _with_bias(self, _MX_SCALED.apply(x, self.weight, self.recipe, self.scale_rounding, self.scale_dtype), input)


class _ScaledWeightGradientNVFP4(NVFP4Linear):
    def forward(self, input):
        return _with_bias(self, _NVFP4_SCALED.apply(input.reshape(-1, self.in_features), self.weight, self.emulate), input)


class _ScaledWeightGradientExperts(Float8GroupedExperts):
    def forward(self, x, offs):
        return _GROUPED_SCALED.apply(x, self.weight, offs, self.emulate, self.v2)


def _swap(model, cls, subclass) -> None:
    for module in model.modules():
        if type(module) is cls:
            module.__class__ = subclass


class MXWeightGradientScaled(ReferenceBackend):
    """Its MX linears of every recipe (row-major and swizzled scales) compute the weight gradient
    x1.5, eager and traced alike."""

    name = "mutant-mx-weight-gradient-scaled"
    KILLED_BY = "EMU-005"

    def convert_mx(self, model, *, module_filter_fn, recipe):
        super().convert_mx(model, module_filter_fn=module_filter_fn, recipe=recipe)
        _swap(model, MXLinear, _ScaledWeightGradientMX)


class NVFP4WeightGradientScaled(ReferenceBackend):
    """Its NVFP4 linears compute the weight gradient x1.5, eager and traced alike (NVF-002 bounds
    the step at 1 from the high-precision step and passes it)."""

    name = "mutant-nvfp4-weight-gradient-scaled"
    KILLED_BY = "EMU-005"

    def convert_nvfp4(self, model, *, module_filter_fn, recipe):
        super().convert_nvfp4(model, module_filter_fn=module_filter_fn, recipe=recipe)
        _swap(model, NVFP4Linear, _ScaledWeightGradientNVFP4)


class GroupedWeightGradientScaled(ReferenceBackend):
    """Its grouped experts of either grouped API compute every expert's weight gradient x1.5,
    eager and traced alike (MOE-006 compares groups with groups, MOE-008 compiled with eager)."""

    name = "mutant-grouped-weight-gradient-scaled"
    KILLED_BY = "EMU-006"

    def convert_grouped_experts(self, model, *, module_filter_fn, recipe, emulate):
        super().convert_grouped_experts(model, module_filter_fn=module_filter_fn, recipe=recipe, emulate=emulate)
        _swap(model, Float8GroupedExperts, _ScaledWeightGradientExperts)

    def convert_scaled_grouped_experts(self, model, *, module_filter_fn, recipe):
        super().convert_scaled_grouped_experts(model, module_filter_fn=module_filter_fn, recipe=recipe)
        _swap(model, Float8GroupedExperts, _ScaledWeightGradientExperts)


MUTANTS = [V2WeightGradientScaled, MXWeightGradientScaled, NVFP4WeightGradientScaled, GroupedWeightGradientScaled]
