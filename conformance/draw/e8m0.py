"""The operands the E8M0 properties draw, as plain data, and the suite's own float64 reference.

An :class:`E8M0Case` is a frozen dataclass whose ``repr`` is valid Python, so every failing
example prints as code a person can paste::

    from conformance.draw.e8m0 import *
    a, b, a_scale, b_scale = E8M0Case(...).build()

The op under test (``Backend.scaled_mm_e8m0``) multiplies ``a`` (M, K) by ``b`` (K, N), both
``float8_e4m3fn``, each dequantized blockwise with one E8M0 scale byte per 32 elements along K:
``a_scale`` (M, K/32) and ``b_scale`` (N, K/32), ``uint8``. Byte ``b`` means ``2**(b - 127)``,
byte 0 is ``2**-127`` (never flushed), byte 255 is NaN.

The reference never asks the backend: it decodes the bytes itself, in float64 (where every
power of two the bytes encode is a normal number), and multiplies in float64.

Cases keep every dequantized value and every sum of products inside the output dtype's range
(see :func:`fit_scale_bytes`), so each output can be compared; large scale bytes come with small
elements, as they do in real MX tensors, where a block's scale follows its largest element.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

__all__ = [
    "BLOCK",
    "NAN_BYTE",
    "OUT_DTYPES",
    "ELEMENT_STYLES",
    "E8M0Case",
    "element_threshold",
    "float8_allclose",
    "exponent_budget",
    "fit_scale_bytes",
    "reference",
]

#: Elements per scale byte along K.
BLOCK = 32
#: The E8M0 byte that encodes NaN.
NAN_BYTE = 255
#: Output dtypes (names of ``torch`` attributes) the op must support.
OUT_DTYPES = ("float32", "bfloat16", "float16")
#: How a case draws the elements of an operand: ``normal`` (spread over e4m3's range), ``saturating``
#: (magnitudes 384 to 448, e4m3's largest), ``tiny`` (2**-9 to 2**-6: e4m3 subnormals and its
#: smallest normals), ``mixed`` (each element one of those, or zero).
ELEMENT_STYLES = ("normal", "saturating", "tiny", "mixed")

_BIAS = 127
# log2 of a bound on |e4m3 element| (448 < 2**9).
_ELEMENT_BITS = 9
# log2 of a bound kept below each output dtype's largest finite value, with margin for rounding.
_RANGE_BITS = {"float32": 126, "bfloat16": 126, "float16": 15}
# How far below the budget a follower's bytes may go before its products with the leader's largest
# block vanish below the output dtype's normal range (roughly the dtype's exponent range).
_WINDOW_BITS = {"float32": 200, "bfloat16": 200, "float16": 24}


def _ceil_log2(n: int) -> int:
    return max(0, math.ceil(math.log2(n)))


def exponent_budget(out_dtype: str, k: int) -> int:
    """The largest ``ea + eb`` (effective scale bytes of a pair of blocks that meet in an output)
    for which ``K`` products ``|ea_elem * eb_elem| * 2**(ea + eb - 254)`` sum within range."""
    return _RANGE_BITS[out_dtype] + 2 * _BIAS - 2 * _ELEMENT_BITS - _ceil_log2(k)


def element_threshold(out_dtype: str, k: int) -> int:
    """Scale bytes above this shrink their block's elements by ``2**-(byte - threshold)``: an e4m3
    element times ``2**(threshold - 127)`` stays a finite float32 and within the budget."""
    return min(2 * _BIAS - _ELEMENT_BITS, exponent_budget(out_dtype, k))  # 2**(9 + 245 - 127) = 2**127


def fit_scale_bytes(a_bytes, b_bytes, m: int, n: int, k: int, out_dtype: str, a_leads) -> tuple[tuple, tuple]:
    """Clamp drawn scale bytes so every output stays in range, keeping the extremes drawn.

    For each block column (index along K/32), ``a_leads[kb]`` says which operand keeps its bytes:
    the other one's bytes are clamped to the budget left by the leader's largest effective byte,
    and raised to at most a window below it, so that its products with the leader's largest block
    neither overflow nor vanish. Bytes 255 (NaN) are kept and count as 0. Returns
    ``(a_bytes, b_bytes)`` as tuples.
    """
    blocks = k // BLOCK
    a = [list(a_bytes[i * blocks:(i + 1) * blocks]) for i in range(m)]
    b = [list(b_bytes[j * blocks:(j + 1) * blocks]) for j in range(n)]
    threshold, budget = element_threshold(out_dtype, k), exponent_budget(out_dtype, k)

    def effective(byte):
        return 0 if byte == NAN_BYTE else min(byte, threshold)

    for kb in range(blocks):
        lead, follow = (a, b) if a_leads[kb] else (b, a)
        cap = budget - max(effective(row[kb]) for row in lead)
        floor = min(254, cap - _WINDOW_BITS[out_dtype])
        for row in follow:
            if row[kb] != NAN_BYTE:
                row[kb] = max(0, floor, min(row[kb], cap))
    return tuple(x for row in a for x in row), tuple(x for row in b for x in row)


#: How an operand may be stored (:attr:`E8M0Case.a_layout`, :attr:`E8M0Case.b_layout`).
A_LAYOUTS = ("row_major", "column_major")
B_LAYOUTS = ("row_major", "transposed_weight")


@dataclasses.dataclass(frozen=True)
class E8M0Case:
    """Operands of one call. Bytes are row-major: ``a_bytes[i * K/32 + kb]`` scales row ``i`` of
    ``a``, ``b_bytes[j * K/32 + kb]`` column ``j`` of ``b``, each over elements ``32 kb .. 32 kb + 31``
    along K. ``zero_nan_blocks`` zeroes the elements of blocks whose byte is 255 (NaN times 0 must
    still be NaN). ``a_layout`` and ``b_layout`` say how the operands are stored: ``row_major``
    (contiguous), or ``a`` ``column_major`` (a transposed copy's view: strides ``(1, M)``) and ``b``
    ``transposed_weight`` (``weight.t()`` of an ``(N, K)`` weight, as a linear layer passes it)."""

    m: int
    n: int
    k: int
    out_dtype: str = "float32"
    a_bytes: tuple = ()
    b_bytes: tuple = ()
    a_style: str = "normal"
    b_style: str = "normal"
    seed: int = 0
    zero_nan_blocks: bool = False
    a_layout: str = "row_major"
    b_layout: str = "row_major"

    def __post_init__(self):
        if self.a_layout not in A_LAYOUTS or self.b_layout not in B_LAYOUTS:
            raise ValueError(f"layouts {self.a_layout!r}, {self.b_layout!r}: a is one of {A_LAYOUTS}, b one of {B_LAYOUTS}")
        blocks = self.k // BLOCK
        if len(self.a_bytes) != self.m * blocks or len(self.b_bytes) != self.n * blocks:
            raise ValueError(f"need {self.m * blocks} a_bytes and {self.n * blocks} b_bytes, got {len(self.a_bytes)} and {len(self.b_bytes)}")

    @property
    def torch_out_dtype(self):
        import torch

        return getattr(torch, self.out_dtype)

    def scales(self):
        """``(a_scale, b_scale)``: ``uint8`` tensors of shape (M, K/32) and (N, K/32)."""
        import torch

        blocks = self.k // BLOCK
        a_scale = torch.tensor(self.a_bytes, dtype=torch.int32).reshape(self.m, blocks).to(torch.uint8)
        b_scale = torch.tensor(self.b_bytes, dtype=torch.int32).reshape(self.n, blocks).to(torch.uint8)
        return a_scale, b_scale

    def build(self):
        """``(a, b, a_scale, b_scale)`` on CPU; ``b`` is (K, N)."""
        import torch

        generator = torch.Generator().manual_seed(self.seed)
        a_scale, b_scale = self.scales()
        threshold = element_threshold(self.out_dtype, self.k)
        a = _elements(self.a_style, (self.m, self.k), generator)
        b_t = _elements(self.b_style, (self.n, self.k), generator)  # b^T: rows are b's columns
        a = _fit_elements(a, a_scale, threshold, self.zero_nan_blocks)
        b_t = _fit_elements(b_t, b_scale, threshold, self.zero_nan_blocks)
        if self.a_layout == "column_major":
            a = a.t().contiguous().t()
        b = b_t.t() if self.b_layout == "transposed_weight" else b_t.t().contiguous()
        return a, b, a_scale, b_scale

    def to_python(self, call: str = "") -> str:
        text = "import torch\nfrom conformance.draw.e8m0 import *\n" f"case = {self!r}\na, b, a_scale, b_scale = case.build()\n"
        return text + (call + "\n" if call else "")


def _elements(style: str, shape, generator):
    import torch

    if style not in ELEMENT_STYLES:
        raise ValueError(f"unknown element style {style!r}; known: {ELEMENT_STYLES}")
    sign = torch.where(torch.rand(shape, generator=generator) < 0.5, -1.0, 1.0)
    normal = (torch.randn(shape, generator=generator) * 96.0).clamp(-448.0, 448.0)
    saturating = sign * (448.0 - 64.0 * torch.rand(shape, generator=generator))
    tiny = sign * torch.exp2(-9.0 + 3.0 * torch.rand(shape, generator=generator))
    if style == "normal":
        return normal
    if style == "saturating":
        return saturating
    if style == "tiny":
        return tiny
    choice = torch.randint(0, 4, (1, *shape), generator=generator)
    return torch.stack([normal, saturating, tiny, torch.zeros(shape)]).gather(0, choice).squeeze(0)


def _fit_elements(values, scale_u8, threshold: int, zero_nan_blocks: bool):
    """Shrink the blocks whose byte exceeds ``threshold``; cast to e4m3 (round to nearest)."""
    import torch

    rows, k = values.shape
    blocks = values.reshape(rows, k // BLOCK, BLOCK)
    byte = scale_u8.to(torch.int32).unsqueeze(-1)
    shrink = torch.exp2(-(byte - threshold).clamp(min=0).to(torch.float32))
    blocks = blocks * shrink
    if zero_nan_blocks:
        blocks = blocks.masked_fill(byte == NAN_BYTE, 0.0)
    return blocks.reshape(rows, k).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def _dequantize(values, scale_u8):
    """float64 ``values * 2**(byte - 127)`` blockwise along the last dim, NaN for byte 255."""
    import torch

    rows, k = values.shape
    exponent = scale_u8.to(torch.float64) - _BIAS
    factor = torch.exp2(exponent).masked_fill(scale_u8 == NAN_BYTE, math.nan)
    return (values.to(torch.float32).to(torch.float64).reshape(rows, k // BLOCK, BLOCK) * factor.unsqueeze(-1)).reshape(rows, k)


def reference(a, b, a_scale, b_scale, out_dtype):
    """``(expected, tolerance)`` in float64, each (M, N).

    ``expected`` is dequantize-then-matmul computed in float64 from the bytes, NaN exactly where
    the output's row of ``a`` or column of ``b`` has a byte-255 block. ``tolerance`` allows a
    float32 accumulation (``K * eps32`` times the sum of absolute products, plus ``K`` float32
    underflow steps) and one rounding to ``out_dtype`` (its eps relative, its smallest subnormal
    absolute): what any faithful kernel with float32 accumulation stays within.
    """
    import torch

    a_hp = _dequantize(a, a_scale)
    b_t_hp = _dequantize(b.t(), b_scale)
    nan_rows = (a_scale == NAN_BYTE).any(dim=1)
    nan_cols = (b_scale == NAN_BYTE).any(dim=1)
    a_hp, b_t_hp = a_hp.nan_to_num(0.0), b_t_hp.nan_to_num(0.0)
    expected = a_hp @ b_t_hp.t()
    abs_prod = a_hp.abs() @ b_t_hp.abs().t()
    expected[nan_rows, :] = math.nan
    expected[:, nan_cols] = math.nan
    k = a.shape[1]
    f32, out = torch.finfo(torch.float32), torch.finfo(out_dtype)
    tolerance = (
        out.eps * expected.abs().nan_to_num(0.0)
        + k * f32.eps * abs_prod
        + k * f32.smallest_normal * f32.eps
        + out.smallest_normal * out.eps
    )
    return expected, tolerance


@contextlib.contextmanager
def float8_allclose():
    """Let ``torch.allclose`` compare float8 tensors (bit for bit) while the context is open.

    ``torch.library.opcheck``'s schema test checks that inputs were not mutated with
    ``torch.allclose``, which CPU torch does not implement for float8 dtypes; for a mutation check
    equal bytes is the intended meaning. Every other call goes to the original.
    """
    import torch

    original = torch.allclose

    def allclose(lhs, rhs, *args, **kwargs):
        if lhs.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and lhs.dtype == rhs.dtype:
            return torch.equal(lhs.view(torch.uint8), rhs.view(torch.uint8))
        return original(lhs, rhs, *args, **kwargs)

    torch.allclose = allclose
    try:
        yield
    finally:
        torch.allclose = original
