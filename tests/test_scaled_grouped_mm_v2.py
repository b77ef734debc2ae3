"""Grouped experts on torch's second scaled-matmul API (``F.scaled_grouped_mm`` ->
``aten._scaled_grouped_mm_v2``), traced, validated, split and region-identified on CPU.

torch 2.13 has no CPU, Meta or fake kernel for ``_scaled_grouped_mm_v2`` (it has a CUDA one
only, and a Meta one for the first API's ``_scaled_grouped_mm``), so a model calling it cannot
even be traced with fake tensors on CPU. A structure-only trace is sound with a Meta kernel that
computes what torch's own kernels compute before any arithmetic, and nothing else:

* the output's shape, dtype and strides come from torch's own rule for grouped GEMM outputs,
  the one the first API's Meta kernel uses (``_meta_grouped_mm_common``, the Python twin of
  the CUDA code's ``create_grouped_gemm_output_tensor``, which both APIs' CUDA kernels call);
  its checks of the operands (FP8 dtypes, row/column-major layouts, 16-byte strides, rowwise
  scale shapes, int32 offsets) are the rowwise recipe's on both APIs, so a layout the GPU would
  refuse is refused here too. Only one rowwise scale per operand is taken: any other recipe is
  refused, not guessed;
* it is registered with ``torch.library`` only inside :func:`v2_grouped_structure` (never at
  import), only where torch has no Meta kernel of its own, and removed on leaving, with
  FakeTensor's dispatch cache cleared, so no fake result outlives the block;
* it is a Meta kernel, not a CPU one: a real call still raises inside the block, so nothing
  that runs a v2 grouped GEMM can pretend to compute on CPU.

The experts module (:class:`V2GroupedExperts`) is fp8conf's rowwise FP8 grouped experts with
each grouped GEMM made through ``F.scaled_grouped_mm``: stateless quantize-then-matmul, as
torchtitan's float8 experts now are. Its numerics need an sm90 GPU; here its structure is checked.
"""

from __future__ import annotations

import collections
import contextlib

import pytest
import torch
import torch.nn.functional as F

import fp8conf
from conformance.graphs import Fp8Ops, fp8_compute_nodes, incompleteness, is_fp8_cast
from conformance.moe import MoESpec, build_moe_model
from fp8conf.quantized.grouped import Float8GroupedExperts, to_float8_per_group, to_float8_rowwise, token_groups

V2_GROUPED = torch.ops.aten._scaled_grouped_mm_v2.default
V2_NAME = "aten._scaled_grouped_mm_v2.default"

pytestmark = pytest.mark.skipif(not hasattr(F, "scaled_grouped_mm"), reason=f"torch {torch.__version__} has no F.scaled_grouped_mm")


def _has_kernel(key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(V2_GROUPED.name(), key)


def _meta_scaled_grouped_mm_v2(mat_a, mat_b, scale_a, recipe_a, swizzle_a, scale_b, recipe_b, swizzle_b, offs=None,
                               bias=None, out_dtype=None, contraction_dim=(), use_fast_accum=False):
    from torch._meta_registrations import _meta_grouped_mm_common

    rowwise = int(F.ScalingType.RowWise.value)
    if len(scale_a) != 1 or len(scale_b) != 1 or list(recipe_a) != [rowwise] or list(recipe_b) != [rowwise] or list(contraction_dim):
        raise NotImplementedError(
            "the structure-only _scaled_grouped_mm_v2 kernel takes one rowwise scale per operand and the default "
            f"contraction dims; got recipes {list(recipe_a)} / {list(recipe_b)}, contraction_dim {list(contraction_dim)}"
        )
    return _meta_grouped_mm_common(
        mat_a, mat_b, scale_a=scale_a[0], scale_b=scale_b[0], offs=offs, bias=bias, scale_result=None,
        out_dtype=out_dtype or torch.bfloat16, use_fast_accum=use_fast_accum,
    )


@contextlib.contextmanager
def v2_grouped_structure():
    """Within: ``aten._scaled_grouped_mm_v2`` has a Meta kernel (shapes, dtypes, strides and the
    operand checks of the rowwise recipe), so fake tensors trace it; outside, as torch ships it."""
    if _has_kernel("Meta"):  # torch's own: nothing to add
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    library = torch.library.Library("aten", "IMPL")
    try:
        library.impl("_scaled_grouped_mm_v2", _meta_scaled_grouped_mm_v2, "Meta")
        yield
    finally:
        library._destroy()
        FakeTensorMode.cache_clear()


def _grouped_v2(a, b, a_scale, b_scale, offs):
    rowwise = F.ScalingType.RowWise
    return F.scaled_grouped_mm(a, b, a_scale, rowwise, b_scale, rowwise, offs=offs, output_dtype=torch.bfloat16)


def _column_major(t):
    return t.transpose(-2, -1).contiguous().transpose(-2, -1)


class _V2GroupedMM(torch.autograd.Function):
    """fp8conf's rowwise FP8 grouped GEMMs (``fp8conf.quantized.grouped``), each through
    ``F.scaled_grouped_mm``: output, grad_input and the 2-D by 2-D grad_weight with scales per
    token group."""

    @staticmethod
    def forward(ctx, x, weight, offs):
        ctx.save_for_backward(x, weight, offs)
        x_data, x_scale = to_float8_rowwise(x, dim=-1)
        w_data, w_scale = to_float8_rowwise(weight, dim=-1)
        out = _grouped_v2(x_data, w_data.transpose(-2, -1), x_scale.reciprocal().squeeze(-1), w_scale.reciprocal().squeeze(-1), offs)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, offs = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            g_data, g_scale = to_float8_rowwise(grad_out, dim=-1)
            w_data, w_scale = to_float8_rowwise(weight, dim=-2)
            grad_x = _grouped_v2(g_data, _column_major(w_data), g_scale.reciprocal().squeeze(-1),
                                 w_scale.reciprocal().squeeze(-2).contiguous(), offs).to(x.dtype)
        if ctx.needs_input_grad[1]:
            groups = token_groups(offs, x.shape[0])
            g_data, g_scale = to_float8_per_group(grad_out, groups, weight.shape[0])
            x_data, x_scale = to_float8_per_group(x, groups, weight.shape[0])
            grad_w = _grouped_v2(g_data.t().contiguous(), _column_major(x_data), g_scale.reciprocal().reshape(-1),
                                 x_scale.reciprocal().reshape(-1), offs).to(weight.dtype)
        return grad_x, grad_w, None


class V2GroupedExperts(Float8GroupedExperts):
    """Rowwise FP8 grouped experts (kind ``float8_grouped_experts``) on ``F.scaled_grouped_mm``."""

    def forward(self, x, offs):
        return _V2GroupedMM.apply(x, self.weight, offs)


def _convert(model, *, module_filter_fn, recipe, emulate):
    assert recipe == "rowwise" and not emulate
    for fqn, module in list(model.named_modules()):
        if fqn and module_filter_fn(module, fqn):
            parent, _, name = fqn.rpartition(".")
            setattr(model.get_submodule(parent), name, V2GroupedExperts(module.weight))


def _model(input_requires_grad: bool):
    spec = MoESpec(dim=16, hidden=32, experts=3, top_k=1, tokens=16, input_requires_grad=input_requires_grad)
    model, args = build_moe_model(spec, convert=_convert)
    return spec, model, args


def _v2_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target) == V2_NAME]


def test_torch_ships_no_cpu_meta_or_fake_kernel_for_the_v2_grouped_gemm():
    if _has_kernel("Meta"):
        pytest.skip(f"torch {torch.__version__} has a Meta kernel for _scaled_grouped_mm_v2: the scoped one is not needed")
    assert not _has_kernel("CPU") and not _has_kernel("CompositeExplicitAutograd")
    _spec, model, args = _model(True)
    with pytest.raises(Exception, match="_scaled_grouped_mm_v2"):
        fp8conf.trace_joint(model, args)


def test_the_kernel_is_registered_only_inside_the_block_and_never_computes():
    if _has_kernel("Meta"):
        pytest.skip("torch has its own Meta kernel")
    a = torch.zeros(16, 16).to(torch.float8_e4m3fn)
    b = torch.zeros(2, 16, 16).to(torch.float8_e4m3fn).transpose(-2, -1)
    offs = torch.tensor([16, 16], dtype=torch.int32)
    with v2_grouped_structure():
        assert _has_kernel("Meta")
        with torch.device("meta"):
            out = _grouped_v2(a.to("meta"), b.to("meta"), torch.ones(16, device="meta"), torch.ones(2, 16, device="meta"),
                              offs.to("meta"))
        assert out.shape == (16, 16) and out.dtype == torch.bfloat16
        with pytest.raises((NotImplementedError, RuntimeError)):  # a real CPU call: no kernel computes it
            _grouped_v2(a, b, torch.ones(16), torch.ones(2, 16), offs)
        with pytest.raises(NotImplementedError, match="rowwise"):
            with torch.device("meta"):
                F.scaled_grouped_mm(a.to("meta"), b.to("meta"), torch.ones(16, device="meta"), F.ScalingType.TensorWise,
                                    torch.ones(2, 16, device="meta"), F.ScalingType.TensorWise, offs=offs.to("meta"))
    assert not _has_kernel("Meta")
    _spec, model, args = _model(True)
    with pytest.raises(Exception, match="_scaled_grouped_mm_v2"):  # no fake result outlives the block
        fp8conf.trace_joint(model, args)


@pytest.mark.parametrize("input_requires_grad", [True, False])
def test_v2_grouped_experts_trace_validate_split_and_identify_regions_on_cpu(input_requires_grad):
    spec, model, args = _model(input_requires_grad)
    with v2_grouped_structure():
        gm = fp8conf.trace_joint(model, args)
    nodes = _v2_nodes(gm)
    # The suite's own ground truth counts them as FP8 compute by their operands' dtypes.
    assert set(fp8_compute_nodes(gm, Fp8Ops())) == set(nodes) and nodes
    passes = fp8conf.node_passes(gm.graph)
    found = collections.Counter((fp8conf.get_provenance(n).module_fqn, passes[n]) for n in nodes)
    assert all(fp8conf.get_provenance(n).kind == "float8_grouped_experts" for n in nodes)
    assert dict(found) == spec.expected_compute_counts(), (found, spec.expected_compute_counts())

    report = fp8conf.validate_fp8_graph(gm, strict=True)
    assert report.ok, report.summary

    regions = [r for r in fp8conf.identify_fp8_regions(gm) if r.compute_nodes]
    assert all(r.complete for r in regions), [r.reason for r in regions if not r.complete]
    assert sorted(n for r in regions for n in r.compute_nodes) == sorted(nodes)
    for region in regions:  # complete by the suite's own check; the offsets enter as a boundary
        assert incompleteness(set(region.nodes), lambda n: passes[n] == "backward", Fp8Ops()) is None, region.id
        (compute,) = region.compute_nodes
        assert compute.args[8] not in region.nodes
        casts = [n for n in region.nodes if is_fp8_cast(n)]
        assert len(casts) >= 2, f"{region.id}: the casts of both operands belong to the region, saw {casts}"

    split = fp8conf.split_stage(gm)
    parts = {part: collections.Counter(fp8conf.get_provenance(n).module_fqn for n in _v2_nodes(getattr(split, part)))
             for part in ("forward", "backward_input", "backward_weight")}
    experts = sorted({fqn for fqn, _ in spec.expected_compute_counts()})
    assert parts["forward"] == {fqn: 1 for fqn in experts}
    backward = {fqn: spec.expected_compute_counts()[(fqn, "backward")] for fqn in experts}
    if input_requires_grad:  # dI: each grad_input (every input gradient needs it); dW: each grad_weight
        assert parts["backward_input"] == {fqn: 1 for fqn in experts}
        assert parts["backward_weight"] == {fqn: 1 for fqn in experts}
    else:  # no input gradient: dW holds the whole backward
        assert not parts["backward_input"] and parts["backward_weight"] == backward


def test_a_v2_grouped_gemm_lost_to_high_precision_fails_validation_naming_its_experts():
    from conformance.rewrites import lower_grouped_to_high_precision

    _spec, model, args = _model(True)
    with v2_grouped_structure():
        gm = fp8conf.trace_joint(model, args)
        passes = fp8conf.node_passes(gm.graph)
        lost = next(n for n in _v2_nodes(gm) if passes[n] == "forward")
        fqn = fp8conf.get_provenance(lost).module_fqn
        lower_grouped_to_high_precision(gm, lost)
    with pytest.raises(fp8conf.FP8ValidationError, match=fqn.replace(".", r"\.")):
        fp8conf.validate_fp8_graph(gm, strict=True)
