"""What a float8 recipe defines, in plain torch: the suite's own reading of each recipe, against
which EMU-005 holds a backend's quantized linears.

A quantized linear computes three matmuls, each on operands quantized by its recipe: the output
``y = x @ W.T``, the input gradient ``dX = dY @ W`` and the weight gradient ``dW = dY.T @ x``.
For each operand of each matmul a recipe fixes the FP8 dtype and how its scale is taken:
``amax`` over the whole tensor (tensorwise) or over the matmul's contraction dim (rowwise), the
scale ``finfo(dtype).max / amax`` (rounded down to a power of two where the recipe says so), the
value ``clamp(t * scale)`` cast to the dtype. :func:`linear_step` dequantizes every operand and
multiplies in float64, so the only difference from a backend that follows the recipe is its
accumulation order and, where a backend's convention differs from the one read here (a scale
rounded or not), rounding of the same size as the recipe's own.

Recipes by module kind:

* ``float8_linear`` (TorchAO's ``Float8Linear``, and a backend's own float8 linears declaring
  TorchAO's recipe names): ``tensorwise`` (e4m3 input and weight, e5m2 output gradient, one
  scale per tensor), ``rowwise`` (e4m3 everywhere, scales along each matmul's contraction dim,
  powers of two), ``rowwise_with_gw_hp`` (as ``rowwise`` for the output; the input gradient
  takes the weight with one power-of-two scale; the weight gradient in high precision);
* ``float8_scaled_mm_linear`` (linears on ``F.scaled_mm``): ``tensorwise`` and ``rowwise``, e4m3
  everywhere, power-of-two scales.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["HIGH_PRECISION", "Operand", "Recipe", "definition", "linear_step"]


@dataclasses.dataclass(frozen=True)
class Operand:
    """How one operand of one matmul is quantized: its FP8 dtype, its scale per tensor or along
    the matmul's contraction dim, the scale rounded down to a power of two or not; ``None``
    stands for an operand kept in high precision."""

    dtype: torch.dtype
    rowwise: bool
    power_of_two: bool


@dataclasses.dataclass(frozen=True)
class Recipe:
    """The operands of the three matmuls: ``(left, right)`` each, ``None`` for a matmul the
    recipe computes in high precision."""

    output: tuple[Operand, Operand] | None
    grad_input: tuple[Operand, Operand] | None
    grad_weight: tuple[Operand, Operand] | None


#: No matmul quantized: the step the recipe approximates.
HIGH_PRECISION = Recipe(None, None, None)


_E4M3, _E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _all(dtype, rowwise, power_of_two, grad_dtype=None) -> Recipe:
    op = Operand(dtype, rowwise, power_of_two)
    grad = Operand(grad_dtype or dtype, rowwise, power_of_two)
    return Recipe(output=(op, op), grad_input=(grad, op), grad_weight=(grad, op))


_RECIPES = {
    ("float8_linear", "tensorwise"): _all(_E4M3, rowwise=False, power_of_two=False, grad_dtype=_E5M2),
    ("float8_linear", "rowwise"): _all(_E4M3, rowwise=True, power_of_two=True),
    ("float8_linear", "rowwise_with_gw_hp"): Recipe(
        output=(Operand(_E4M3, True, True), Operand(_E4M3, True, True)),
        grad_input=(Operand(_E4M3, True, True), Operand(_E4M3, False, True)),
        grad_weight=None,
    ),
    ("float8_scaled_mm_linear", "tensorwise"): _all(_E4M3, rowwise=False, power_of_two=True),
    ("float8_scaled_mm_linear", "rowwise"): _all(_E4M3, rowwise=True, power_of_two=True),
}


def definition(kind: str, recipe: str) -> Recipe | None:
    """The suite's reading of ``recipe`` for a module of ``kind``; None where it has none."""
    return _RECIPES.get((kind, recipe))


def _dequantized(t: torch.Tensor, operand: Operand, contraction_dim: int) -> torch.Tensor:
    """``t`` quantized as ``operand`` says (rowwise: one scale per slice along
    ``contraction_dim``) and read back, in float64."""
    t32 = t.detach().float()
    amax = t32.abs().amax() if not operand.rowwise else t32.abs().amax(dim=contraction_dim, keepdim=True)
    top = torch.finfo(operand.dtype).max
    scale = (top / amax.double().clamp(min=1e-12)).float()
    if operand.power_of_two:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    data = (t32 * scale).clamp(-top, top).to(operand.dtype)
    return data.double() / scale.double()


def _matmul(left: torch.Tensor, right: torch.Tensor, operands) -> torch.Tensor:
    """``left @ right`` (contraction over ``left``'s last and ``right``'s first dim) on operands
    quantized as ``operands`` says, or in high precision for ``None``."""
    if operands is None:
        return left.double() @ right.double()
    return _dequantized(left, operands[0], -1) @ _dequantized(right, operands[1], 0)


def linear_step(recipe: Recipe, x: torch.Tensor, weight: torch.Tensor, grad_output: torch.Tensor) -> dict[str, torch.Tensor]:
    """The output (without bias), input gradient and weight gradient that ``recipe`` defines for
    a linear of ``weight`` (out, in) on ``x`` (..., in) and ``grad_output`` (..., out), in float64."""
    x2 = x.reshape(-1, x.shape[-1])
    g2 = grad_output.reshape(-1, grad_output.shape[-1])
    return {
        "output": _matmul(x2, weight.t(), recipe.output).reshape(*x.shape[:-1], weight.shape[0]),
        "grad_input": _matmul(g2, weight, recipe.grad_input).reshape(x.shape),
        "grad_weight": _matmul(g2.t(), x2, recipe.grad_weight),
    }
