"""Mutant backends whose swizzled MX linears lose their declared scale layout (capability ``mx``,
recipe ``mxfp8_swizzled``).

Each is the reference with MX linears that quantize as fp8conf's do and hand ``F.scaled_mm`` one
layout defect that torch's own checks let through: the graphs trace under torch's Meta kernel,
and only the suite's MXS rules show the defect.
"""

from __future__ import annotations

import torch

from conformance.backends.reference import ReferenceBackend
from fp8conf.quantized import mx as fp8conf_mx
from mutants.defective_linears import defective_linear, swap_into

__all__ = ["MUTANTS", "MXScalesNotSwizzled", "MXScalesRowMajorDeclared", "CompileRowMajorScales"]


def _row_major_padded(scales: torch.Tensor) -> torch.Tensor:
    """e8m0 scales row-major, zero-padded to the swizzled layout's size: what a trainer that
    forgot the swizzle passes."""
    rows, cols = scales.shape
    padded = torch.nn.functional.pad(scales.view(torch.uint8), (0, -cols % 4, 0, -rows % 128))
    return padded.reshape(-1).view(torch.float8_e8m0fnu)


def _matmul(lhs, rhs_t, out_dtype, defect: str, which: str):
    functional = torch.nn.functional
    lhs_q, lhs_s = fp8conf_mx.to_mx(fp8conf_mx._pad_last_dim(lhs))
    rhs_q, rhs_s = fp8conf_mx.to_mx(fp8conf_mx._pad_last_dim(rhs_t))
    block = functional.ScalingType.BlockWise1x32
    if defect == "not_swizzled":  # told SWIZZLE_32_4_4, given row-major
        swizzle = functional.SwizzleType.SWIZZLE_32_4_4
        lhs_scales, rhs_scales = _row_major_padded(lhs_s), _row_major_padded(rhs_s)
    else:  # "row_major_declared": row-major, and said so (NO_SWIZZLE): not the declared layout
        swizzle = functional.SwizzleType.NO_SWIZZLE
        lhs_scales, rhs_scales = lhs_s.view(torch.float8_e8m0fnu), rhs_s.view(torch.float8_e8m0fnu)
    return functional.scaled_mm(lhs_q, rhs_q.t(), lhs_scales, block, rhs_scales, block, swizzle_a=swizzle,
                                swizzle_b=swizzle, output_dtype=out_dtype)


_DefectiveMXLinear = defective_linear(fp8conf_mx.MXLinear, _matmul, real=lambda module: module.recipe == "mxfp8_swizzled")


class _NotSwizzled(_DefectiveMXLinear):
    defect = "not_swizzled"


class _RowMajorDeclared(_DefectiveMXLinear):
    defect = "row_major_declared"


def _convert(model, module_filter_fn, recipe, cls) -> None:
    fp8conf_mx.convert_to_mx_training(model, recipe=recipe, module_filter_fn=module_filter_fn)
    swap_into(model, fp8conf_mx.MXLinear, cls)


class MXScalesNotSwizzled(ReferenceBackend):
    """Its swizzled MX linears pass row-major e8m0 scales, padded to the swizzled size, as
    ``SWIZZLE_32_4_4``: every row reads another row's scale."""

    name = "mutant-mx-scales-not-swizzled"
    KILLED_BY = "MXS-002"

    def convert_mx(self, model, *, module_filter_fn, recipe):
        _convert(model, module_filter_fn, recipe, _NotSwizzled)


class MXScalesRowMajorDeclared(ReferenceBackend):
    """Its swizzled MX linears pass row-major e8m0 scales and say so (``NO_SWIZZLE``): a layout
    torch accepts, not the one the recipe declares."""

    name = "mutant-mx-scales-row-major-declared"
    KILLED_BY = "MXS-001"

    def convert_mx(self, model, *, module_filter_fn, recipe):
        _convert(model, module_filter_fn, recipe, _RowMajorDeclared)


def _row_major(scales: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    """Swizzled e8m0 scales of an operand of ``rows`` rows and contraction dim ``k``, row-major."""
    from conformance.judge.block_scaled import unswizzle

    matrix = unswizzle(scales.view(torch.uint8), rows, k, 32)
    return matrix.contiguous().view(torch.float8_e8m0fnu)


class CompileRowMajorScales(ReferenceBackend):
    """Traces and splits swizzled MX layers as the reference does, and its "compiled" step (the
    graph left eager, as a compiler that cannot lower swizzled scales may) passes their scales
    row-major with ``NO_SWIZZLE``: a compile that changes the declared layout."""

    name = "mutant-compile-row-major-mx-scales"
    KILLED_BY = "MXS-001"

    def compile(self, gm, *, mode, cudagraph=False):
        import copy

        from conformance.api.types import Compiled
        from conformance.judge.block_scaled import MXFP8, matmul_format

        out = copy.deepcopy(gm)
        for node in list(out.graph.nodes):
            if matmul_format(node) is not MXFP8 or not str(node.target).startswith("aten._scaled_mm_v2."):
                continue
            args = list(node.args)
            a, b = node.args[0].meta["val"], node.args[1].meta["val"]
            with out.graph.inserting_before(node):
                args[2] = [out.graph.call_function(_row_major, (args[2][0], a.shape[0], a.shape[1]))]
                args[5] = [out.graph.call_function(_row_major, (args[5][0], b.shape[1], b.shape[0]))]
            args[4] = args[7] = [0]
            node.args = tuple(args)
        out.recompile()
        names = frozenset(n.name for n in gm.graph.nodes if n.op == "call_function")
        return Compiled(fn=out, compiled_nodes=frozenset(), eager_nodes=names)


MUTANTS = [MXScalesNotSwizzled, MXScalesRowMajorDeclared, CompileRowMajorScales]
