"""What the suite knows of block-scaled matmuls with swizzled scales, without asking the backend.

Two formats reach torch's second scaled-matmul API, ``aten._scaled_mm_v2`` (what ``F.scaled_mm``
lowers to), with their block scales in cuBLAS's ``SWIZZLE_32_4_4`` layout (:data:`FORMATS`):

* **NVFP4** (capability ``nvfp4``): packed ``float4_e2m1fn_x2`` operands (two e2m1 values a byte,
  the first in the low nibble); per operand ``float8_e4m3fn`` scales of blocks of 16 along the
  contraction dim (recipe ``BlockWise1x16``, swizzled) and one float32 global scale
  (``TensorWise``, no swizzle). An element means ``e2m1 * block_scale * global_scale``.
* **MXFP8, swizzled** (capability ``mx``, recipe ``mxfp8_swizzled``): ``float8_e4m3fn`` operands;
  per operand ``float8_e8m0fnu`` scales of blocks of 32 (recipe ``BlockWise1x32``, swizzled). An
  element means ``e4m3 * 2**(byte - 127)``, NaN for byte 255.

``SWIZZLE_32_4_4`` is the ``(rows, k / block)`` scale matrix padded with zeros to whole tiles of
128 rows by 4 scale columns, tiles in row-major order, each 512 contiguous scales; inside a tile,
row ``r = 32 * g + i`` and column ``c`` sit at ``16 * i + 4 * g + c``. The suite reads that layout
itself (:func:`unswizzle`) and so defines, on every device, what such a matmul computes
(:func:`reference_matmul`); only sm100 GPUs have torch's kernels.

* :func:`matmul_format` / :func:`layout_problems`: which format a matmul node of a graph is in,
  and what is wrong with its layout (operand dtypes, recipes, swizzles, scale dtypes and sizes):
  NVF-001, MXS-001.
* :func:`read_by_the_suite`: within it, every such matmul torch dispatches is observed (its
  layout and each operand against the high-precision tensors it came from) and, on a device
  without a kernel, computed by :func:`reference_matmul` (and counted) instead of raising:
  NVF-002 and MXS-002 run a backend's step that way on CPU, and say so in their report rows.
  Asked to (:data:`GROUPED`), it computes the rowwise FP8 grouped GEMMs of either grouped API by
  the suite's reading too (``conformance.draw.moe.reference_grouped_mm``): EMU-006 runs experts so.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses

__all__ = [
    "TILE_ROWS", "TILE_COLS", "Format", "NVFP4", "MXFP8", "FORMATS", "matmul_format", "is_low_precision_matmul",
    "block_scales_numel", "layout_problems", "unswizzle", "unpack_e2m1", "dequantize", "reference_matmul",
    "read_by_the_suite", "Reads", "Operand", "LayoutUnreadable", "GROUPED",
]

#: The swizzled layout's tile: 128 rows by 4 scale columns.
TILE_ROWS, TILE_COLS = 128, 4
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_V2 = "aten._scaled_mm_v2"


@dataclasses.dataclass(frozen=True)
class Format:
    """One block-scaled format as ``F.scaled_mm`` receives it: operand element dtype (``"float4"``
    packed two a byte, or ``"float8_e4m3fn"``), block size, block-scale dtype, scale recipes and
    swizzles per operand (by ``F.ScalingType`` / ``F.SwizzleType`` name) and whether a float32
    global scale follows the block scales."""

    name: str
    element: str
    block: int
    scale_dtype: str
    recipes: tuple[str, ...]
    swizzles: tuple[str, ...]
    global_scale: bool

    @property
    def per_byte(self) -> int:
        """Elements a byte of an operand holds."""
        return 2 if self.element == "float4" else 1

    def codes(self) -> tuple[list[int], list[int]]:
        """The recipe and swizzle lists as the integers a graph records."""
        import torch.nn.functional as F

        return ([int(getattr(F.ScalingType, r).value) for r in self.recipes],
                [int(getattr(F.SwizzleType, s).value) for s in self.swizzles])

    def describe(self) -> str:
        scales = f"{self.scale_dtype} scales of blocks of {self.block}, {self.swizzles[0]}"
        return scales + (", times a float32 global scale" if self.global_scale else "")


NVFP4 = Format("NVFP4", "float4", 16, "float8_e4m3fn", ("BlockWise1x16", "TensorWise"), ("SWIZZLE_32_4_4", "NO_SWIZZLE"), True)
MXFP8 = Format("MXFP8", "float8_e4m3fn", 32, "float8_e8m0fnu", ("BlockWise1x32",), ("SWIZZLE_32_4_4",), False)
FORMATS = (NVFP4, MXFP8)
#: What :func:`read_by_the_suite` calls the rowwise FP8 grouped GEMMs it computes (not a block
#: format: one scale per row or column of each operand, per token group).
GROUPED = "grouped rowwise FP8"


def _is_fp4(dtype) -> bool:
    return dtype is not None and "float4" in str(dtype)


def _is_e8m0(dtype) -> bool:
    return dtype is not None and "e8m0" in str(dtype)


def _is_element(dtype) -> bool:
    """An operand dtype of low-precision compute: packed FP4 or FP8 data (not e8m0 scales)."""
    return _is_fp4(dtype) or (dtype is not None and "float8" in str(dtype) and not _is_e8m0(dtype))


def _val(node):
    return node.meta.get("val") if hasattr(node, "meta") else None


def _dtypes(node) -> tuple[list, object]:
    return [getattr(_val(a), "dtype", None) for a in node.all_input_nodes], getattr(_val(node), "dtype", None)


def is_low_precision_matmul(node) -> bool:
    """Low-precision compute judged by recorded dtypes alone, whatever the op: two or more FP8 or
    packed FP4 tensor inputs and a high-precision floating result."""
    if getattr(node, "op", None) != "call_function":
        return False
    inputs, out = _dtypes(node)
    return (sum(_is_element(d) for d in inputs) >= 2 and out is not None and out.is_floating_point
            and not _is_element(out) and not _is_e8m0(out))


def matmul_format(node) -> Format | None:
    """The format a low-precision matmul node takes its operands in, by dtypes: NVFP4 when an
    input is packed FP4, MXFP8 when one is ``float8_e8m0fnu`` (swizzled or not), else None."""
    if not is_low_precision_matmul(node):
        return None
    inputs, _ = _dtypes(node)
    if any(_is_fp4(d) for d in inputs):
        return NVFP4
    return MXFP8 if any(_is_e8m0(d) for d in inputs) else None


def block_scales_numel(rows: int, k: int, block: int = NVFP4.block) -> int:
    """How many block scales an operand of ``rows`` rows and contraction dim ``k`` (elements) has
    in the swizzled layout: rows padded to 128, ``k / block`` columns padded to 4."""
    cols = -(-k // block)
    return -(-rows // TILE_ROWS) * TILE_ROWS * -(-cols // TILE_COLS) * TILE_COLS


def _bind(op, args, kwargs) -> dict:
    """The arguments of a call of ``op`` (an ``OpOverload``) by their schema names."""
    bound = {}
    for i, argument in enumerate(op._schema.arguments):
        if i < len(args):
            bound[argument.name] = args[i]
        elif argument.name in kwargs:
            bound[argument.name] = kwargs[argument.name]
        elif argument.has_default_value():
            bound[argument.name] = argument.default_value
    return bound


def _scale_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _problems(fmt: Format, a, b, operands) -> list[str]:
    """The layout problems of one call: ``a`` (M, K / per_byte) and ``b`` (K / per_byte, N) values
    (tensors or fake tensors), ``operands`` ``(name, scale values, recipe list, swizzle list)``
    for ``mat_a`` and ``mat_b``."""
    import torch

    recipes, swizzles = fmt.codes()
    if a is None or b is None or a.dim() != 2 or b.dim() != 2:
        return ["its operands record no 2-D value"]
    problems = []
    k = fmt.per_byte * a.shape[1]
    for (name, scales, recipe, swizzle), value, rows in zip(operands, (a, b), (a.shape[0], b.shape[1])):
        if not (_is_fp4(value.dtype) if fmt.element == "float4" else str(value.dtype) == f"torch.{fmt.element}"):
            problems.append(f"{name} is {value.dtype}, not {fmt.element}{' (packed float4_e2m1fn_x2)' * (fmt.per_byte == 2)}")
        if [int(r) for r in recipe] != recipes:
            problems.append(f"{name}'s scale recipes are {list(recipe)}, expected {recipes} ({', '.join(fmt.recipes)})")
        if [int(s) for s in swizzle] != swizzles:
            problems.append(f"{name}'s scale swizzles are {list(swizzle)}, expected {swizzles} ({', '.join(fmt.swizzles)})")
        if len(scales) != len(fmt.recipes):
            expected = "block scales and a global scale" if fmt.global_scale else "block scales"
            problems.append(f"{name} has {len(scales)} scales, expected {len(fmt.recipes)} ({expected})")
            continue
        block = scales[0]
        want = block_scales_numel(rows, k, fmt.block)
        if block is None or str(block.dtype) != f"torch.{fmt.scale_dtype}" or block.numel() != want:
            got = "no recorded value" if block is None else f"{block.dtype} of {block.numel()} elements"
            problems.append(f"{name}'s block scales are {got}; its {rows} rows and contraction dim {k} need "
                            f"{fmt.scale_dtype} of {want} elements (blocks of {fmt.block}, swizzled in 128x4 tiles)")
        if fmt.global_scale:
            glob = scales[1]
            if glob is None or glob.dtype != torch.float32 or glob.numel() != 1:
                got = "no recorded value" if glob is None else f"{glob.dtype} of {glob.numel()} elements"
                problems.append(f"{name}'s global scale is {got}, expected one float32")
    if fmt.per_byte * b.shape[0] != k:
        problems.append(f"the operands' contraction dims differ: {k} and {fmt.per_byte * b.shape[0]}")
    return problems


def layout_problems(node, fmt: Format) -> list[str]:
    """What is wrong with low-precision matmul ``node`` for format ``fmt``, each as a sentence;
    empty when its layout is the declared one: ``aten._scaled_mm_v2`` with both operands of
    ``fmt``'s element dtype, per operand ``fmt``'s recipes and swizzles, block scales of
    ``fmt``'s dtype and :func:`block_scales_numel` elements, and for NVFP4 a one-element float32
    global scale."""
    if not str(node.target).startswith(_V2 + ".") or not hasattr(node.target, "_schema"):
        return [f"a {fmt.name} matmul must be torch's second scaled-matmul API (aten._scaled_mm_v2, F.scaled_mm), "
                f"which names its scales' recipes and layout; this one is {node.target}"]
    kw = _bind(node.target, node.args, node.kwargs)
    operands = [(name, [_val(s) for s in _scale_list(kw[scale])], _scale_list(kw[recipe]), _scale_list(kw[swizzle]))
                for name, scale, recipe, swizzle in (("mat_a", "scale_a", "recipe_a", "swizzle_a"),
                                                     ("mat_b", "scale_b", "recipe_b", "swizzle_b"))]
    return _problems(fmt, _val(kw["self"]), _val(kw["mat2"]), operands)


def unswizzle(scales, rows: int, k: int, block: int = NVFP4.block):
    """The ``(rows, k / block)`` block scales that ``scales`` (float, in the swizzled layout) hold."""
    cols = -(-k // block)
    tile_rows, tile_cols = -(-rows // TILE_ROWS), -(-cols // TILE_COLS)
    flat = scales.reshape(-1)
    # Swizzled order: (tile row, tile col, i, g, c) for row 32 * g + i of the tile, column c.
    tiles = flat.view(tile_rows, tile_cols, 32, 4, TILE_COLS)
    matrix = tiles.permute(0, 3, 2, 1, 4).reshape(tile_rows * TILE_ROWS, tile_cols * TILE_COLS)
    return matrix[:rows, :cols]


def unpack_e2m1(packed):
    """Packed ``(R, C/2)`` FP4 (row-major) as ``(R, C)`` float32 values, low nibble first."""
    import torch

    data = packed.contiguous().view(torch.uint8).to(torch.int64)
    codes = torch.stack((data & 0xF, data >> 4), dim=-1).reshape(packed.shape[0], -1)
    values = torch.tensor(_E2M1, dtype=torch.float32, device=packed.device)[codes & 0x7]
    return torch.where(codes >= 8, -values, values)


def _scale_values(fmt: Format, scales):
    """Block scales as float64: e4m3 values, or e8m0 bytes ``b`` as ``2**(b - 127)`` (NaN for 255)."""
    import torch

    if fmt.scale_dtype == "float8_e8m0fnu":
        data = scales.contiguous().view(torch.uint8).to(torch.float64)
        return torch.where(data == 255, torch.nan, torch.exp2(data - 127))
    return scales.to(torch.float64)


def dequantize(fmt: Format, operand, scales):
    """``(R, C)`` float64 of operand ``(R, C / per_byte)`` (row-major) with its ``scales`` in
    ``fmt``'s declared layout: the swizzled block scales, and for NVFP4 the global scale."""
    import torch

    values = (unpack_e2m1(operand) if fmt.per_byte == 2 else operand.to(torch.float32)).to(torch.float64)
    rows, k = values.shape
    block = unswizzle(_scale_values(fmt, scales[0]), rows, k, fmt.block)
    out = (values.view(rows, k // fmt.block, fmt.block) * block.unsqueeze(-1)).reshape(rows, k)
    return out * scales[1].to(torch.float64).reshape(()) if fmt.global_scale else out


class LayoutUnreadable(ValueError):
    """A block-scaled matmul whose layout is not its format's declared one (:func:`layout_problems`):
    the suite cannot say what it computes."""


def reference_matmul(fmt: Format, a, b, scale_a, scale_b, out_dtype):
    """What ``_scaled_mm_v2(a, b, scale_a, ..., scale_b, ...)`` in format ``fmt`` computes: ``a``
    (M, K / per_byte) and ``b`` (K / per_byte, N), each dequantized with its scales in the
    declared layout, multiplied in float64 and cast to ``out_dtype``."""
    import torch

    for name, scales in (("scale_a", scale_a), ("scale_b", scale_b)):
        count = len(scales) if isinstance(scales, (list, tuple)) else 1
        if count != len(fmt.recipes):
            raise LayoutUnreadable(f"a {fmt.name} matmul with {count} {name} tensor(s), not {fmt.name}'s {len(fmt.recipes)} "
                                   f"({fmt.describe()}): the suite reads only the declared layout")
    lhs = dequantize(fmt, a, _scale_list(scale_a))
    rhs = dequantize(fmt, b.t(), _scale_list(scale_b))
    return torch.mm(lhs, rhs.t()).to(out_dtype or torch.bfloat16)


@dataclasses.dataclass
class Operand:
    """One operand of one block-scaled matmul that ran, as :func:`read_by_the_suite` saw it:
    ``error`` is the relative norm of the difference between the operand dequantized in its
    declared layout and the closest high-precision tensor it was computed from (inf when none has
    its size, or when its layout is not its format's)."""

    format: str
    matmul: int
    name: str
    shape: tuple
    error: float


@dataclasses.dataclass
class Reads:
    """What :func:`read_by_the_suite` saw: how many block-scaled matmuls ran per format, how many
    of them the suite computed, each operand's :class:`Operand`, and the layout problems of each
    call that had any (``(format, index, problems)``)."""

    count: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    computed: int = 0
    operands: list = dataclasses.field(default_factory=list)
    problems: list = dataclasses.field(default_factory=list)


def _closest(values, sources) -> float:
    """The smallest relative error of ``values`` (R, K) against a source tensor of the same
    elements: an ``(R, K)`` (or ``(K, R)``) reading of it, or of its first ``K' < K`` columns
    when the quantizer padded the contraction dim with zeros."""
    import torch

    rows, k = values.shape
    best = float("inf")
    for source in sources:
        candidates = []
        n = source.numel()
        if n == rows * k and source.shape[-1] == k:
            candidates.append((source.reshape(rows, k), values))
        if source.dim() == 2 and tuple(source.shape) == (k, rows):
            candidates.append((source.t(), values))
        if source.dim() >= 1 and n % rows == 0 and 0 < n // rows < k and source.shape[-1] == n // rows:
            candidates.append((source.reshape(rows, n // rows), values[:, : n // rows]))
        for want, got in candidates:
            want = want.to(torch.float64)
            error = ((got.to(torch.float64) - want).norm() / want.norm().clamp_min(1e-30)).item()
            best = min(best, error)
    return best


def _call_format(args, kw) -> Format | None:
    """The format of a dispatched ``_scaled_mm_v2`` call, by its tensors' dtypes."""
    if _is_fp4(args[0].dtype):
        return NVFP4
    scales = _scale_list(kw["scale_a"]) + _scale_list(kw["scale_b"])
    if _is_element(args[0].dtype) and any(_is_e8m0(getattr(s, "dtype", None)) for s in scales):
        return MXFP8
    return None


def _grouped_call(func, kw):
    """A rowwise FP8 grouped GEMM computed by ``conformance.draw.moe.reference_grouped_mm``; a v2 call
    of another scaling raises :class:`LayoutUnreadable`."""
    import torch.nn.functional as F

    from conformance.draw.moe import reference_grouped_mm

    scale_a, scale_b = _scale_list(kw["scale_a"]), _scale_list(kw["scale_b"])
    if "recipe_a" in kw:
        rowwise = [int(F.ScalingType.RowWise.value)]
        if ([int(r) for r in kw["recipe_a"]] != rowwise or [int(r) for r in kw["recipe_b"]] != rowwise
                or list(kw.get("contraction_dim") or ())):
            raise LayoutUnreadable(f"a grouped GEMM of recipes {list(kw['recipe_a'])} / {list(kw['recipe_b'])} and "
                                   f"contraction dims {list(kw.get('contraction_dim') or ())}: the suite reads one RowWise "
                                   "scale per operand and the default contraction dims")
    return reference_grouped_mm(kw["self"], kw["mat2"], scale_a[0], scale_b[0], kw["offs"], kw.get("out_dtype"))


@contextlib.contextmanager
def read_by_the_suite(*, compute: bool | frozenset = True, operands: bool = True):
    """Within: every ``aten._scaled_mm_v2`` call in one of :data:`FORMATS` is observed: its
    layout (:func:`layout_problems`' checks, on the values), and each operand, dequantized in its
    declared layout (:func:`dequantize`), compared with the high-precision tensors it was
    computed from (its ancestors in the ops that ran, tracked at torch's dispatcher). ``compute``
    (True for all, or a set of format names and :data:`GROUPED`) says which calls are computed
    by the suite instead of torch's kernel (for devices without one): block-scaled ones by
    :func:`reference_matmul`, rowwise FP8 grouped GEMMs of either API by
    ``conformance.draw.moe.reference_grouped_mm`` (counted, not observed). ``operands`` False: the
    operands are not compared with their sources, and no op's ancestry is tracked (a step only
    computed, at a fraction of the cost). Every other op runs as torch ships it. The yielded
    :class:`Reads` fills as calls run."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    computed = {fmt.name for fmt in FORMATS} | {GROUPED} if compute is True else set(compute or ())
    reads = Reads()
    v2 = torch.ops.aten._scaled_mm_v2.default
    grouped = {getattr(torch.ops.aten, name).default for name in ("_scaled_grouped_mm", "_scaled_grouped_mm_v2")
               if hasattr(torch.ops.aten, name)}
    high = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    ancestors: dict[int, frozenset] = {}
    kept: dict[int, object] = {}  # every tensor seen, alive for the block, so that ids stay unique

    def sources_of(t) -> list:
        return [kept[i] for i in ancestors.get(id(t), ())]

    def observe(fmt, kw):
        index = reads.count[fmt.name]
        reads.count[fmt.name] += 1
        a, b = kw["self"], kw["mat2"]
        problems = _problems(fmt, a, b, [(name, _scale_list(kw[scale]), _scale_list(kw[recipe]), _scale_list(kw[swizzle]))
                                         for name, scale, recipe, swizzle in (("mat_a", "scale_a", "recipe_a", "swizzle_a"),
                                                                              ("mat_b", "scale_b", "recipe_b", "swizzle_b"))])
        if problems:
            reads.problems.append((fmt.name, index, problems))
            if fmt.name in computed:
                raise LayoutUnreadable(f"its layout is not {fmt.name}'s declared one ({'; '.join(problems)}), and the suite "
                                       "reads only the declared layout")
        if not operands:
            return
        for name, operand, scales, source in (("mat_a", a, kw["scale_a"], a), ("mat_b", b.t(), kw["scale_b"], b)):
            try:
                error = float("inf") if problems else _closest(dequantize(fmt, operand, _scale_list(scales)), sources_of(source))
            except Exception:  # a layout the suite cannot read: the problems name it
                error = float("inf")
            reads.operands.append(Operand(fmt.name, index, name, tuple(operand.shape), error))

    class _Reading(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            fmt = None
            if func is v2:
                kw = _bind(func, args, kwargs)
                fmt = _call_format(args, kw)
            if fmt is not None:
                observe(fmt, kw)
                if fmt.name in computed:
                    reads.computed += 1
                    out = reference_matmul(fmt, kw["self"], kw["mat2"], kw["scale_a"], kw["scale_b"], kw.get("out_dtype"))
                else:
                    out = func(*args, **kwargs)
            elif func in grouped and GROUPED in computed:
                reads.count[GROUPED] += 1
                reads.computed += 1
                out = _grouped_call(func, _bind(func, args, kwargs))
            else:
                out = func(*args, **kwargs)
            if not operands:
                return out
            inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            found = set()
            for t in inputs:
                kept.setdefault(id(t), t)
                found |= ancestors.get(id(t), frozenset())
                if t.dtype in high and t.dim() >= 1:
                    found.add(id(t))
            frozen = frozenset(found)
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    kept.setdefault(id(t), t)
                    ancestors[id(t)] = frozen
            return out

    with _Reading():
        yield reads
