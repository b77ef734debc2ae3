"""A graph trainer's own MXFP8 linear, on ``F.scaled_mm`` with swizzled e8m0 scales.

Like ``trainer_float8.py`` this file imports torch only: the trainer owns its quantization, and
fp8conf learns of the module from a registration made elsewhere (``trainer_backend.py``).

* Every matmul (output, grad_input, grad_weight) quantizes both operands to MXFP8 along its
  contraction dim: ``float8_e4m3fn`` elements and one power-of-two scale per block of 32, the
  scale's exponent ``floor(log2(amax)) - 8`` (the OCP rule), stored as an e8m0 byte
  ``exponent + 127``; the batch dim of the weight gradient is zero-padded to a multiple of 32.
* The scales reach ``F.scaled_mm`` in cuBLAS's tiled layout (``SWIZZLE_32_4_4``), computed here by
  index arithmetic (:func:`swizzle`), as recipe ``BlockWise1x32``.
* There is no emulated mode: the trainer's MX linears are real or absent. Only sm100 GPUs run
  them; elsewhere their graphs trace (torch's Meta kernel checks the layout).
"""

from __future__ import annotations

import torch
from torch import nn

BLOCK = 32
_E4M3 = torch.float8_e4m3fn


def quantize(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` (R, C), C a multiple of 32, as ``(e4m3 data, e8m0 scale bytes (R, C / 32) uint8)``."""
    rows, cols = t.shape
    blocks = t.to(torch.float32).reshape(rows, cols // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1).clamp(min=2.0**-100)
    exponent = (torch.floor(torch.log2(amax)) - 8).clamp(-126, 127)
    data = (blocks * torch.exp2(-exponent).unsqueeze(-1)).clamp(-448, 448).to(_E4M3).reshape(rows, cols)
    return data, (exponent + 127).to(torch.uint8)


def swizzle(scales: torch.Tensor) -> torch.Tensor:
    """``(rows, cols)`` scale bytes in ``SWIZZLE_32_4_4`` order, as ``float8_e8m0fnu``: tiles of 128
    rows by 4 columns in row-major order, 512 bytes each, row ``32 * g + i`` and column ``c`` of a
    tile at byte ``16 * i + 4 * g + c``; padding zero."""
    rows, cols = scales.shape
    padded_rows, padded_cols = -(-rows // 128) * 128, -(-cols // 4) * 4
    r = torch.arange(rows, device=scales.device).unsqueeze(1)
    c = torch.arange(cols, device=scales.device).unsqueeze(0)
    tile = (r // 128) * (padded_cols // 4) + c // 4
    position = tile * 512 + 16 * (r % 32) + 4 * ((r % 128) // 32) + c % 4
    out = torch.zeros(padded_rows * padded_cols, dtype=torch.uint8, device=scales.device)
    out[position.reshape(-1)] = scales.reshape(-1)
    return out.view(torch.float8_e8m0fnu)


def _pad(t: torch.Tensor) -> torch.Tensor:
    pad = -t.shape[-1] % BLOCK
    return torch.nn.functional.pad(t, (0, pad)) if pad else t


def mx_mm(lhs: torch.Tensor, rhs_t: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``lhs @ rhs_t.T``, both quantized to MXFP8 along their shared last dim."""
    lhs_data, lhs_scales = quantize(_pad(lhs.contiguous()))
    rhs_data, rhs_scales = quantize(_pad(rhs_t.contiguous()))
    functional = torch.nn.functional
    recipe, layout = functional.ScalingType.BlockWise1x32, functional.SwizzleType.SWIZZLE_32_4_4
    return functional.scaled_mm(lhs_data, rhs_data.t(), swizzle(lhs_scales), recipe, swizzle(rhs_scales), recipe,
                                swizzle_a=layout, swizzle_b=layout, output_dtype=out_dtype)


@torch._dynamo.allow_in_graph
class _MXLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return mx_mm(x, weight, x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = mx_mm(grad_out, weight.t(), x.dtype) if ctx.needs_input_grad[0] else None
        grad_w = mx_mm(grad_out.t(), x.t(), weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w


class TrainerMXLinear(nn.Linear):
    """``nn.Linear`` computing its three matmuls in MXFP8 on ``F.scaled_mm`` with swizzled scales;
    in and out features multiples of 32."""

    recipe = "mxfp8_swizzled"

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None, dtype=None):
        if in_features % BLOCK or out_features % BLOCK:
            raise ValueError(f"TrainerMXLinear: features must be multiples of {BLOCK}, got {in_features} -> {out_features}")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)

    @classmethod
    def from_float(cls, linear: nn.Linear) -> TrainerMXLinear:
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        new.weight, new.bias = linear.weight, linear.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _MXLinearFunction.apply(x.reshape(-1, x.shape[-1]), self.weight).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias.to(out.dtype)


def convert(model: nn.Module, *, module_filter_fn=None) -> nn.Module:
    """Swap ``model``'s plain ``nn.Linear`` modules for :class:`TrainerMXLinear`, in place."""
    swapped: dict[int, TrainerMXLinear] = {}
    for fqn, module in list(model.named_modules(remove_duplicate=False)):
        if type(module) is not nn.Linear or (module_filter_fn is not None and not module_filter_fn(module, fqn)):
            continue
        new = swapped.setdefault(id(module), TrainerMXLinear.from_float(module))
        parent, _, name = fqn.rpartition(".")
        setattr(model.get_submodule(parent), name, new)
    return model
