"""Grouped experts on torch's second scaled-matmul API (``F.scaled_grouped_mm`` ->
``aten._scaled_grouped_mm_v2``): fp8conf's ``Float8GroupedExperts(v2=True)``, traced, validated,
split and region-identified on CPU under the suite's structure-only Meta kernel
(``conformance.draw.moe.v2_grouped_structure``; torch ships a CUDA kernel only). Its numerics need an
sm90 GPU; here its structure is checked, and that the kernel is scoped and never computes.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F

import fp8conf
from conformance.observe.graphs import Fp8Ops, fp8_compute_nodes, grouped_offsets, incompleteness, is_fp8_cast
from conformance.draw.moe import MoESpec, build_moe_model, has_v2_grouped_meta_kernel, v2_grouped_structure
from conformance.backends.reference import ReferenceBackend
from fp8conf.quantized.grouped import Float8GroupedExperts, has_scaled_grouped_mm_v2

V2_NAME = "aten._scaled_grouped_mm_v2.default"

pytestmark = pytest.mark.skipif(not has_scaled_grouped_mm_v2(), reason=f"torch {torch.__version__} has no F.scaled_grouped_mm")


def _has_kernel(key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key("aten::_scaled_grouped_mm_v2", key)


def _grouped_v2(a, b, a_scale, b_scale, offs):
    rowwise = F.ScalingType.RowWise
    return F.scaled_grouped_mm(a, b, a_scale, rowwise, b_scale, rowwise, offs=offs, output_dtype=torch.bfloat16)


def _model(input_requires_grad: bool):
    spec = MoESpec(dim=16, hidden=32, experts=3, top_k=1, tokens=16, input_requires_grad=input_requires_grad, v2=True)
    model, args = build_moe_model(spec, convert=ReferenceBackend().convert_scaled_grouped_experts)
    assert all(m.v2 for m in model.modules() if isinstance(m, Float8GroupedExperts))
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
        assert _has_kernel("Meta") and has_v2_grouped_meta_kernel()
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
        assert grouped_offsets(compute) is compute.args[8] and compute.args[8] not in region.nodes
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
    from conformance.judge.rewrites import lower_grouped_to_high_precision

    _spec, model, args = _model(True)
    with v2_grouped_structure():
        gm = fp8conf.trace_joint(model, args)
        passes = fp8conf.node_passes(gm.graph)
        lost = next(n for n in _v2_nodes(gm) if passes[n] == "forward")
        fqn = fp8conf.get_provenance(lost).module_fqn
        lower_grouped_to_high_precision(gm, lost)
    with pytest.raises(fp8conf.FP8ValidationError, match=fqn.replace(".", r"\.")):
        fp8conf.validate_fp8_graph(gm, strict=True)


@pytest.mark.parametrize("mode", ["regional", "full"])
def test_v2_grouped_experts_compile_on_cpu_and_their_gemms_are_what_inductor_runs(mode):
    # What CPU can do: Inductor compiles the graph (fake values through the scoped Meta kernel);
    # running it needs the GEMM's CUDA kernel (tests/test_grouped.py runs it on an sm90 GPU).
    _spec, model, args = _model(True)
    with v2_grouped_structure():
        gm = fp8conf.trace_joint(model, args)
        compiled = fp8conf.compile_joint(gm, mode=mode, strict=True)
    gemms = {n.name for n in _v2_nodes(gm)}
    assert gemms and gemms <= compiled.compiled_nodes, sorted(gemms - compiled.compiled_nodes)
    assert compiled.inductor_compiles >= 1 and not compiled.fallbacks, compiled.fallbacks
    if mode == "regional":
        in_regions = {n.name for r in compiled.regions for n in r.compute_nodes}
        assert gemms <= in_regions, sorted(gemms - in_regions)
    grads = (torch.randn(args[0].shape),)
    with pytest.raises((NotImplementedError, RuntimeError), match="_scaled_grouped_mm_v2"):
        fp8conf.run_joint(gm, model, args, grads, fn=compiled)
