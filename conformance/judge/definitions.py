"""What a low-precision recipe defines, in plain torch: the suite's own reading of each recipe,
against which EMU-005 holds a backend's quantized linears and EMU-006 its grouped experts.

A quantized linear computes three matmuls, each on operands quantized by its recipe: the output
``y = x @ W.T``, the input gradient ``dX = dY @ W`` and the weight gradient ``dW = dY.T @ x``.
For each operand of each matmul a recipe fixes the FP8 dtype and how its scale is taken:
``amax`` over the whole tensor (tensorwise) or over the matmul's contraction dim (rowwise), the
scale ``finfo(dtype).max / amax`` (rounded down to a power of two where the recipe says so), the
value ``clamp(t * scale)`` cast to the dtype. Block-scaled recipes (:class:`BlockOperand`) take one
scale per block of consecutive elements along the contraction dim, zero-padded to whole blocks:
MXFP8 (OCP Microscaling v1.0: e4m3 elements, an e8m0 scale ``2**(floor(log2(amax)) - 8)`` per 32)
and NVFP4 (e2m1 elements rounded to nearest, an e4m3 scale ``block_amax / 6 / global`` per 16 under
one float32 global scale ``amax / (448 * 6)``); the layout their scales travel in (row-major or
swizzled) is no part of what they compute. :func:`linear_step` dequantizes every operand and
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
  everywhere, power-of-two scales;
* ``mxfp8_linear``: ``mxfp8`` and ``mxfp8_swizzled``, MXFP8 operands in all three matmuls;
* ``nvfp4_linear``: ``nvfp4``, NVFP4 operands in all three matmuls;
* ``float8_grouped_experts``: ``rowwise``, on either grouped API. Per token group ``g`` routed to
  expert ``e``, the three GEMMs are a ``rowwise`` linear's on the group's tokens and ``weight[e]``:
  tokens per row, the expert's weight per row (output) and per column (input gradient), and the
  weight gradient's operands per feature over the group's tokens only (:func:`experts_step`).
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["HIGH_PRECISION", "BlockOperand", "Operand", "Recipe", "definition", "experts_step", "linear_step"]


@dataclasses.dataclass(frozen=True)
class Operand:
    """How one operand of one matmul is quantized: its FP8 dtype, its scale per tensor or along
    the matmul's contraction dim, the scale rounded down to a power of two or not; ``None``
    stands for an operand kept in high precision."""

    dtype: torch.dtype
    rowwise: bool
    power_of_two: bool


@dataclasses.dataclass(frozen=True)
class BlockOperand:
    """An operand with one scale per ``block`` consecutive elements along the matmul's
    contraction dim: ``format`` ``"mxfp8"`` (e4m3 under e8m0 scales, the OCP floor rule) or
    ``"nvfp4"`` (e2m1 under e4m3 scales and a float32 global scale)."""

    format: str
    block: int


@dataclasses.dataclass(frozen=True)
class Recipe:
    """The operands of the three matmuls: ``(left, right)`` each, ``None`` for a matmul the
    recipe computes in high precision."""

    output: tuple[Operand | BlockOperand, Operand | BlockOperand] | None
    grad_input: tuple[Operand | BlockOperand, Operand | BlockOperand] | None
    grad_weight: tuple[Operand | BlockOperand, Operand | BlockOperand] | None


#: No matmul quantized: the step the recipe approximates.
HIGH_PRECISION = Recipe(None, None, None)


_E4M3, _E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _all(dtype, rowwise, power_of_two, grad_dtype=None) -> Recipe:
    op = Operand(dtype, rowwise, power_of_two)
    grad = Operand(grad_dtype or dtype, rowwise, power_of_two)
    return Recipe(output=(op, op), grad_input=(grad, op), grad_weight=(grad, op))


def _blocks(operand: BlockOperand) -> Recipe:
    pair = (operand, operand)
    return Recipe(output=pair, grad_input=pair, grad_weight=pair)


_MXFP8, _NVFP4 = BlockOperand("mxfp8", 32), BlockOperand("nvfp4", 16)

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
    ("mxfp8_linear", "mxfp8"): _blocks(_MXFP8),
    ("mxfp8_linear", "mxfp8_swizzled"): _blocks(_MXFP8),
    ("nvfp4_linear", "nvfp4"): _blocks(_NVFP4),
    ("float8_grouped_experts", "rowwise"): _all(_E4M3, rowwise=True, power_of_two=True),
}


def definition(kind: str, recipe: str) -> Recipe | None:
    """The suite's reading of ``recipe`` for a module of ``kind``; None where it has none."""
    return _RECIPES.get((kind, recipe))


def _dequantized(t: torch.Tensor, operand: Operand | BlockOperand, contraction_dim: int) -> torch.Tensor:
    """``t`` quantized as ``operand`` says (rowwise: one scale per slice along
    ``contraction_dim``; blocks: per block along it) and read back, in float64."""
    if isinstance(operand, BlockOperand):
        return _dequantized_blocks(t, operand, contraction_dim)
    t32 = t.detach().float()
    amax = t32.abs().amax() if not operand.rowwise else t32.abs().amax(dim=contraction_dim, keepdim=True)
    top = torch.finfo(operand.dtype).max
    scale = (top / amax.double().clamp(min=1e-12)).float()
    if operand.power_of_two:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    data = (t32 * scale).clamp(-top, top).to(operand.dtype)
    return data.double() / scale.double()


_E8M0_BIAS, _E8M0_MAX_BYTE, _E4M3_EMAX = 127, 254, 8
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _mxfp8_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """``(..., block)`` float32 blocks as MXFP8 read back: the scale ``2**(floor(log2(amax)) -
    8)`` as an e8m0 byte (clamped to [0, 254]), the elements ``clamp(x / scale)`` in e4m3."""
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    _mantissa, exponent = torch.frexp(amax)  # amax = m * 2**exponent, m in [0.5, 1): floor(log2) = exponent - 1
    byte = (exponent - 1 - _E4M3_EMAX + _E8M0_BIAS).clamp(0, _E8M0_MAX_BYTE)
    scale = torch.exp2((byte - _E8M0_BIAS).double())
    top = torch.finfo(torch.float8_e4m3fn).max
    elements = (blocks.double() / scale).clamp(-top, top).float().to(torch.float8_e4m3fn)
    return elements.double() * scale


def _nvfp4_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """``(..., block)`` float32 blocks of one tensor as NVFP4 read back: a global scale
    ``amax / (448 * 6)`` (1 for an all-zero tensor), per block the e4m3 scale
    ``block_amax / 6 / global``, the elements ``x / (block_scale * global)`` rounded to the
    nearest e2m1 value."""
    e4m3_max, e2m1_max = torch.finfo(torch.float8_e4m3fn).max, _E2M1_VALUES[-1]
    amax = blocks.abs().amax()
    global_scale = torch.where(amax > 0, amax / (e4m3_max * e2m1_max), torch.ones_like(amax))
    block_scale = (blocks.abs().amax(dim=-1, keepdim=True) / e2m1_max / global_scale).clamp(max=e4m3_max)
    divisor = block_scale.to(torch.float8_e4m3fn).double() * global_scale.double()
    divisor = torch.where(divisor > 0, divisor, torch.ones_like(divisor))
    scaled = (blocks.double() / divisor).clamp(-e2m1_max, e2m1_max)
    grid = torch.tensor(_E2M1_VALUES, dtype=torch.float64, device=blocks.device)
    nearest = grid[(scaled.abs().unsqueeze(-1) - grid).abs().argmin(dim=-1)]
    return torch.copysign(nearest, scaled) * divisor


def _dequantized_blocks(t: torch.Tensor, operand: BlockOperand, contraction_dim: int) -> torch.Tensor:
    """``t`` (2-D) quantized in blocks of ``operand.block`` along ``contraction_dim`` (zero-padded
    to whole blocks: padding adds zero products) and read back, in float64."""
    rows = t.detach().float().movedim(contraction_dim, -1)
    k = rows.shape[-1]
    padded = torch.nn.functional.pad(rows, (0, -k % operand.block))
    blocks = padded.reshape(*padded.shape[:-1], -1, operand.block)
    values = _mxfp8_blocks(blocks) if operand.format == "mxfp8" else _nvfp4_blocks(blocks)
    return values.reshape(padded.shape)[..., :k].movedim(-1, contraction_dim)


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


def experts_step(recipe: Recipe, x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                 grad_output: torch.Tensor) -> dict[str, torch.Tensor]:
    """What ``recipe`` defines for grouped experts of ``weight`` (experts, out, in) on ``x``
    (tokens, in) sorted by expert, ``offs`` the groups' end offsets, and ``grad_output``
    (tokens, out): per token group, :func:`linear_step` on its tokens and its expert's weight (an
    empty group's expert gets a zero weight gradient), in float64."""
    out = x.new_zeros(x.shape[0], weight.shape[1], dtype=torch.float64)
    grad_input = torch.zeros_like(x, dtype=torch.float64)
    grad_weight = torch.zeros_like(weight, dtype=torch.float64)
    start = 0
    for expert, end in enumerate(offs.tolist()):
        if end > start:
            step = linear_step(recipe, x[start:end], weight[expert], grad_output[start:end])
            out[start:end], grad_input[start:end], grad_weight[expert] = step["output"], step["grad_input"], step["grad_weight"]
        start = end
    return {"output": out, "grad_input": grad_input, "grad_weight": grad_weight}
