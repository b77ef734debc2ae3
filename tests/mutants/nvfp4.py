"""Mutant backends whose NVFP4 linears lose the two-level block layout (capability ``nvfp4``).

Each is the reference with NVFP4 linears that quantize as fp8conf's do and hand ``F.scaled_mm``
one layout defect that torch's own checks let through (every shape and dtype torch's Meta kernel
asks for is right, so the graphs trace), or that leave one matmul out of NVFP4; only the suite's
NVF rules show the defect.
"""

from __future__ import annotations

import torch

from conformance.backends.reference import ReferenceBackend
from fp8conf.quantized import nvfp4 as fp8conf_nvfp4
from mutants.defective_linears import defective_linear, swap_into

__all__ = ["MUTANTS", "NVFP4ScalesNotSwizzled", "NVFP4WithoutGlobalScale", "NVFP4WeightGradInHighPrecision"]


def _row_major_padded(scales: torch.Tensor) -> torch.Tensor:
    """The block scales row-major, zero-padded to the swizzled layout's size: what a trainer
    that forgot the swizzle passes."""
    rows, cols = scales.shape
    padded = torch.nn.functional.pad(scales.view(torch.uint8), (0, -cols % 4, 0, -rows % 128))
    return padded.reshape(-1).view(torch.float8_e4m3fn)


def _matmul(lhs, rhs_t, out_dtype, defect: str, which: str):
    if defect == "hp_grad_weight":  # the weight gradient left in high precision; the others keep the layout
        if which == "grad_weight":
            return (lhs @ rhs_t.t()).to(out_dtype)
        return fp8conf_nvfp4._matmul(lhs, rhs_t, out_dtype, emulate=False)
    functional = torch.nn.functional
    lhs_q, lhs_s, lhs_g = fp8conf_nvfp4.to_nvfp4(fp8conf_nvfp4._pad_last_dim(lhs).contiguous())
    rhs_q, rhs_s, rhs_g = fp8conf_nvfp4.to_nvfp4(fp8conf_nvfp4._pad_last_dim(rhs_t).contiguous())
    swizzle = functional.SwizzleType.SWIZZLE_32_4_4
    if defect == "not_swizzled":
        recipes = [functional.ScalingType.BlockWise1x16, functional.ScalingType.TensorWise]
        swizzles = [swizzle, functional.SwizzleType.NO_SWIZZLE]
        return functional.scaled_mm(
            lhs_q, rhs_q.t(), [_row_major_padded(lhs_s), lhs_g], recipes, [_row_major_padded(rhs_s), rhs_g], recipes,
            swizzle_a=swizzles, swizzle_b=swizzles, output_dtype=out_dtype,
        )
    # "no_global": the global scale folded into the block scales (one e4m3 scale list), which
    # torch accepts: right until a tensor's range outgrows e4m3's.
    folded_l = fp8conf_nvfp4.swizzle_block_scales((lhs_s.float() * lhs_g).to(torch.float8_e4m3fn))
    folded_r = fp8conf_nvfp4.swizzle_block_scales((rhs_s.float() * rhs_g).to(torch.float8_e4m3fn))
    block = functional.ScalingType.BlockWise1x16
    return functional.scaled_mm(lhs_q, rhs_q.t(), folded_l, block, folded_r, block, swizzle_a=swizzle, swizzle_b=swizzle,
                                output_dtype=out_dtype)


_DefectiveNVFP4Linear = defective_linear(fp8conf_nvfp4.NVFP4Linear, _matmul, real=lambda module: not module.emulate)


class _NotSwizzled(_DefectiveNVFP4Linear):
    defect = "not_swizzled"


class _NoGlobal(_DefectiveNVFP4Linear):
    defect = "no_global"


class _HPGradWeight(_DefectiveNVFP4Linear):
    defect = "hp_grad_weight"


def _convert(model, module_filter_fn, recipe, cls) -> None:
    fp8conf_nvfp4.convert_to_nvfp4_training(model, recipe=recipe, module_filter_fn=module_filter_fn)
    swap_into(model, fp8conf_nvfp4.NVFP4Linear, cls)


class NVFP4ScalesNotSwizzled(ReferenceBackend):
    """Its NVFP4 linears pass row-major block scales, padded to the swizzled size, as
    ``SWIZZLE_32_4_4``: every row reads another row's scales."""

    name = "mutant-nvfp4-scales-not-swizzled"
    KILLED_BY = "NVF-002"

    def convert_nvfp4(self, model, *, module_filter_fn, recipe):
        _convert(model, module_filter_fn, recipe, _NotSwizzled)


class NVFP4WithoutGlobalScale(ReferenceBackend):
    """Its NVFP4 linears fold the global scale into the e4m3 block scales and pass one scale per
    operand: a one-level layout, not NVFP4's two."""

    name = "mutant-nvfp4-without-global-scale"
    KILLED_BY = "NVF-001"

    def convert_nvfp4(self, model, *, module_filter_fn, recipe):
        _convert(model, module_filter_fn, recipe, _NoGlobal)


class NVFP4WeightGradInHighPrecision(ReferenceBackend):
    """Its NVFP4 linears compute the weight gradient in high precision (as ``rowwise_with_gw_hp``
    does for float8) while the recipe quantizes all three matmuls: every matmul it does issue
    keeps the layout; one per backward call is missing."""

    name = "mutant-nvfp4-weight-grad-in-high-precision"
    KILLED_BY = "NVF-001"

    def convert_nvfp4(self, model, *, module_filter_fn, recipe):
        _convert(model, module_filter_fn, recipe, _HPGradWeight)


MUTANTS = [NVFP4ScalesNotSwizzled, NVFP4WithoutGlobalScale, NVFP4WeightGradInHighPrecision]
