"""Mutant backends for E8M0: the reference with one defect each in its e8m0 op, and one whose
compiled MX path computes other scale bytes than its eager one (NUM-005)."""

from __future__ import annotations

import torch

from conformance.backends.reference import ReferenceBackend
from fp8conf.quantized.ops.e8m0 import E8M0_NAN_BYTE, MX_BLOCK_SIZE, _check_args, emulated_scaled_mm_e8m0, scaled_mm_e8m0

BADFAKE_OP = "fp8conf_mutants::scaled_mm_e8m0_badfake"


def _register_badfake():
    # Importing this module twice (as mutants.e8m0 and by path) must not define the op twice.
    if hasattr(torch.ops, "fp8conf_mutants") and hasattr(torch.ops.fp8conf_mutants, "scaled_mm_e8m0_badfake"):
        return

    @torch.library.custom_op(BADFAKE_OP, mutates_args=())
    def badfake(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        _check_args(a, b, a_scale, b_scale, out_dtype)
        return emulated_scaled_mm_e8m0(a, b, a_scale, b_scale, out_dtype)

    @badfake.register_fake
    def _(a, b, a_scale, b_scale, out_dtype):
        _check_args(a, b, a_scale, b_scale, out_dtype)
        return a.new_empty((a.shape[0], b.shape[1] + 1), dtype=out_dtype)  # one column too many


_register_badfake()


class BiasOffByOne(ReferenceBackend):
    """Decodes scale byte ``s`` as ``2**(s - 128)``: the E8M0 exponent bias off by one."""

    name = "mutant-e8m0-bias-off-by-one"
    KILLED_BY = "E8M0-001"

    def scaled_mm_e8m0(self, a, b, a_scale, b_scale, out_dtype):
        def shifted(scale):
            lowered = (scale.to(torch.int32) - 1).clamp(min=0).to(torch.uint8)
            return torch.where(scale == E8M0_NAN_BYTE, scale, lowered)

        return super().scaled_mm_e8m0(a, b, shifted(a_scale), shifted(b_scale), out_dtype)


class Float16OutputThroughBfloat16(ReferenceBackend):
    """Computes a float16 output as bfloat16 and converts it: right for two of the three output
    dtypes, three bits of float16's precision lost (the kind of defect one member of a finite
    space carries, found when that member is asked about)."""

    name = "mutant-e8m0-float16-output-through-bfloat16"
    KILLED_BY = "E8M0-001"

    def scaled_mm_e8m0(self, a, b, a_scale, b_scale, out_dtype):
        if out_dtype == torch.float16:
            return super().scaled_mm_e8m0(a, b, a_scale, b_scale, torch.bfloat16).to(torch.float16)
        return super().scaled_mm_e8m0(a, b, a_scale, b_scale, out_dtype)


class NanByteIsANumber(ReferenceBackend):
    """Treats byte 255 as the number ``2**128`` would be clamped to, ``2**127``: no NaN."""

    name = "mutant-e8m0-nan-byte-is-a-number"
    KILLED_BY = "E8M0-002"

    def scaled_mm_e8m0(self, a, b, a_scale, b_scale, out_dtype):
        def finite(scale):
            return scale.clamp(max=E8M0_NAN_BYTE - 1) if scale.dtype == torch.uint8 else scale

        return super().scaled_mm_e8m0(a, b, finite(a_scale), finite(b_scale), out_dtype)


class BadFakeShape(ReferenceBackend):
    """Runs an op of its own whose fake (meta) kernel returns one column too many."""

    name = "mutant-e8m0-bad-fake-shape"
    KILLED_BY = "E8M0-003"

    def scaled_mm_e8m0(self, a, b, a_scale, b_scale, out_dtype):
        return torch.ops.fp8conf_mutants.scaled_mm_e8m0_badfake(a, b, a_scale, b_scale, out_dtype)

    def e8m0_op(self):
        return torch.ops.fp8conf_mutants.scaled_mm_e8m0_badfake.default


class GraphBreak(ReferenceBackend):
    """Logs from inside the wrapper in a way Dynamo cannot trace: a graph break before the op."""

    name = "mutant-e8m0-graph-break"
    KILLED_BY = "E8M0-004"

    def scaled_mm_e8m0(self, a, b, a_scale, b_scale, out_dtype):
        torch._dynamo.graph_break()
        return super().scaled_mm_e8m0(a, b, a_scale, b_scale, out_dtype)


class RaggedKAccepted(ReferenceBackend):
    """Pads K with zeros up to a multiple of 32 instead of rejecting it."""

    name = "mutant-e8m0-ragged-k-accepted"
    KILLED_BY = "E8M0-005"

    def scaled_mm_e8m0(self, a, b, a_scale, b_scale, out_dtype):
        k = a.shape[-1]
        pad = -k % MX_BLOCK_SIZE
        if a.dim() == 2 and b.dim() == 2 and pad and a.dtype == b.dtype == torch.float8_e4m3fn:
            a = torch.nn.functional.pad(a.float(), (0, pad)).to(a.dtype)
            b = torch.nn.functional.pad(b.float(), (0, 0, 0, pad)).to(b.dtype)
        return scaled_mm_e8m0(a, b, a_scale, b_scale, out_dtype)


class E8M0ScalesByValue(ReferenceBackend):
    """Takes ``float8_e8m0fnu`` scales by value, ``scale.to(torch.uint8)`` (byte ``b`` becomes the
    integer ``2**(b - 127)``, saturated), as a port that met only ``uint8`` bytes would: right on
    the bytes it was tested with, wrong on TorchAO's own scale dtype."""

    name = "mutant-e8m0-scales-by-value"
    KILLED_BY = "E8M0-006"

    def scaled_mm_e8m0(self, a, b, a_scale, b_scale, out_dtype):
        def by_value(scale):
            return scale.to(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale

        return super().scaled_mm_e8m0(a, b, by_value(a_scale), by_value(b_scale), out_dtype)


class CompiledE8M0ScalesByValue(ReferenceBackend):
    """Reads ``float8_e8m0fnu`` scales as bytes eagerly, but by value while Dynamo traces it (a
    compiled path that converts what the eager one views): only a compiled comparison sees it."""

    name = "mutant-e8m0-compiled-scales-by-value"
    KILLED_BY = "E8M0-006"

    def scaled_mm_e8m0(self, a, b, a_scale, b_scale, out_dtype):
        if torch.compiler.is_compiling():
            a_scale, b_scale = (s.to(torch.uint8) if s.dtype == torch.float8_e8m0fnu else s for s in (a_scale, b_scale))
        return super().scaled_mm_e8m0(a, b, a_scale, b_scale, out_dtype)


class CompiledScalesOneExponentUp(ReferenceBackend):
    """Compiles MX models with the scale exponent taken against 2**7 instead of e4m3's 2**8 (as a
    fused cast kernel written for another element format would): every scale byte one higher
    and the elements halved to match (each block's values keep their size, small ones lose
    precision: about 4 % in relative norm); eager runs the recipe's bytes. No other property
    compiles an MX model."""

    name = "mutant-compiled-scales-one-exponent-up"
    KILLED_BY = "NUM-005"

    def compile(self, gm, *, mode, cudagraph=False):
        from conformance.observe.graphs import copy_graph_module

        gm = copy_graph_module(gm)
        for node in gm.graph.nodes:
            # ``field - 8``: the float32 exponent field of a block's amax minus e4m3's largest exponent.
            value = node.meta.get("val")
            if node.target is torch.ops.aten.sub.Tensor and node.args[1:] == (8,) and getattr(value, "dtype", None) is torch.int32:
                node.args = (node.args[0], 7)
        gm.recompile()
        return super().compile(gm, mode=mode, cudagraph=cudagraph)


MUTANTS = [BiasOffByOne, Float16OutputThroughBfloat16, NanByteIsANumber, BadFakeShape, GraphBreak, RaggedKAccepted, E8M0ScalesByValue,
           CompiledE8M0ScalesByValue, CompiledScalesOneExponentUp]
