"""What a scaled matmul requires of its scales: dtype, shape and layout, per scaling.

torch checks a scaled matmul's scales in the op's Meta kernel, when a graph is traced or
compiled, and in its kernel, when it runs. A graph changed after tracing (a rewrite that swapped
the two operands' scales, cast one to float16 or left a list of scales empty) passes every other
rule of validation and then fails in Inductor or at run time with torch's own ``ValueError`` or
``RuntimeError``, which names no module. :func:`scale_problems` applies torch's rules to the
graph's ``node.meta["val"]`` before anything compiles: those of its Meta kernels
(``torch/_meta_registrations.py``: ``_check_scaled_mm_sizes``, ``_check_scaled_mm_sizes_v2``,
``_meta_grouped_mm_common``) and no stricter ones, so every graph torch takes passes:

* ``aten._scaled_mm``: the scales say their scaling. One element each: tensorwise, float32.
  Both ``float8_e8m0fnu`` (MX, a scale per 32 elements along K) or both ``float8_e4m3fn``
  (NVFP4, per 16): block-scaled, as many elements as the swizzled layout holds (rows padded to
  128, blocks along K to 4), contiguous. Anything else float32 and 2-D: rowwise ``(M, 1)`` and
  ``(1, N)``, contiguous, or one of the 1x128 / 128x128 block layouts;
* ``aten._scaled_mm_v2``: each operand's list of scales as long as its list of ScalingTypes
  (torch's kernels take no other), each scale what its ScalingType and swizzle take:
  TensorWise one float32 element; RowWise float32, ``(M, 1)`` and N elements, unit stride along
  dim 1; BlockWise1x32 (MX) and BlockWise1x16 (NVFP4, with a TensorWise float32 global scale)
  the swizzled layout's number of ``float8_e8m0fnu`` / ``float8_e4m3fn`` elements and swizzle
  ``SWIZZLE_32_4_4``; the 1x128 / 128x128 pairs their float32 shapes and strides;
* ``aten._scaled_grouped_mm``: both float32 (rowwise) or both ``float8_e8m0fnu`` (MXFP8), per
  group: a 2-D operand's scale contiguous, 1-D, one per row (times the groups where both
  operands are 2-D); a 3-D operand's one row per group, unit stride along its last dim;
* ``aten._scaled_grouped_mm_v2``: the list lengths, and RowWise scales as the first API's
  float32 ones (the rule its CUDA kernel applies; torch ships no Meta kernel for it up to 2.14);
* ``fp8conf.scaled_mm_e8m0``: the op's own checks, ``uint8`` or ``float8_e8m0fnu`` bytes of
  shapes ``(M, K / 32)`` and ``(N, K / 32)`` on the first operand's device.

What these rules do not cover is not checked, and the ``fp8conf`` logger says so once per op:
the ops a trainer declared (:func:`~fp8conf.graph.roles.register_compute_op`), grouped
second-API scalings other than RowWise, symbolic sizes, devices torch checks nothing on. A
scale that records no ``node.meta["val"]`` is a problem of its own, as an operand without one is.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx

# The finding type is the contract's own: a report fp8conf makes is what a backend returns.
from fp8contract.types import Finding
from fp8conf.graph.provenance import get_provenance, node_passes
from fp8conf.graph.roles import is_fp8_compute, matrix_operands
from fp8conf.log import warn_once

__all__ = ["SCALE_PROPERTY_ID", "scale_problems", "scale_findings"]

#: The property ID of a scale finding: a rule of fp8conf's own, not one of the conformance spec.
SCALE_PROPERTY_ID = "VAL-SCALE"

# torch.nn.functional.ScalingType and SwizzleType as the second API's calls hold them (ints).
_TENSORWISE, _ROWWISE, _BLOCK_1X16, _BLOCK_1X32, _BLOCK_1X128, _BLOCK_128X128 = range(6)
_SCALING_NAMES = ("TensorWise", "RowWise", "BlockWise1x16", "BlockWise1x32", "BlockWise1x128", "BlockWise128x128")
_NO_SWIZZLE, _SWIZZLE_32_4_4 = 0, 1
_SWIZZLE_NAMES = ("NO_SWIZZLE", "SWIZZLE_32_4_4")

_F32 = torch.float32
_E4M3 = torch.float8_e4m3fn
_E8M0 = getattr(torch, "float8_e8m0fnu", None)
_FP4 = getattr(torch, "float4_e2m1fn_x2", None)
# The devices whose scales torch's Meta kernels check (its device_hint takes "meta" for "cuda").
_CHECKED_DEVICES = frozenset({"cuda", "xpu", "cpu", "meta"})
# fp8conf::scaled_mm_e8m0's block: one scale byte per 32 elements along K.
_E8M0_OP_BLOCK = 32


@dataclasses.dataclass(frozen=True)
class _Scale:
    """One scale of a call: how a message names it (``scale_a[0] 'reciprocal_2'``) and its value."""

    label: str
    val: torch.Tensor


@dataclasses.dataclass(frozen=True)
class _Call:
    """A scaled matmul's two matrix operands and its arguments by schema name, every scale a
    :class:`_Scale` (a list of them for the second API)."""

    a: torch.Tensor
    b: torch.Tensor
    args: dict

    def scales(self) -> list[_Scale]:
        found = [v for v in self.args.values() if isinstance(v, _Scale)]
        return found + [s for v in self.args.values() if isinstance(v, list) for s in v if isinstance(s, _Scale)]

    def exchanged(self, first: str, second: str) -> _Call:
        return dataclasses.replace(self, args={**self.args, first: self.args[second], second: self.args[first]})


def _ceil_div(a, b):
    return (a + b - 1) // b


def _round_up(x, y):
    # torch's own helper, float arguments (K / 128) included.
    return ((x + y - 1) // y) * y


def _size(t: torch.Tensor, dim: int):
    return t.shape[dim] if -t.dim() <= dim < t.dim() else None


def _stride(t: torch.Tensor, dim: int):
    return t.stride(dim) if -t.dim() <= dim < t.dim() else None


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _names(recipes) -> str:
    return "[" + ", ".join(_SCALING_NAMES[r] if 0 <= r < len(_SCALING_NAMES) else str(r) for r in recipes) + "]"


def _judge(scale: _Scale, wants) -> list[str]:
    """One problem line for ``scale`` naming what its scaling takes that it is not, from
    ``(ok, what it takes)`` pairs; none when every one holds."""
    missed = [want for ok, want in wants if not ok]
    if not missed:
        return []
    seen = f"{_dtype_name(scale.val.dtype)} {tuple(scale.val.shape)}"
    return [f"{scale.label} is {seen}; its scaling takes {', '.join(missed)}"]


def _contiguous(t: torch.Tensor) -> tuple[bool, str]:
    return t.is_contiguous(), f"a contiguous tensor (strides {tuple(t.stride())})"


def _unit_stride(t: torch.Tensor, dim: int) -> tuple[bool, str]:
    return _stride(t, dim) == 1, f"unit stride along dim {dim} (strides {tuple(t.stride())})"


def _float32(t: torch.Tensor) -> tuple[bool, str]:
    return t.dtype == _F32, "float32"


# --- aten._scaled_mm: the scaling told by the scales (_check_scaled_mm_sizes) ---------------------


def _first_api(call: _Call) -> list[str]:
    a, b, sa, sb = call.a, call.b, call.args["scale_a"], call.args["scale_b"]
    if a.dim() != 2 or b.dim() != 2:
        return []  # torch refuses the operands, before any scale
    m, k, n = a.shape[0], a.shape[1], b.shape[1]
    if sa.val.numel() == 1 and sb.val.numel() == 1:
        return _judge(sa, [_float32(sa.val)]) + _judge(sb, [_float32(sb.val)])
    if sa.val.dtype == sb.val.dtype and sa.val.dtype in (_E8M0, _E4M3):
        return _first_api_blocks(a, m, k, n, sa, sb)
    problems = [p for s in (sa, sb) for p in _judge(s, [_float32(s.val), (s.val.dim() == 2, "2 dims")])]
    if sa.val.dim() != 2 or sb.val.dim() != 2:
        return problems
    shapes = (tuple(sa.val.shape), tuple(sb.val.shape))
    if shapes == ((m, 1), (1, n)):
        return problems + _judge(sa, [_contiguous(sa.val)]) + _judge(sb, [_contiguous(sb.val)])
    kb = _ceil_div(k, 128)
    if shapes in (((m, kb), (kb, _ceil_div(n, 128))), ((m, kb), (kb, n)), ((_ceil_div(m, 128), kb), (kb, n))):
        return problems
    return problems + [
        f"{sa.label} {shapes[0]} and {sb.label} {shapes[1]} fit no scaling of a ({m}, {k}) x ({k}, {n}) matmul: "
        f"tensorwise takes one element each, rowwise ({m}, 1) and (1, {n}), 1x128 blocks ({m}, {kb}) with ({kb}, {n}) "
        f"or ({kb}, {_ceil_div(n, 128)}), 128x128 blocks ({_ceil_div(m, 128)}, {kb}) with ({kb}, {n})"
    ]


def _first_api_blocks(a, m, k, n, sa: _Scale, sb: _Scale) -> list[str]:
    nvfp4 = sa.val.dtype == _E4M3
    block = 16 if nvfp4 else 32
    k_elements = k * 2 if nvfp4 or a.dtype == _FP4 else k  # FP4 packs two elements a byte
    k_blocks = _round_up(_ceil_div(k_elements, block), 4)
    want_a, want_b = 128 * _ceil_div(m, 128) * k_blocks, 128 * _ceil_div(n, 128) * k_blocks
    if sa.val.numel() == want_a and sb.val.numel() == want_b:
        return _judge(sa, [_contiguous(sa.val)]) + _judge(sb, [_contiguous(sb.val)])
    layout = f"1x{block} {_dtype_name(sa.val.dtype)} blocks in the swizzled layout (rows padded to 128, blocks along K to 4)"
    return (_judge(sa, [(sa.val.numel() == want_a, f"{want_a} elements: {layout}")])
            + _judge(sb, [(sb.val.numel() == want_b, f"{want_b} elements: {layout}")]))


# --- aten._scaled_mm_v2: each scale what its declared ScalingType takes (_check_scaled_mm_sizes_v2)


def _list_lengths(call: _Call) -> list[str]:
    problems = []
    for side in ("a", "b"):
        scales, recipes = call.args[f"scale_{side}"], [int(r) for r in call.args[f"recipe_{side}"]]
        if len(scales) != len(recipes):
            held = f"holds {len(scales)} scale(s) ({', '.join(s.label for s in scales)})" if scales else "is an empty list"
            problems.append(f"scale_{side} {held}, but recipe_{side} {_names(recipes)} takes {len(recipes)}")
    return problems


def _second_api(call: _Call) -> list[str]:
    a, b = call.a, call.b
    if a.dim() != 2 or b.dim() != 2:
        return []  # torch refuses the operands, before any scale
    problems = _list_lengths(call)
    if problems:
        return problems
    recipes = (tuple(int(r) for r in call.args["recipe_a"]), tuple(int(r) for r in call.args["recipe_b"]))
    rule = _SECOND_API_RULES.get(recipes)
    if rule is None:
        return [
            f"recipe_a {_names(recipes[0])} and recipe_b {_names(recipes[1])} name no scaling torch's scaled matmul takes: "
            "both TensorWise, both RowWise, both BlockWise1x32 (MX), both BlockWise1x16 (NVFP4, or with a TensorWise "
            "global scale each), or the 1x128 / 128x128 block pairs"
        ]
    k = a.shape[1] * (2 if a.dtype == _FP4 and b.dtype == _FP4 else 1)
    return rule(call, a.shape[0], k, b.shape[1])


def _tensorwise(call: _Call, m, k, n) -> list[str]:
    scales = (call.args["scale_a"][0], call.args["scale_b"][0])
    return [p for s in scales for p in _judge(s, [(s.val.numel() == 1, "one element"), _float32(s.val)])]


def _rowwise(call: _Call, m, k, n) -> list[str]:
    sa, sb = call.args["scale_a"][0], call.args["scale_b"][0]
    a_shape = _size(sa.val, 0) == m and _size(sa.val, 1) == 1 and sa.val.numel() == m
    b_numel = (sb.val.numel() == n, f"{n} elements, one per column of b: (1, {n})")
    return (_judge(sa, [(a_shape, f"shape ({m}, 1)"), _float32(sa.val), _unit_stride(sa.val, 1)])
            + _judge(sb, [b_numel, _float32(sb.val), _unit_stride(sb.val, 1)]))


def _block_128(scale: _Scale, rows, cols, lead) -> list[str]:
    v = scale.val
    shape_ok = _size(v, 0) == rows and _size(v, 1) == cols
    strides_ok = _stride(v, 0) == 1 and (_stride(v, 1) == lead or (_size(v, 1) == 1 and _stride(v, 1) == 1))
    return _judge(scale, [_float32(v), (shape_ok, f"shape ({int(rows)}, {int(cols)})"),
                          (strides_ok, f"strides (1, {int(lead)}), column-major (strides {tuple(v.stride())})")])


def _blocks_1x128_1x128(call: _Call, m, k, n) -> list[str]:
    return _block_128(call.args["scale_a"][0], m, k // 128, m) + _block_128(call.args["scale_b"][0], n, k // 128, n)


def _blocks_128x128_1x128(call: _Call, m, k, n) -> list[str]:
    l4 = _round_up(k / 128, 4)
    return _block_128(call.args["scale_a"][0], l4, m // 128, l4) + _block_128(call.args["scale_b"][0], n, k // 128, n)


def _blocks_1x128_128x128(call: _Call, m, k, n) -> list[str]:
    l4 = _round_up(k / 128, 4)
    return _block_128(call.args["scale_a"][0], m, k // 128, m) + _block_128(call.args["scale_b"][0], l4, n // 128, l4)


def _block_scaled(call: _Call, wants: tuple[int, int], dtype, swizzle: int, what: str) -> list[str]:
    problems = []
    for side, want in zip(("a", "b"), wants):
        scale = call.args[f"scale_{side}"][0]
        layout = f"{want} elements ({what} in the {_SWIZZLE_NAMES[swizzle]} layout)"
        problems += _judge(scale, [(scale.val.numel() == want, layout), (scale.val.dtype == dtype, _dtype_name(dtype))])
        declared = [int(s) for s in call.args[f"swizzle_{side}"]] or [_NO_SWIZZLE]
        if declared[0] != swizzle:
            name = _SWIZZLE_NAMES[declared[0]] if declared[0] in (0, 1) else str(declared[0])
            problems.append(f"swizzle_{side} declares {name}; {what} scaling takes {_SWIZZLE_NAMES[swizzle]}")
    return problems


def _mx(call: _Call, m, k, n) -> list[str]:
    rows, cols = call.a.shape  # torch counts the packed K here
    if torch.version.hip:
        wants = (_ceil_div(rows, 32) * cols, _ceil_div(cols, 32) * rows)
        return _block_scaled(call, wants, _E8M0, _NO_SWIZZLE, "MX BlockWise1x32")
    k_blocks = _round_up(_ceil_div(cols, 32), 4)
    wants = (_round_up(rows, 128) * k_blocks, _round_up(call.b.shape[1], 128) * k_blocks)
    return _block_scaled(call, wants, _E8M0, _SWIZZLE_32_4_4, "MX BlockWise1x32")


def _nvfp4(call: _Call, m, k, n) -> list[str]:
    k_blocks = _round_up(_ceil_div(k, 16), 4)
    wants = (_round_up(m, 128) * k_blocks, _round_up(n, 128) * k_blocks)
    problems = _block_scaled(call, wants, _E4M3, _SWIZZLE_32_4_4, "NVFP4 BlockWise1x16")
    for side in ("a", "b"):
        if len(call.args[f"scale_{side}"]) > 1:
            scale = call.args[f"scale_{side}"][1]
            problems += _judge(scale, [(scale.val.numel() == 1, "one element (the global scale)"), _float32(scale.val)])
    return problems


_SECOND_API_RULES = {
    ((_TENSORWISE,), (_TENSORWISE,)): _tensorwise,
    ((_ROWWISE,), (_ROWWISE,)): _rowwise,
    ((_BLOCK_1X128,), (_BLOCK_1X128,)): _blocks_1x128_1x128,
    ((_BLOCK_128X128,), (_BLOCK_1X128,)): _blocks_128x128_1x128,
    ((_BLOCK_1X128,), (_BLOCK_128X128,)): _blocks_1x128_128x128,
    ((_BLOCK_1X32,), (_BLOCK_1X32,)): _mx,
    ((_BLOCK_1X16,), (_BLOCK_1X16,)): _nvfp4,
    ((_BLOCK_1X16, _TENSORWISE), (_BLOCK_1X16, _TENSORWISE)): _nvfp4,
}


# --- grouped: per group (_meta_grouped_mm_common) -------------------------------------------------


def _grouped(call: _Call) -> list[str] | None:
    a, b, sa, sb = call.a, call.b, call.args["scale_a"], call.args["scale_b"]
    if a.dim() not in (2, 3) or b.dim() not in (2, 3):
        return []  # torch refuses the operands, before any scale
    dtypes = (sa.val.dtype, sb.val.dtype)
    if dtypes not in ((_F32, _F32), (_E8M0, _E8M0)):
        return [
            f"{sa.label} is {_dtype_name(dtypes[0])} and {sb.label} {_dtype_name(dtypes[1])}; grouped scales are both "
            "float32 (rowwise) or both float8_e8m0fnu (MXFP8)"
        ]
    offs = call.args.get("offs")
    if isinstance(offs, torch.fx.Node):
        offs = offs.meta.get("val")
        if offs is None:
            return None  # how many groups there are is not recorded
    groups = offs.shape[0] if offs is not None and a.dim() == 2 and b.dim() == 2 else 1
    mx = dtypes[0] == _E8M0
    return _group_scale(sa, a, 0, groups, mx) + _group_scale(sb, b, 1, groups, mx)


def _group_scale(scale: _Scale, mat: torch.Tensor, dim: int, groups: int, mx: bool) -> list[str]:
    v = scale.val
    if mat.dim() == 2:
        if mx:
            return _judge(scale, [_contiguous(v), (v.dim() == 2, "2 dims, as its operand")])
        rows = mat.shape[dim] * groups
        what = f"shape ({rows},): one per {('row', 'column')[dim]} of its operand"
        what += f" in each of {groups} groups" if groups > 1 else ""
        return _judge(scale, [_contiguous(v), (v.dim() == 1 and v.shape[0] == rows, what)])
    wants = [_unit_stride(v, -1), (_size(v, 0) == mat.shape[0], f"{mat.shape[0]} groups along dim 0")]
    if mx:
        g, k, n = mat.shape
        width = _round_up(k / 32, 4) * _round_up(n, 128)
        shape_ok = v.dim() == 2 and _size(v, 0) == g and _size(v, 1) == width
        wants.append((shape_ok, f"shape ({g}, {int(width)}): MXFP8 blocks per group"))
    else:
        shape_ok = v.dim() == 2 and _size(v, 1) == mat.shape[1 + dim]
        wants.append((shape_ok, f"shape ({mat.shape[0]}, {mat.shape[1 + dim]})"))
    return _judge(scale, wants)


def _grouped_second_api(call: _Call) -> list[str] | None:
    problems = _list_lengths(call)
    if problems:
        return problems
    recipes = (tuple(int(r) for r in call.args["recipe_a"]), tuple(int(r) for r in call.args["recipe_b"]))
    if recipes != ((_ROWWISE,), (_ROWWISE,)):
        return None
    sa, sb = call.args["scale_a"][0], call.args["scale_b"][0]
    problems = _judge(sa, [_float32(sa.val)]) + _judge(sb, [_float32(sb.val)])
    return problems or _grouped(dataclasses.replace(call, args={**call.args, "scale_a": sa, "scale_b": sb}))


# --- fp8conf::scaled_mm_e8m0: the op's own checks --------------------------------------------------


def _e8m0_op(call: _Call) -> list[str]:
    a, b = call.a, call.b
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0] or a.shape[1] % _E8M0_OP_BLOCK:
        return []  # the op refuses the operands, before any scale
    k = a.shape[1]
    problems = []
    for name, rows, of in (("a_scale", a.shape[0], "row of a"), ("b_scale", b.shape[1], "column of b")):
        scale, shape = call.args[name], (rows, k // _E8M0_OP_BLOCK)
        problems += _judge(scale, [
            (scale.val.dtype in (torch.uint8, _E8M0), "uint8 or float8_e8m0fnu bytes"),
            (tuple(scale.val.shape) == shape, f"shape {shape}: a byte per 32 elements along K for each {of}"),
            (scale.val.device == a.device, f"device {a.device}, as a"),
        ])
    return problems


# --- the graph ------------------------------------------------------------------------------------

_FIRST = (("scale_a", "scale_b"), _first_api)
_SECOND = (("scale_a", "scale_b"), _second_api)
#: Per op (as ``str(node.target)``): its scale arguments (schema names) and its rule.
_RULES = {
    "aten._scaled_mm.default": _FIRST,
    "aten._scaled_mm.out": _FIRST,
    "aten._scaled_mm_v2.default": _SECOND,
    "aten._scaled_mm_v2.out": _SECOND,
    "aten._scaled_grouped_mm.default": (("scale_a", "scale_b"), _grouped),
    "aten._scaled_grouped_mm_v2.default": (("scale_a", "scale_b"), _grouped_second_api),
    "fp8conf.scaled_mm_e8m0.default": (("a_scale", "b_scale"), _e8m0_op),
}
# The rules whose torch Meta kernel checks only on some devices.
_DEVICE_GATED = frozenset({_first_api, _second_api})


def _bound(node: torch.fx.Node) -> dict:
    """The call's arguments by schema name, defaults filled in."""
    bound = {}
    for i, arg in enumerate(node.target._schema.arguments):
        if i < len(node.args) and not arg.kwarg_only:
            bound[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            bound[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
    return bound


def _scale(label: str, value, unreadable: list[str]) -> _Scale | None:
    if isinstance(value, torch.fx.Node):
        val = value.meta.get("val")
        if isinstance(val, torch.Tensor):
            return _Scale(f"{label} '{value.name}'", val)
        unreadable.append(
            f"{label} '{value.name}' records no node.meta['val'], so its dtype and shape cannot be checked; copy node.meta "
            "onto the nodes a rewrite makes (or run torch.fx.passes.fake_tensor_prop.FakeTensorProp)"
        )
    else:
        unreadable.append(f"{label} is {value!r}, not a tensor")
    return None


def _call(node: torch.fx.Node, names) -> tuple[_Call, list[str]]:
    args, unreadable = _bound(node), []
    for name in names:
        value = args.get(name)
        if isinstance(value, (list, tuple)):
            args[name] = [_scale(f"{name}[{i}]", v, unreadable) for i, v in enumerate(value)]
        else:
            args[name] = _scale(name, value, unreadable)
    a, b = (x.meta["val"] for x in matrix_operands(node))
    return _Call(a, b, args), unreadable


def _concrete(t: torch.Tensor) -> bool:
    return all(isinstance(s, int) for s in (*t.shape, *t.stride()))


def _judged(node: torch.fx.Node) -> tuple[list[str] | None, str]:
    """``(problems, "")``, or ``(None, why not)`` where no rule here judges the node's scales."""
    entry = _RULES.get(str(node.target))
    if entry is None:
        return None, "fp8conf knows no rule for the scales of an op torch or fp8conf did not define (a trainer's own)"
    names, rule = entry
    call, unreadable = _call(node, names)
    if unreadable:
        return unreadable, ""
    if not all(_concrete(t) for t in (call.a, call.b, *(s.val for s in call.scales()))):
        return None, "its sizes are symbolic"
    if rule in _DEVICE_GATED and call.a.device.type not in _CHECKED_DEVICES:
        return None, f"torch checks no scales on {call.a.device.type}"
    problems = rule(call)
    if problems is None:
        return None, "no rule here judges its scaling, or its group count is not recorded"
    if problems and rule(call.exchanged(*names)) == []:
        problems.append(f"with {names[0]} and {names[1]} exchanged they would fit: the two operands' scales are swapped")
    return problems, ""


def scale_problems(node: torch.fx.Node) -> list[str] | None:
    """What is wrong with the scales of the FP8 compute ``node`` (see the module's rules), one
    line per problem naming the scale, what its scaling takes and what it is: ``[]`` when they
    fit, ``None`` when the node is no FP8 compute or no rule here covers its op or scaling."""
    if not is_fp8_compute(node):
        return None
    return _judged(node)[0]


def scale_findings(graph: torch.fx.Graph, passes: dict | None = None) -> list[Finding]:
    """One ``VAL-SCALE`` finding per FP8 compute node of ``graph`` whose scales torch would
    refuse, naming the node, its module (provenance) and pass, and every problem. A node whose
    scales no rule judges is logged once per op."""
    passes = node_passes(graph) if passes is None else passes
    findings = []
    for node in graph.nodes:
        if not is_fp8_compute(node):
            continue
        problems, unchecked = _judged(node)
        if problems is None:
            warn_once("unchecked scales", f"{node.target}: {unchecked}",
                      f"fp8conf validation does not check the scales of {node.target}: {unchecked}")
        elif problems:
            findings.append(_finding(node, passes[node], problems))
    return findings


def _finding(node: torch.fx.Node, pass_name: str, problems: list[str]) -> Finding:
    provenance = get_provenance(node)
    fqn = provenance.module_fqn if provenance is not None else None
    where = f"module '{fqn}', " if fqn is not None else ""
    return Finding(
        SCALE_PROPERTY_ID,
        f"{where}{pass_name} pass, scaled matmul '{node.name}' ({node.target}; {_operands(node)}): "
        f"{'; '.join(problems)}. torch refuses these scales when it compiles or runs the matmul; give each operand "
        "the scales its scaling takes (scale_a scales the first operand, scale_b the second), as its quantization made "
        "them: a rewrite that replaced, cast or reordered them must keep their dtype, shape and layout",
        module_fqn=fqn,
        pass_name=pass_name,
        node_name=node.name,
    )


def _operands(node: torch.fx.Node) -> str:
    """The operands and declared scalings of a call, as its finding names them."""
    a, b = (x.meta["val"] for x in matrix_operands(node))
    text = f"a {_dtype_name(a.dtype)} {tuple(a.shape)}, b {_dtype_name(b.dtype)} {tuple(b.shape)}"
    args = _bound(node)
    for name in ("recipe_a", "recipe_b"):
        if name in args:
            text += f", {name} {_names(int(r) for r in args[name])}"
    return text
