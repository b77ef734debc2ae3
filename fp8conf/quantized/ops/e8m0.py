"""``fp8conf::scaled_mm_e8m0``: an MX block-scaled FP8 matmul on E8M0 scale bytes.

MX scales are E8M0 bytes: byte ``b`` means ``2**(b - 127)``, byte 255 is NaN and byte 0 is
``2**-127`` (a float32 subnormal that must never be flushed to zero). PyTorch has a dtype for
them, ``torch.float8_e8m0fnu``, but the CPU Inductor of torch 2.13 and older has no C++ type for
it, so any e8m0 tensor that reaches its generated code aborts compilation. The op therefore takes
the scales as plain ``uint8`` bytes, and under ``torch.compile`` stays one opaque node so that
e8m0 never reaches Inductor. It also takes them as ``float8_e8m0fnu`` tensors, read as the same
bytes (a view, never a conversion of values): where Inductor lowers e8m0 (torch 2.14 and newer,
:func:`fp8conf.torch_internals.inductor_lowers_e8m0`), MX scales travel natively from their
quantization to this op, compiled or not.

Semantics (every kernel): dequantize each operand blockwise in float32 (element times
``2**(byte - 127)``, 32 elements per byte along K), multiply in float32, cast to ``out_dtype``.
A byte 255 turns every output that uses its block into NaN. Note that this definition overflows
to ``inf`` when a dequantized element exceeds the float32 range (large bytes with large elements).

Kernels:

* CUDA, compute capability >= 10.0, ``out_dtype=bfloat16`` and N a multiple of 16: cuBLAS through
  ``torch._scaled_mm`` with the scales swizzled into cuBLAS's block layout
  (:func:`to_cublas_blocked`). sm90 cuBLAS rejects MX scales (CUBLAS_STATUS_NOT_SUPPORTED), and
  torch's own MX tests cover only bfloat16 output, so other cases take the emulation.
* everywhere else: the exact float32 emulation (:func:`emulated_scaled_mm_e8m0`).

Bad arguments raise :class:`MXArgumentError` (a ``ValueError``) naming the argument, from the
real kernels and from the fake kernel alike, so the checks also fire while ``torch.compile``
traces.
"""

from __future__ import annotations

import torch

from fp8conf.errors import MXArgumentError

__all__ = [
    "OP_NAME",
    "MX_BLOCK_SIZE",
    "OUT_DTYPES",
    "E8M0_NAN_BYTE",
    "SCALE_DTYPES",
    "MXArgumentError",
    "scaled_mm_e8m0",
    "scale_bytes",
    "emulated_scaled_mm_e8m0",
    "e8m0_to_float32",
    "apply_e8m0_scale",
    "to_cublas_blocked",
    "uses_cublas",
]

OP_NAME = "fp8conf::scaled_mm_e8m0"
#: Elements per E8M0 scale byte along K (the OCP MX block size; cuBLAS supports only this one).
MX_BLOCK_SIZE = 32
#: The output dtypes the op accepts.
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: The E8M0 byte that encodes NaN.
E8M0_NAN_BYTE = 255

_E8M0_BIAS = 127
_F32_MANTISSA_BITS = 23
# float32 bit patterns: 2**-127 is the subnormal with only mantissa bit 22 set; a quiet NaN.
_F32_BITS_2_POW_MINUS_127 = 1 << 22
_F32_BITS_QUIET_NAN = 0x7FC00000
# cuBLAS's MX scale layout tiles the (rows, K/32) scale matrix in 128 x 4 tiles.
_CUBLAS_TILE_ROWS = 128
_CUBLAS_TILE_COLS = 4
_CUBLAS_OUT_DTYPES = (torch.bfloat16,)


# --- argument checks (shared by the real and the fake kernels) ----------------------------------


def _fail(argument: str, problem: str, remedy: str):
    raise MXArgumentError(argument, f"{OP_NAME}: argument `{argument}` {problem}; {remedy}")


def _check_operand(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2:
        _fail(name, f"must be a 2-D matrix, got shape {tuple(t.shape)}", "flatten leading dims first")
    if t.dtype != torch.float8_e4m3fn:
        _fail(
            name,
            f"must have dtype torch.float8_e4m3fn, got {t.dtype}",
            "quantize it first (fp8conf.quantized.mx.to_mx gives e4m3 elements and uint8 scales)",
        )


#: The scale dtypes the op takes: biased exponent bytes, or torch's own e8m0 dtype (the same bytes).
SCALE_DTYPES = (torch.uint8, torch.float8_e8m0fnu)


def _check_scale(name: str, scale: torch.Tensor, expected: tuple, what: str) -> None:
    if scale.dtype not in SCALE_DTYPES:
        _fail(
            name,
            f"must have dtype torch.uint8 (biased E8M0 exponents) or torch.float8_e8m0fnu, got {scale.dtype}",
            "pass the scale bytes (fp8conf.quantized.mx.to_mx gives them), not scale values",
        )
    if tuple(scale.shape) != tuple(expected):
        _fail(name, f"must have shape {tuple(expected)} ({what}), got {tuple(scale.shape)}", "recompute the scales")


def _check_args(a, b, a_scale, b_scale, out_dtype) -> None:
    _check_operand("a", a)
    _check_operand("b", b)
    m, k = a.shape
    k_b, n = b.shape
    if k_b != k:
        _fail("b", f"has {k_b} rows but `a` has {k} columns (K)", "pass b as (K, N), e.g. weight_fp8.t()")
    if k % MX_BLOCK_SIZE != 0:
        _fail("a", f"has K={k} columns, not a multiple of {MX_BLOCK_SIZE}", "pad K with zeros to a multiple of 32")
    _check_scale("a_scale", a_scale, (m, k // MX_BLOCK_SIZE), "one byte per 32 elements along K for each row of a")
    _check_scale("b_scale", b_scale, (n, k // MX_BLOCK_SIZE), "one byte per 32 elements along K for each column of b")
    if out_dtype not in OUT_DTYPES:
        _fail("out_dtype", f"must be one of {OUT_DTYPES}, got {out_dtype}", "pick a floating output dtype")
    for name, t in (("b", b), ("a_scale", a_scale), ("b_scale", b_scale)):
        if t.device != a.device:
            _fail(name, f"is on {t.device} but `a` is on {a.device}", "move all four tensors to one device")


# --- E8M0 arithmetic ------------------------------------------------------------------------------


def scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` as ``uint8`` bytes: a ``float8_e8m0fnu`` tensor is viewed (its bits kept), never
    converted (``.to(torch.uint8)`` would turn ``2**(b - 127)`` into an integer)."""
    return scale.view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale


def _pow2_normal(exponent: torch.Tensor) -> torch.Tensor:
    """Exact ``2**exponent`` in float32 for int32 exponents in the normal range [-126, 127]."""
    return torch.bitwise_left_shift(exponent + _E8M0_BIAS, _F32_MANTISSA_BITS).view(torch.float32)


def e8m0_to_float32(scale_u8: torch.Tensor) -> torch.Tensor:
    """The float32 value of each E8M0 byte: ``2**(b - 127)``, byte 0 -> ``2**-127``, 255 -> NaN.

    Bit math, not ``exp2``: bytes 1..254 share float32's bias, so ``b << 23`` is already the
    float32 pattern; byte 0 needs the subnormal pattern, which no shift of the byte produces.
    """
    b = scale_bytes(scale_u8).to(torch.int32)
    bits = torch.bitwise_left_shift(b, _F32_MANTISSA_BITS)
    bits = torch.where(b == 0, _F32_BITS_2_POW_MINUS_127, bits)
    bits = torch.where(b == E8M0_NAN_BYTE, _F32_BITS_QUIET_NAN, bits)
    return bits.view(torch.float32)


def apply_e8m0_scale(values: torch.Tensor, scale_u8: torch.Tensor) -> torch.Tensor:
    """``values * 2**(scale_u8 - 127)`` in float32 (broadcasting), NaN where the byte is 255.

    The power of two is applied as two normal factors (each exponent within [-64, 64]) instead of
    one: ``2**-127`` is subnormal, and flush-to-zero (``torch.set_flush_denormal``, GPU FTZ) would
    zero it and every element it scales. Multiplying by powers of two is exact, so the split
    rounds only where the true result is itself subnormal.
    """
    scale_u8 = scale_bytes(scale_u8)
    exponent = scale_u8.to(torch.int32).clamp(max=2 * _E8M0_BIAS) - _E8M0_BIAS
    high = torch.bitwise_right_shift(exponent, 1)  # floor(exponent / 2), in [-64, 63]
    low = exponent - high  # in [-63, 64]
    out = values.to(torch.float32) * _pow2_normal(high) * _pow2_normal(low)
    return out.masked_fill(scale_u8 == E8M0_NAN_BYTE, float("nan"))


# --- kernels ----------------------------------------------------------------------------------------


def emulated_scaled_mm_e8m0(a, b, a_scale, b_scale, out_dtype=torch.bfloat16) -> torch.Tensor:
    """The exact emulation: dequantize both operands blockwise in float32, ``mm`` in float32."""
    a_scale, b_scale = scale_bytes(a_scale), scale_bytes(b_scale)
    m, k = a.shape
    n = b.shape[1]
    blocks = k // MX_BLOCK_SIZE
    a_hp = apply_e8m0_scale(a.to(torch.float32).reshape(m, blocks, MX_BLOCK_SIZE), a_scale.unsqueeze(-1))
    # b's blocks run down its columns, so scale b^T (N, K) row-wise.
    b_t_hp = apply_e8m0_scale(b.t().to(torch.float32).reshape(n, blocks, MX_BLOCK_SIZE), b_scale.unsqueeze(-1))
    return torch.mm(a_hp.reshape(m, k), b_t_hp.reshape(n, k).t()).to(out_dtype)


def to_cublas_blocked(scale_u8: torch.Tensor) -> torch.Tensor:
    """Rearrange a (rows, K/32) scale matrix into cuBLAS's 1-D block-scaling layout.

    cuBLAS reads MX scales in tiles of 128 rows x 4 scale columns, tiles in row-major order, each
    tile 512 contiguous bytes. Inside a tile, row ``r`` (split as ``r = 32 * g + i``) and column
    ``c`` sit at byte ``16 * i + 4 * g + c``: the four 32-row groups are interleaved so that one
    16-byte load gives a thread 4 rows' worth of 4 K-blocks. Rows and columns are padded with
    zeros up to whole tiles. Returns a contiguous 1-D tensor of the input's dtype.
    """
    rows, cols = scale_u8.shape
    tile_rows = -(-rows // _CUBLAS_TILE_ROWS)
    tile_cols = -(-cols // _CUBLAS_TILE_COLS)
    pad_rows = tile_rows * _CUBLAS_TILE_ROWS - rows
    pad_cols = tile_cols * _CUBLAS_TILE_COLS - cols
    padded = torch.nn.functional.pad(scale_u8, (0, pad_cols, 0, pad_rows))
    # axes: (tile row, group g, row i within group, tile col, col c within tile)
    tiles = padded.view(tile_rows, 4, 32, tile_cols, _CUBLAS_TILE_COLS)
    return tiles.permute(0, 3, 2, 1, 4).reshape(-1)


def uses_cublas(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether the op runs cuBLAS's MX kernel for these operands (else the emulation)."""
    if a.device.type != "cuda" or torch.version.cuda is None:
        return False
    if torch.cuda.get_device_capability(a.device) < (10, 0):
        return False
    # _scaled_mm wants both dims of mat2 divisible by 16; K already is (multiple of 32).
    return out_dtype in _CUBLAS_OUT_DTYPES and b.shape[1] % 16 == 0


def _cublas_scaled_mm_e8m0(a, b, a_scale, b_scale, out_dtype) -> torch.Tensor:
    # cuBLASLt multiplies a row-major A by a column-major B only.
    a_row_major = a.contiguous()
    b_col_major = b.t().contiguous().t()
    return torch._scaled_mm(
        a_row_major,
        b_col_major,
        to_cublas_blocked(scale_bytes(a_scale)).view(torch.float8_e8m0fnu),
        to_cublas_blocked(scale_bytes(b_scale)).view(torch.float8_e8m0fnu),
        out_dtype=out_dtype,
    )


@torch.library.custom_op(OP_NAME, mutates_args=())
def _scaled_mm_e8m0(
    a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    _check_args(a, b, a_scale, b_scale, out_dtype)
    return emulated_scaled_mm_e8m0(a, b, a_scale, b_scale, out_dtype)


@_scaled_mm_e8m0.register_kernel("cuda")
def _scaled_mm_e8m0_cuda(a, b, a_scale, b_scale, out_dtype):
    _check_args(a, b, a_scale, b_scale, out_dtype)
    if uses_cublas(a, b, out_dtype):
        return _cublas_scaled_mm_e8m0(a, b, a_scale, b_scale, out_dtype)
    return emulated_scaled_mm_e8m0(a, b, a_scale, b_scale, out_dtype)


@_scaled_mm_e8m0.register_fake
def _scaled_mm_e8m0_fake(a, b, a_scale, b_scale, out_dtype):
    _check_args(a, b, a_scale, b_scale, out_dtype)
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def scaled_mm_e8m0(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """MX block-scaled matmul ``dequant(a, a_scale) @ dequant(b, b_scale)`` in ``out_dtype``.

    Args:
        a: (M, K) ``float8_e4m3fn``; K a multiple of 32.
        b: (K, N) ``float8_e4m3fn`` (any strides; ``weight_fp8.t()`` is fine).
        a_scale: (M, K // 32) E8M0 bytes, one per 32 elements along K of each row of a: ``uint8``,
            or ``float8_e8m0fnu`` (read as the same bytes).
        b_scale: (N, K // 32) E8M0 bytes, one per 32 elements along K of each column of b (same
            dtypes).
        out_dtype: float32, bfloat16 or float16.

    Raises:
        MXArgumentError: (a ``ValueError``) naming the argument that cannot be used.
    """
    if not isinstance(out_dtype, torch.dtype):
        _fail("out_dtype", f"must be a torch.dtype, got {out_dtype!r}", "pass e.g. torch.bfloat16")
    for name, t in (("a", a), ("b", b), ("a_scale", a_scale), ("b_scale", b_scale)):
        if not isinstance(t, torch.Tensor):
            _fail(name, f"must be a torch.Tensor, got {type(t).__qualname__}", "pass a tensor")
    return torch.ops.fp8conf.scaled_mm_e8m0(a, b, a_scale, b_scale, out_dtype)
