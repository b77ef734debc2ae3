"""Validation checks the scales of every FP8 compute node (``fp8conf.graph.scales``): a graph whose
scales torch would refuse at compile or run time fails validation naming the node, its module
and what is wrong; every graph the repository's families trace passes.

The defect cases edit real traced graphs by hand (a swapped pair of scale lists, a float16 copy
of a scale, an empty list, a wrong-shaped rowwise scale ...). The rules are torch's own: on a grid
of scale shapes, dtypes, layouts and recipes, a call's scales are judged fine exactly when
torch's Meta kernel takes them.
"""

from __future__ import annotations

import functools
import itertools
import warnings

import pytest
import torch
from torch import nn

import fp8conf
from conformance.backends.reference import ReferenceBackend
from conformance.draw.models import LayerSpec, ModelSpec, build_model
from conformance.draw.moe import MoESpec, build_moe_model, v2_grouped_structure
from conformance.draw.strategies import SCALED_MM_KIND, runnable_kinds
from fp8conf.graph.roles import is_fp8_compute
from fp8conf.graph.scales import SCALE_PROPERTY_ID, scale_findings, scale_problems
from fp8conf.quantized.grouped import convert_to_float8_grouped_experts, has_scaled_grouped_mm_v2
from fp8conf.quantized.mx import convert_to_mx_training
from fp8conf.quantized.nvfp4 import convert_to_nvfp4_training, has_nvfp4
from fp8conf.quantized.scaled_mm import convert_to_scaled_mm_training, has_scaled_mm_v2

E4M3 = torch.float8_e4m3fn
E8M0 = torch.float8_e8m0fnu

_needs_v2 = pytest.mark.skipif(SCALED_MM_KIND not in runnable_kinds(), reason=f"torch {torch.__version__} runs no F.scaled_mm on CPU")
_needs_v2_api = pytest.mark.skipif(not has_scaled_mm_v2(), reason=f"torch {torch.__version__} has no F.scaled_mm")
_needs_nvfp4 = pytest.mark.skipif(not has_nvfp4(), reason=f"torch {torch.__version__} has no float4_e2m1fn_x2 or F.scaled_mm")
_needs_grouped_v2 = pytest.mark.skipif(not has_scaled_grouped_mm_v2(), reason=f"torch {torch.__version__} has no F.scaled_grouped_mm")


# --- the traced graphs of every family (each traced once) ----------------------------------------


def _block(dim: int = 64) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(dim, 32), nn.ReLU(), nn.Linear(32, dim, bias=False), nn.Linear(dim, 32))


def _traced_block(convert, rows: int = 8, dim: int = 64) -> torch.fx.GraphModule:
    model = _block(dim)
    convert(model)
    return fp8conf.trace_joint(model, (torch.randn(rows, dim, requires_grad=True),))


def _float8(recipe: str) -> torch.fx.GraphModule:
    spec = ModelSpec(in_features=32, layers=(LayerSpec(32, recipe, bias=True), LayerSpec(32, recipe, calls=2, activation="gelu"),
                                            LayerSpec(16, recipe, activation="none")))
    return fp8conf.trace_joint(*build_model(spec))


def _grouped_experts(model, *, module_filter_fn, recipe, emulate):
    convert_to_float8_grouped_experts(model, recipe=recipe, emulate=emulate, module_filter_fn=module_filter_fn)


def _moe(v2: bool) -> torch.fx.GraphModule:
    if not v2:
        return fp8conf.trace_joint(*build_moe_model(MoESpec(layers=2), convert=_grouped_experts))
    with v2_grouped_structure():
        return fp8conf.trace_joint(*build_moe_model(MoESpec(v2=True), convert=ReferenceBackend().convert_scaled_grouped_experts))


_FAMILIES = {
    "float8-tensorwise": lambda: _float8("tensorwise"),
    "float8-rowwise": lambda: _float8("rowwise"),
    "float8-rowwise_with_gw_hp": lambda: _float8("rowwise_with_gw_hp"),
    "scaled_mm-tensorwise": lambda: _traced_block(lambda m: convert_to_scaled_mm_training(m, recipe="tensorwise")),
    "scaled_mm-rowwise": lambda: _traced_block(lambda m: convert_to_scaled_mm_training(m, recipe="rowwise")),
    "mxfp8": lambda: _traced_block(lambda m: convert_to_mx_training(m, recipe="mxfp8")),
    "mxfp8_swizzled": lambda: _traced_block(lambda m: convert_to_mx_training(m, recipe="mxfp8_swizzled")),
    "mxfp8_swizzled-padded": lambda: _traced_block(lambda m: convert_to_mx_training(m, recipe="mxfp8_swizzled"), 144, 160),
    "nvfp4": lambda: _traced_block(convert_to_nvfp4_training),
    "nvfp4-padded": lambda: _traced_block(convert_to_nvfp4_training, 144, 160),
    "grouped": lambda: _moe(False),
    "grouped-v2": lambda: _moe(True),
}
_MARKS = {"scaled_mm-tensorwise": _needs_v2, "scaled_mm-rowwise": _needs_v2, "mxfp8_swizzled": _needs_v2_api,
          "mxfp8_swizzled-padded": _needs_v2_api, "nvfp4": _needs_nvfp4, "nvfp4-padded": _needs_nvfp4, "grouped-v2": _needs_grouped_v2}


@functools.cache
def _traced(family: str) -> torch.fx.GraphModule:
    return _FAMILIES[family]()


def _edited(family: str) -> tuple[torch.fx.GraphModule, torch.fx.Node]:
    """A copy of the family's graph to edit, and its first FP8 compute node."""
    gm = fp8conf.copy_graph_module(_traced(family))
    return gm, next(n for n in gm.graph.nodes if is_fp8_compute(n))


@pytest.mark.parametrize("family", [pytest.param(f, marks=_MARKS.get(f, ())) for f in _FAMILIES])
def test_every_family_s_graph_validates_clean_with_every_compute_node_s_scales_judged(family):
    gm = _traced(family)
    compute = [n for n in gm.graph.nodes if is_fp8_compute(n)]
    assert compute, family
    judged = {n.name: scale_problems(n) for n in compute}
    assert all(problems == [] for problems in judged.values()), judged  # [] judged fine; None would be unchecked
    assert scale_findings(gm.graph) == []
    fp8conf.validate_fp8_graph(gm, strict=True)
    split = fp8conf.split_stage(gm, strict=True)
    for part in (split.forward, split.backward_input, split.backward_weight):
        fp8conf.validate_fp8_graph(part, strict=True)


# --- defects: strict raises naming the node, non-strict reports the finding -----------------------


def _set_arg(node: torch.fx.Node, position: int, value) -> None:
    args = list(node.args)
    args[position] = value
    node.args = tuple(args)


def _inserted(gm, before: torch.fx.Node, target, args: tuple, kwargs=None) -> torch.fx.Node:
    """A new node computing ``target(*args)`` before ``before``, its meta["val"] computed on the
    inputs' fake values as tracing would."""
    with gm.graph.inserting_before(before):
        new = gm.graph.call_function(target, args, kwargs or {})
    fake_args = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
    new.meta["val"] = target(*fake_args, **(kwargs or {}))
    return new


def _float16(gm, node: torch.fx.Node, scale: torch.fx.Node) -> torch.fx.Node:
    return _inserted(gm, node, torch.ops.aten._to_copy.default, (scale,), {"dtype": torch.float16})


def _expect_refused(gm, node: torch.fx.Node, *expected: str) -> fp8conf.ScaleMismatchError:
    """Strict validation raises for ``node`` and non-strict reports the same finding; every text
    of ``expected`` is in the message. Torch's own kernel refuses the edited call too."""
    with pytest.raises(fp8conf.ScaleMismatchError) as caught:
        fp8conf.validate_fp8_graph(gm, strict=True)
    error = caught.value
    provenance = fp8conf.get_provenance(node)
    assert (error.node_name, error.property_id) == (node.name, SCALE_PROPERTY_ID), error
    assert error.module_fqn == provenance.module_fqn and error.pass_name == "forward", error
    assert f"scaled matmul '{node.name}'" in str(error) and f"module '{provenance.module_fqn}'" in str(error), error
    for text in expected:
        assert text in str(error), (text, str(error))
    with pytest.warns(fp8conf.FP8ValidationWarning, match=node.name):
        report = fp8conf.validate_fp8_graph(gm, strict=False)
    assert [(f.property_id, f.node_name) for f in report.findings] == [(SCALE_PROPERTY_ID, node.name)], report.findings
    assert report.findings[0].message == error.findings[0].message
    assert _torch_refuses(node)
    return error


def _torch_refuses(node: torch.fx.Node) -> bool:
    """Whether the op's own Meta (or fake) kernel raises on the call's recorded values."""
    def val(a):
        if isinstance(a, torch.fx.Node):
            return a.meta["val"]
        return [val(x) for x in a] if isinstance(a, (list, tuple)) else a

    try:
        node.target(*val(node.args), **{k: val(v) for k, v in node.kwargs.items()})
    except Exception:
        return True
    return False


@_needs_v2
def test_swapped_scale_lists_of_a_v2_rowwise_matmul_are_refused_as_swapped():
    gm, mm = _edited("scaled_mm-rowwise")
    scale_a, scale_b = mm.args[2], mm.args[5]
    _set_arg(mm, 2, scale_b)
    _set_arg(mm, 5, scale_a)
    _expect_refused(gm, mm, f"scale_a[0] '{scale_b[0].name}' is float32 (1, 32); its scaling takes shape (8, 1)",
             "recipe_a [RowWise]", "the two operands' scales are swapped")


@_needs_v2
@pytest.mark.parametrize("family", ["scaled_mm-tensorwise", "scaled_mm-rowwise"])
def test_a_float16_copy_of_a_v2_scale_is_refused(family):
    gm, mm = _edited(family)
    copy = _float16(gm, mm, mm.args[5][0])
    _set_arg(mm, 5, [copy])
    _expect_refused(gm, mm, f"scale_b[0] '{copy.name}' is float16", "its scaling takes float32")


@_needs_v2
def test_an_empty_scale_list_of_a_v2_matmul_is_refused():
    gm, mm = _edited("scaled_mm-tensorwise")
    _set_arg(mm, 2, [])
    _expect_refused(gm, mm, "scale_a is an empty list, but recipe_a [TensorWise] takes 1")


@_needs_v2
def test_a_wrong_shaped_v2_rowwise_scale_is_refused():
    gm, mm = _edited("scaled_mm-rowwise")
    flat = _inserted(gm, mm, torch.ops.aten.view.default, (mm.args[2][0], [8]))
    _set_arg(mm, 2, [flat])
    _expect_refused(gm, mm, f"scale_a[0] '{flat.name}' is float32 (8,); its scaling takes shape (8, 1)")


def test_a_wrong_shaped_rowwise_scale_of_the_first_api_is_refused():
    gm, mm = _edited("float8-rowwise")
    column = _inserted(gm, mm, torch.ops.aten.t.default, (mm.args[2],))  # (16, 1) -> (1, 16)
    _set_arg(mm, 2, column)
    _expect_refused(gm, mm, f"scale_a '{column.name}' (1, 16) and scale_b", "rowwise (16, 1) and (1, 32)")


def test_swapped_rowwise_scales_of_the_first_api_are_refused_as_swapped():
    gm, mm = _edited("float8-rowwise")
    scale_a, scale_b = mm.args[2], mm.args[3]
    _set_arg(mm, 2, scale_b)
    _set_arg(mm, 3, scale_a)
    _expect_refused(gm, mm, "fit no scaling of a (16, 32) x (32, 32) matmul", "the two operands' scales are swapped")


def test_a_float16_tensorwise_scale_of_the_first_api_is_refused():
    gm, mm = _edited("float8-tensorwise")
    copy = _float16(gm, mm, mm.args[3])
    _set_arg(mm, 3, copy)
    _expect_refused(gm, mm, f"scale_b '{copy.name}' is float16 ()", "its scaling takes float32")


@_needs_v2_api
def test_swizzled_mx_scales_viewed_as_bytes_are_refused():
    gm, mm = _edited("mxfp8_swizzled")
    as_bytes = _inserted(gm, mm, torch.ops.aten.view.dtype, (mm.args[2][0], torch.uint8))
    _set_arg(mm, 2, [as_bytes])
    _expect_refused(gm, mm, f"scale_a[0] '{as_bytes.name}' is uint8 (512,); its scaling takes float8_e8m0fnu")


@_needs_v2_api
def test_swizzled_mx_scales_declared_unswizzled_are_refused():
    gm, mm = _edited("mxfp8_swizzled")
    _set_arg(mm, 7, [0])
    _expect_refused(gm, mm, "swizzle_b declares NO_SWIZZLE; MX BlockWise1x32 scaling takes SWIZZLE_32_4_4")


@_needs_nvfp4
def test_an_nvfp4_call_without_its_global_scale_is_refused():
    gm, mm = _edited("nvfp4")
    _set_arg(mm, 5, mm.args[5][:1])
    _expect_refused(gm, mm, "scale_b holds 1 scale(s)", "recipe_b [BlockWise1x16, TensorWise] takes 2")


def test_swapped_scales_of_fp8conf_s_e8m0_op_are_refused():
    gm, mm = _edited("mxfp8")
    scale_a, scale_b = mm.args[2], mm.args[3]
    _set_arg(mm, 2, scale_b)
    _set_arg(mm, 3, scale_a)
    _expect_refused(gm, mm, f"a_scale '{scale_b.name}' is", "(32, 2); its scaling takes shape (8, 2)", "swapped")


def test_a_float16_scale_of_a_grouped_matmul_is_refused():
    gm, mm = _edited("grouped")
    copy = _float16(gm, mm, mm.args[2])
    _set_arg(mm, 2, copy)
    _expect_refused(gm, mm, "grouped scales are both float32 (rowwise) or both float8_e8m0fnu (MXFP8)")


def test_a_scale_without_recorded_value_is_a_finding_and_the_graph_is_left_as_it_was():
    gm, mm = _edited("float8-tensorwise")
    scale = mm.args[2]
    val = scale.meta.pop("val")
    code = gm.code
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fp8conf.FP8ValidationWarning)
        report = fp8conf.validate_fp8_graph(gm, strict=False)
    (finding,) = report.findings
    assert finding.node_name == mm.name and f"scale_a '{scale.name}' records no node.meta['val']" in finding.message
    assert gm.code == code and "val" not in scale.meta
    scale.meta["val"] = val
    assert fp8conf.validate_fp8_graph(gm, strict=False).ok


# --- torch's rules, no stricter: judged fine exactly where torch's Meta kernel takes the call ----
# On meta tensors, whose scales torch's Meta kernels check as it checks CUDA ones.


def _call_node(op, args: tuple, kwargs: dict) -> torch.fx.Node:
    """A call of ``op`` in a new graph, every tensor argument a placeholder recording it."""
    graph = torch.fx.Graph()

    def node(value):
        if isinstance(value, torch.Tensor):
            placeholder = graph.placeholder(f"t{len(graph.nodes)}")
            placeholder.meta["val"] = value
            return placeholder
        return [node(v) for v in value] if isinstance(value, list) else value

    return graph.call_function(op, tuple(node(a) for a in args), kwargs)


def _agree(op, args: tuple, kwargs: dict) -> tuple[bool, bool, list[str]]:
    call = _call_node(op, args, kwargs)
    problems = scale_problems(call)
    assert problems is not None, call
    return problems == [], not _torch_refuses(call), problems


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _scale_candidates(m: int, k: int, n: int) -> list[torch.Tensor]:
    """Scales of every scaling torch knows for an (m, k) x (k, n) matmul, and near misses."""
    kb, l4 = _cdiv(k, 128), _cdiv(k // 128, 4) * 4
    mx, nv = _cdiv(_cdiv(k, 32), 4) * 4, _cdiv(_cdiv(k, 16), 4) * 4  # blocks along K, padded to 4
    mx_a, mx_b, nv_a, nv_b = _cdiv(m, 128) * 128 * mx, _cdiv(n, 128) * 128 * mx, _cdiv(m, 128) * 128 * nv, _cdiv(n, 128) * 128 * nv
    return [
        torch.empty(()), torch.empty(1), torch.empty((), dtype=torch.float16),
        torch.empty(m, 1), torch.empty(1, n), torch.empty(n, 1), torch.empty(m), torch.empty(1, m),
        torch.empty(m, 2)[:, :1], torch.empty(m, 1, dtype=torch.float16), torch.empty(1, n, dtype=torch.bfloat16),
        torch.empty(m, kb), torch.empty(kb, n), torch.empty(kb, _cdiv(n, 128)), torch.empty(_cdiv(m, 128), kb),
        torch.empty(k // 128, m).t(), torch.empty(k // 128, n).t(), torch.empty(m // 128, l4).t(), torch.empty(n // 128, l4).t(),
        torch.empty(mx_a, dtype=E8M0), torch.empty(mx_b, dtype=E8M0), torch.empty(mx_a + 4, dtype=E8M0),
        torch.empty(mx_a, dtype=torch.uint8), torch.empty(nv_a, dtype=E4M3), torch.empty(nv_b, dtype=E4M3),
    ]


# Rows and columns padded in the swizzled layouts, blocks along K padded to 4, K not a multiple of 128.
_SHAPES = [(16, 32, 48), (256, 256, 128), (144, 352, 176)]


@pytest.mark.parametrize("m, k, n", _SHAPES)
def test_first_api_scales_are_judged_as_torch_judges_them(m, k, n):
    disagree, taken = [], set()
    with torch.device("meta"):
        a, b = torch.empty(m, k).to(E4M3), torch.empty(n, k).to(E4M3).t()
        # e4m3 block scales: the first API counts K as packed FP4, twice the operand's columns
        nv = _cdiv(_cdiv(2 * k, 16), 4) * 4
        candidates = _scale_candidates(m, k, n) + [torch.empty(_cdiv(m, 128) * 128 * nv, dtype=E4M3),
                                                   torch.empty(_cdiv(n, 128) * 128 * nv, dtype=E4M3)]
        for sa, sb in itertools.product(candidates, repeat=2):
            ours, torchs, problems = _agree(torch.ops.aten._scaled_mm.default, (a, b, sa, sb), {"out_dtype": torch.float32})
            if ours != torchs:
                disagree.append((sa.dtype, tuple(sa.shape), sa.stride(), sb.dtype, tuple(sb.shape), sb.stride(), torchs, problems))
            if torchs:
                taken.add(sa.dtype if sa.numel() > 1 else "tensorwise")
    assert not disagree, disagree[:5]
    assert taken == {"tensorwise", torch.float32, E8M0, E4M3}, taken  # every scaling torch takes was tried


#: Recipe pairs of the second API (ScalingType values): every one torch takes, and some it does not.
_RECIPES = [([0], [0]), ([1], [1]), ([4], [4]), ([5], [4]), ([4], [5]), ([0], [1]), ([0, 0], [0, 0]),
            ([3], [3]), ([2], [2]), ([2, 0], [2, 0])]
#: Per ScalingType, the scale dtype it takes (a scale of another dtype is tried only as a decoy).
_RECIPE_DTYPES = {0: torch.float32, 1: torch.float32, 2: E4M3, 3: E8M0, 4: torch.float32, 5: torch.float32}


@_needs_v2_api
@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=_needs_nvfp4)], ids=["float8", "float4"])
def test_second_api_scales_are_judged_as_torch_judges_them(packed):
    (m, k, n), disagree, taken = _SHAPES[-1], [], set()
    with torch.device("meta"):
        if packed:  # FP4 operands: K counts unpacked elements
            a, b = torch.empty(m, k // 2, dtype=torch.float4_e2m1fn_x2), torch.empty(n, k // 2, dtype=torch.float4_e2m1fn_x2).t()
        else:
            a, b = torch.empty(m, k).to(E4M3), torch.empty(n, k).to(E4M3).t()
        candidates = _scale_candidates(m, k, n)
        decoys = [torch.empty((), dtype=torch.float16), torch.empty(m, 1, dtype=torch.float16), torch.empty(())]
        for recipe_a, recipe_b in _RECIPES:
            dtypes = {_RECIPE_DTYPES[r] for r in recipe_a[:1] + recipe_b[:1]}
            tried = [c for c in candidates if c.dtype in dtypes] + decoys
            swizzles = [[], [1], [0]] if recipe_a[0] in (2, 3) else [[]]
            for sa, sb, swizzle in itertools.product(tried, tried, swizzles):
                tail_a = [torch.empty(())] * (len(recipe_a) - 1)
                tail_b = [torch.empty((), dtype=torch.float32 if sb.dtype == E4M3 else torch.float16)] * (len(recipe_b) - 1)
                args = (a, b, [sa, *tail_a], recipe_a, swizzle, [sb, *tail_b], recipe_b, swizzle, None, torch.bfloat16)
                ours, torchs, problems = _agree(torch.ops.aten._scaled_mm_v2.default, args, {})
                if ours != torchs:
                    disagree.append((recipe_a, recipe_b, swizzle, sa.dtype, tuple(sa.shape), sb.dtype, tuple(sb.shape), torchs, problems))
                if torchs:
                    taken.add(str((recipe_a, recipe_b)))
    assert not disagree, disagree[:5]
    # Every recipe pair torch takes was tried with scales it takes (MX on FP4 operands counts packed K).
    refused = [([0], [1]), ([0, 0], [0, 0])] + ([([3], [3])] if packed else [])
    assert taken == {str(r) for r in _RECIPES if r not in refused}, taken


def test_grouped_scales_are_judged_as_torch_judges_them():
    disagree, taken = [], set()
    with torch.device("meta"):
        offs = torch.empty(4, dtype=torch.int32)
        experts = torch.empty(4, 128, 64).to(E4M3).transpose(-2, -1)  # 4 groups of (64, 128), column-major
        layouts = [  # 2-D x 3-D (forward), 2-D x 2-D (weight gradient, per group), 3-D x 3-D
            ("2d-3d", torch.empty(96, 64).to(E4M3), experts, offs),
            ("2d-2d", torch.empty(16, 96).to(E4M3), torch.empty(32, 96).to(E4M3).t(), offs),
            ("3d-3d", torch.empty(4, 8, 64).to(E4M3), experts, None),
        ]
        for layout, a, b, groups in layouts:
            rows, cols = a.shape[-2], b.shape[-1]
            candidates = [
                torch.empty(rows), torch.empty(rows * 4), torch.empty(cols), torch.empty(cols * 4), torch.empty(4, rows),
                torch.empty(4, cols), torch.empty(rows, dtype=torch.float16), torch.empty(4, cols, 2)[..., 0],
                torch.empty(rows, 1), torch.empty(()), torch.empty(4, 512, dtype=E8M0), torch.empty(4, 513, dtype=E8M0),
                torch.empty(rows, 4, dtype=E8M0), torch.empty(rows * 4, dtype=E8M0),
            ]
            for sa, sb in itertools.product(candidates, repeat=2):
                args = (a, b, sa, sb, groups)
                ours, torchs, problems = _agree(torch.ops.aten._scaled_grouped_mm.default, args, {"out_dtype": torch.bfloat16})
                if ours != torchs:
                    disagree.append((layout, sa.dtype, tuple(sa.shape), sb.dtype, tuple(sb.shape), torchs, problems))
                if torchs:
                    taken.add((layout, sa.dtype))
    assert not disagree, disagree[:5]
    # torch has no MXFP8 rule for a 3-D left operand yet (a TODO of its Meta kernel): none taken there.
    assert taken == {(layout, dtype) for layout, *_ in layouts for dtype in (torch.float32, E8M0)} - {("3d-3d", E8M0)}, taken
