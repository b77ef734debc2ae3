"""What the suite knows of NVFP4 matmuls, without asking the backend (capability ``nvfp4``).

An NVFP4 matmul is a call of torch's second scaled-matmul API, ``aten._scaled_mm_v2`` (what
``F.scaled_mm`` lowers to), on packed ``float4_e2m1fn_x2`` operands (two e2m1 values a byte, the
first in the low nibble). Each operand has two scales: ``float8_e4m3fn`` scales of blocks of 16
elements along the contraction dim (recipe ``BlockWise1x16``) in the ``SWIZZLE_32_4_4`` layout,
and one float32 global scale (``TensorWise``, no swizzle). An element means ``e2m1 * block_scale
* global_scale``.

``SWIZZLE_32_4_4`` is cuBLAS's block-scaling layout: the ``(rows, k / 16)`` scale matrix padded
with zeros to whole tiles of 128 rows by 4 scale columns, tiles in row-major order, each 512
contiguous scales; inside a tile, row ``r = 32 * g + i`` and column ``c`` sit at ``16 * i + 4 * g
+ c``. The suite reads that layout itself (:func:`unswizzle`) and so defines, on every device, what
an NVFP4 matmul computes (:func:`reference_matmul`); only sm100 GPUs have torch's kernel.

* :func:`layout_problems`: what is wrong with the layout of one NVFP4 matmul node of a graph
  (operand dtypes, recipes, swizzles, scale dtypes and sizes): NVF-001.
* :func:`read_by_the_suite`: within it, every NVFP4 matmul that torch dispatches on a device
  without a kernel is computed by :func:`reference_matmul` (and counted) instead of raising:
  NVF-002 runs a backend's step that way on CPU, and says so in its report row.
"""

from __future__ import annotations

import contextlib
import dataclasses

__all__ = [
    "BLOCK", "TILE_ROWS", "TILE_COLS", "is_nvfp4_matmul", "block_scales_numel", "layout_problems", "unswizzle",
    "unpack_e2m1", "dequantize", "reference_matmul", "read_by_the_suite", "Reads", "Operand", "LayoutUnreadable",
]

#: Elements per block scale along the contraction dim.
BLOCK = 16
#: The swizzled layout's tile: 128 rows by 4 scale columns.
TILE_ROWS, TILE_COLS = 128, 4
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_V2 = "aten._scaled_mm_v2"


def _is_fp4(dtype) -> bool:
    return dtype is not None and "float4" in str(dtype)


def _val(node):
    return node.meta.get("val") if hasattr(node, "meta") else None


def is_nvfp4_matmul(node) -> bool:
    """Low-precision compute on packed FP4, judged by recorded dtypes alone, whatever the op: two
    or more tensor inputs, one of them packed FP4, and a high-precision floating result."""
    if getattr(node, "op", None) != "call_function":
        return False
    inputs = [getattr(_val(a), "dtype", None) for a in node.all_input_nodes]
    out = getattr(_val(node), "dtype", None)
    return (len(inputs) >= 2 and any(_is_fp4(d) for d in inputs) and out is not None and out.is_floating_point
            and not _is_fp4(out) and "float8" not in str(out))


def block_scales_numel(rows: int, k: int) -> int:
    """How many block scales an operand of ``rows`` rows and contraction dim ``k`` (elements) has
    in the swizzled layout: rows padded to 128, ``k / 16`` columns padded to 4."""
    cols = -(-k // BLOCK)
    return -(-rows // TILE_ROWS) * TILE_ROWS * -(-cols // TILE_COLS) * TILE_COLS


@dataclasses.dataclass(frozen=True)
class _Args:
    a: object
    b: object
    scale_a: list
    recipe_a: list
    swizzle_a: list
    scale_b: list
    recipe_b: list
    swizzle_b: list


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


def _arguments(node) -> _Args | None:
    if not str(node.target).startswith(_V2 + ".") or not hasattr(node.target, "_schema"):
        return None
    kw = _bind(node.target, node.args, node.kwargs)
    return _Args(kw["self"], kw["mat2"], list(kw["scale_a"]), list(kw["recipe_a"]), list(kw["swizzle_a"]),
                 list(kw["scale_b"]), list(kw["recipe_b"]), list(kw["swizzle_b"]))


def _expected_codes() -> tuple[list[int], list[int]]:
    import torch.nn.functional as F

    recipes = [int(F.ScalingType.BlockWise1x16.value), int(F.ScalingType.TensorWise.value)]
    swizzles = [int(F.SwizzleType.SWIZZLE_32_4_4.value), int(F.SwizzleType.NO_SWIZZLE.value)]
    return recipes, swizzles


def layout_problems(node) -> list[str]:
    """What is wrong with NVFP4 matmul ``node`` (:func:`is_nvfp4_matmul`), each as a sentence;
    empty when its layout is the declared one: ``aten._scaled_mm_v2`` with both operands packed
    FP4, per operand recipes ``[BlockWise1x16, TensorWise]`` and swizzles ``[SWIZZLE_32_4_4,
    NO_SWIZZLE]``, block scales ``float8_e4m3fn`` of :func:`block_scales_numel` elements and a
    one-element float32 global scale."""
    import torch

    args = _arguments(node)
    if args is None:
        return [f"an FP4 matmul must be torch's second scaled-matmul API (aten._scaled_mm_v2, F.scaled_mm), "
                f"which names its scales' recipes and layout; this one is {node.target}"]
    recipes, swizzles = _expected_codes()
    a, b = _val(args.a), _val(args.b)
    problems = []
    if a is None or b is None or a.dim() != 2 or b.dim() != 2:
        return ["its operands record no 2-D node.meta['val']"]
    # a (M, K/2) packed row-major; b (K/2, N) packed, a column-major view of (N, K/2).
    k = 2 * a.shape[1]
    operands = (("mat_a", a, a.shape[0], args.scale_a, args.recipe_a, args.swizzle_a),
                ("mat_b", b, b.shape[1], args.scale_b, args.recipe_b, args.swizzle_b))
    for name, value, rows, scales, recipe, swizzle in operands:
        if not _is_fp4(value.dtype):
            problems.append(f"{name} is {value.dtype}, not packed float4_e2m1fn_x2")
        if [int(r) for r in recipe] != recipes:
            problems.append(f"{name}'s scale recipes are {list(recipe)}, expected {recipes} (BlockWise1x16, TensorWise)")
        if [int(s) for s in swizzle] != swizzles:
            problems.append(f"{name}'s scale swizzles are {list(swizzle)}, expected {swizzles} (SWIZZLE_32_4_4, NO_SWIZZLE)")
        if len(scales) != 2:
            problems.append(f"{name} has {len(scales)} scales, expected 2 (block scales and a global scale)")
            continue
        block, glob = _val(scales[0]), _val(scales[1])
        want = block_scales_numel(rows, k)
        if block is None or block.dtype != torch.float8_e4m3fn or block.numel() != want:
            got = "no recorded value" if block is None else f"{block.dtype} of {block.numel()} elements"
            problems.append(f"{name}'s block scales are {got}; its {rows} rows and contraction dim {k} need "
                            f"float8_e4m3fn of {want} elements (blocks of 16, swizzled in 128x4 tiles)")
        if glob is None or glob.dtype != torch.float32 or glob.numel() != 1:
            got = "no recorded value" if glob is None else f"{glob.dtype} of {glob.numel()} elements"
            problems.append(f"{name}'s global scale is {got}, expected one float32")
    if 2 * b.shape[0] != k:
        problems.append(f"the operands' contraction dims differ: {k} and {2 * b.shape[0]}")
    return problems


def unswizzle(scales, rows: int, k: int):
    """The ``(rows, k / 16)`` block scales (float32) that ``scales``, in the swizzled layout, hold."""
    import torch

    cols = -(-k // BLOCK)
    tile_rows, tile_cols = -(-rows // TILE_ROWS), -(-cols // TILE_COLS)
    flat = scales.reshape(-1).to(torch.float32)
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


def dequantize(packed, block_scales, global_scale):
    """``(R, C)`` float32 of packed ``(R, C/2)`` FP4 with its swizzled block scales and global scale."""
    values = unpack_e2m1(packed)
    rows, k = values.shape
    scales = unswizzle(block_scales, rows, k)
    return (values.view(rows, k // BLOCK, BLOCK) * scales.unsqueeze(-1)).reshape(rows, k) * global_scale.float().reshape(())


class LayoutUnreadable(ValueError):
    """An FP4 matmul whose scales are not NVFP4's two (block and global): the suite cannot say what
    it computes."""


def reference_matmul(a, b, scale_a, scale_b, out_dtype):
    """What an NVFP4 ``_scaled_mm_v2(a, b, scale_a, ..., scale_b, ...)`` computes: ``a`` (M, K/2) and
    ``b`` (K/2, N) packed, each dequantized with its ``[block scales, global scale]``, multiplied
    in float32 and cast to ``out_dtype``."""
    import torch

    for name, scales in (("scale_a", scale_a), ("scale_b", scale_b)):
        if not isinstance(scales, (list, tuple)) or len(scales) != 2:
            count = len(scales) if isinstance(scales, (list, tuple)) else 1
            raise LayoutUnreadable(f"an FP4 matmul with {count} {name} tensor(s), not NVFP4's two (block scales and a "
                                   "global scale): the suite reads only the declared layout")
    lhs = dequantize(a, scale_a[0], scale_a[1])
    rhs = dequantize(b.t(), scale_b[0], scale_b[1])
    return torch.mm(lhs, rhs.t()).to(out_dtype or torch.bfloat16)


@dataclasses.dataclass
class Operand:
    """One operand of one NVFP4 matmul that ran, as :func:`read_by_the_suite` saw it: ``error`` is
    the relative norm of the difference between the operand dequantized in its declared layout
    and the closest high-precision tensor it was computed from (inf when none has its size)."""

    matmul: int
    name: str
    shape: tuple
    error: float


@dataclasses.dataclass
class Reads:
    """What :func:`read_by_the_suite` saw: how many NVFP4 matmuls ran, how many of them the suite
    computed, and each operand's :class:`Operand`."""

    count: int = 0
    computed: int = 0
    operands: list = dataclasses.field(default_factory=list)


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


@contextlib.contextmanager
def read_by_the_suite(*, compute: bool = True):
    """Within: every ``aten._scaled_mm_v2`` call on packed FP4 operands is observed: each operand,
    dequantized in its declared layout (:func:`dequantize`), is compared with the high-precision
    tensors it was computed from (its ancestors in the ops that ran, tracked at torch's
    dispatcher), and with ``compute`` the call is computed by :func:`reference_matmul` instead
    of torch's kernel (for devices without one). Every other op runs as torch ships it. The
    yielded :class:`Reads` fills as calls run."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    reads = Reads()
    v2 = torch.ops.aten._scaled_mm_v2.default
    high = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    ancestors: dict[int, frozenset] = {}
    kept: dict[int, object] = {}  # every tensor seen, alive for the block, so that ids stay unique

    def sources_of(t) -> list:
        return [kept[i] for i in ancestors.get(id(t), ())]

    class _Reading(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is v2 and _is_fp4(args[0].dtype):
                kw = _bind(func, args, kwargs)
                index = reads.count
                reads.count += 1
                a, b = kw["self"], kw["mat2"]
                for name, packed, scales in (("mat_a", a, kw["scale_a"]), ("mat_b", b.t(), kw["scale_b"])):
                    try:
                        values = dequantize(packed, scales[0], scales[1])
                        error = _closest(values, sources_of(a if name == "mat_a" else b))
                    except Exception:  # a layout the suite cannot read: NVF-001 names it
                        error = float("inf")
                    reads.operands.append(Operand(index, name, tuple(packed.shape), error))
                if compute:
                    reads.computed += 1
                    out = reference_matmul(a, b, kw["scale_a"], kw["scale_b"], kw.get("out_dtype"))
                else:
                    out = func(*args, **kwargs)
            else:
                out = func(*args, **kwargs)
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
