"""Mutant backends whose quantized linears compute something other than their recipe defines,
the same in eager and compiled steps: every property comparing the backend with itself (compiled
with eager, split with joint) passes them; EMU-005 holds each linear to the recipe's definition."""

from __future__ import annotations

import torch

from conformance.backends.reference import ReferenceBackend
from fp8conf.quantized.scaled_mm import ScaledMMLinear, _ScaledMMLinearFunction

__all__ = ["MUTANTS", "V2WeightGradientScaled"]

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


MUTANTS = [V2WeightGradientScaled]
