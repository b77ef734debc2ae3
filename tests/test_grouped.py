"""fp8conf's FP8 grouped experts (``fp8conf.quantized.grouped``): conversion, quantization, the
passes on MoE graphs, and (on an sm90 GPU) numerics of real FP8 against emulation and of compiled
graphs against eager."""

from __future__ import annotations

import collections
import re

import pytest
import torch

import fp8conf
from conformance.draw.moe import ExpertsSpec, MoESpec, build_experts_model, build_moe_model
from conformance.backends.reference import ReferenceBackend
from fp8conf.errors import GroupedExpertsError
from fp8conf.quantized.grouped import (
    Float8GroupedExperts, convert_to_float8_grouped_experts, to_float8_per_group, to_float8_rowwise, token_groups,
)


def _convert(model, *, module_filter_fn, recipe, emulate):
    convert_to_float8_grouped_experts(model, recipe=recipe, emulate=emulate, module_filter_fn=module_filter_fn)


def _reference(x, weight, offs):
    """Per-group float32 matmuls, the definition of the grouped GEMM."""
    out, start = [], 0
    for e, end in enumerate(offs.tolist()):
        out.append(x[start:end] @ weight[e].t())
        start = end
    return torch.cat(out)


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def test_conversion_takes_over_the_weight_and_names_the_kind():
    model, _ = build_moe_model(MoESpec(), convert=lambda *a, **k: None)
    weight = model.layers[0].experts_up.weight
    convert_to_float8_grouped_experts(model, module_filter_fn=lambda m, fqn: fqn.endswith("experts_up"))
    assert isinstance(model.layers[0].experts_up, Float8GroupedExperts)
    assert model.layers[0].experts_up.weight is weight
    assert not isinstance(model.layers[0].experts_down, Float8GroupedExperts)
    found = fp8conf.find_quantized_modules(model)
    assert {fqn: (c.kind, c.recipe, c.emulate) for fqn, c in found.items()} == {
        "layers.0.experts_up": ("float8_grouped_experts", "rowwise", False)
    }


def test_conversion_refuses_dims_that_fp8_grouped_gemms_cannot_take_naming_the_module():
    module = torch.nn.Module()
    module.experts = torch.nn.Module()
    module.experts.weight = torch.nn.Parameter(torch.zeros(2, 24, 16))
    with pytest.raises(GroupedExpertsError, match=r"'experts'.*out_features=24 not a multiple of 16") as info:
        convert_to_float8_grouped_experts(module)
    assert info.value.module_fqn == "experts"
    with pytest.raises(GroupedExpertsError, match="recipe must be one of"):
        convert_to_float8_grouped_experts(module, recipe="tensorwise")


def test_bad_offsets_are_refused_naming_the_argument():
    experts = Float8GroupedExperts(torch.nn.Parameter(torch.zeros(2, 16, 16)))
    with pytest.raises(GroupedExpertsError, match="`offs` must be an int32 tensor of shape"):
        experts(torch.zeros(32, 16), torch.tensor([16, 32]))


def test_per_group_scales_use_only_their_group_and_stay_finite_for_empty_groups():
    x = torch.cat([torch.full((16, 4), 2.0), torch.full((16, 4), 960.0)])
    offs = torch.tensor([16, 16, 32], dtype=torch.int32)
    groups = token_groups(offs, 32)
    assert groups.tolist() == [0] * 16 + [2] * 16
    data, scale = to_float8_per_group(x, groups, 3)
    assert scale.shape == (3, 4) and torch.isfinite(scale).all()
    assert scale[0, 0] == 128.0 and scale[2, 0] == 0.25  # 448 / amax, rounded down to a power of two
    assert (data.float() / scale[groups.long()] == x).all()
    zeros, zero_scale = to_float8_rowwise(torch.zeros(2, 16), dim=-1)
    assert torch.isfinite(zero_scale).all() and not zeros.float().any()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.fp8_gpu)])
def test_bfloat16_casts_give_the_bytes_of_float32_casts(device):
    # The casts scale bfloat16 in bfloat16 (no float32 copy): a power of two keeps it exact, so
    # every byte and scale must equal the float32 computation's, from tiny values to huge ones.
    generator = torch.Generator().manual_seed(0)
    magnitudes = torch.tensor([1e-30, 1e-6, 1.0, 3e4, 1e30]).repeat_interleave(16)
    x = (torch.randn(80, 48, generator=generator) * magnitudes[:, None]).to(torch.bfloat16).to(device)
    x[:16, :3] = 0
    groups = token_groups(torch.tensor([16, 16, 48, 80], dtype=torch.int32, device=device), 80)
    for cast in (lambda t: to_float8_rowwise(t, dim=-1), lambda t: to_float8_rowwise(t, dim=0),
                 lambda t: to_float8_per_group(t, groups, 4)):
        (data, scale), (data32, scale32) = cast(x), cast(x.float())
        assert torch.equal(scale, scale32)
        assert torch.equal(data.view(torch.uint8), data32.view(torch.uint8))


def test_an_eager_joint_step_records_no_autograd_graph():
    # run_joint runs a graph that computes its own gradients: autograd recording through it
    # would hold every saved intermediate until the results die.
    model, args = build_moe_model(MoESpec(emulate=True), convert=_convert)
    gm = fp8conf.trace_joint(model, args)
    (out,), grads = fp8conf.run_joint(gm, model, args, (torch.ones(16, 16),))
    assert out.grad_fn is None and all(g.grad_fn is None for g in grads.values())


def test_emulated_experts_approximate_the_grouped_matmul_with_fp8_error_on_cpu():
    spec = ExpertsSpec(groups=(32, 0, 16, 48), in_features=32, out_features=48, emulate=True)
    model, (x, offs) = build_experts_model(spec, convert=_convert)
    out = model(x, offs)
    grad = torch.randn_like(out)
    out.backward(grad)
    xr, wr = x.detach().clone().requires_grad_(), model.experts.weight.detach().clone().requires_grad_()
    expected = _reference(xr, wr, offs)
    expected.backward(grad)
    assert _rel(out, expected) < 0.1
    assert _rel(x.grad, xr.grad) < 0.1
    assert _rel(model.experts.weight.grad, wr.grad) < 0.1
    assert not model.experts.weight.grad[1].any()  # the empty group's expert


def test_real_fp8_moe_graph_traces_on_cpu_and_passes_every_pass():
    spec = MoESpec(experts=3, top_k=2, layers=2, unused=(1,))
    model, args = build_moe_model(spec, convert=_convert)
    gm = fp8conf.trace_joint(model, args)
    report = fp8conf.validate_fp8_graph(gm, strict=True)
    assert {k: v for k, v in report.compute_counts.items() if v} == spec.expected_compute_counts()
    regions = fp8conf.tag_fp8_regions(gm, strict=True)
    # One complete region per grouped GEMM: grad_input and grad_weight quantize the gradient each
    # their own way, so their chains share no node.
    assert collections.Counter((r.module_fqn, r.pass_name) for r in regions) == collections.Counter(spec.expected_compute_counts())
    assert all(r.complete and len(r.compute_nodes) == 1 for r in regions)
    split = fp8conf.split_stage(gm, strict=True)
    assert {f"{fqn}.weight" for fqn in spec.quantized_modules()} <= set(split.param_grads)


def test_the_signature_names_grouped_experts_and_their_emulation():
    real, _ = build_moe_model(MoESpec(), convert=_convert)
    emulated, _ = build_moe_model(MoESpec(emulate=True), convert=_convert)
    signature = fp8conf.QuantizationSignature.from_model(real)
    assert "float8_grouped_experts" in signature.to_json()
    assert signature.sha256 != fp8conf.QuantizationSignature.from_model(emulated).sha256


def test_the_signature_tells_experts_on_the_second_api_apart_and_leaves_the_first_as_it_was(monkeypatch):
    import fp8conf.quantized.grouped as grouped

    monkeypatch.setattr(grouped, "has_scaled_grouped_mm_v2", lambda: True)  # building calls no kernel
    first, _ = build_moe_model(MoESpec(), convert=_convert)
    second, _ = build_moe_model(MoESpec(v2=True), convert=ReferenceBackend().convert_scaled_grouped_experts)
    first_json, second_json = (fp8conf.QuantizationSignature.from_model(m).to_json() for m in (first, second))
    assert '"v2"' not in first_json and '"config":{"v2":true}' in second_json.replace(" ", "")
    assert "v2=True" in repr(second.layers[0].experts_up) and "v2" not in repr(first.layers[0].experts_up)


def test_experts_on_the_second_api_are_refused_where_torch_lacks_it_naming_the_release(monkeypatch):
    import fp8conf.quantized.grouped as grouped

    monkeypatch.setattr(grouped, "has_scaled_grouped_mm_v2", lambda: False)
    model, _ = build_moe_model(MoESpec(), convert=lambda *a, **k: None)
    before = type(model.layers[0].experts_up)
    with pytest.raises(GroupedExpertsError, match=rf"torch {re.escape(torch.__version__)} lacks.*2\.12"):
        convert_to_float8_grouped_experts(model, v2=True)
    assert type(model.layers[0].experts_up) is before  # nothing swapped
    with pytest.raises(GroupedExpertsError, match="F.scaled_grouped_mm|scaled_grouped_mm"):
        Float8GroupedExperts(model.layers[0].experts_up.weight, v2=True)


def test_a_v2_spec_is_never_emulated():
    with pytest.raises(ValueError, match="never emulated"):
        MoESpec(v2=True, emulate=True)


# --- on an sm90 GPU -------------------------------------------------------------------------------


def _moe_step(model, args, grad, fn=None, gm=None):
    gm = gm or fp8conf.trace_joint(model, args)
    return fp8conf.run_joint(gm, model, args, (grad,), fn=fn)


@pytest.mark.fp8_sm90
def test_real_fp8_experts_match_emulation_and_the_definition_on_gpu():
    spec = ExpertsSpec(groups=(32, 0, 16, 48), in_features=64, out_features=32, padding=8)
    real, (x, offs) = build_experts_model(spec, "cuda", convert=_convert)
    emulated, _ = build_experts_model(ExpertsSpec(**{**spec.__dict__, "emulate": True}), "cuda", convert=_convert)
    outs = {}
    for name, model in (("real", real), ("emulated", emulated)):
        xi = x.detach().clone().requires_grad_()
        out = model(xi, offs)
        out.backward(torch.ones_like(out))
        outs[name] = (out, xi.grad, model.experts.weight.grad)
    for a, b in zip(outs["real"], outs["emulated"]):
        assert _rel(a, b) < 1e-2  # same quantization; only the accumulation order differs
        assert torch.isfinite(a).all()
    assert _rel(outs["real"][0], _reference(x.detach(), real.experts.weight.detach(), offs)) < 0.1


def _v2(spec):
    import dataclasses

    return dataclasses.replace(spec, v2=True)


@pytest.mark.fp8_sm90
def test_experts_on_the_second_api_compute_what_the_first_computes_on_gpu():
    from conformance.draw.strategies import grouped_v2_runs

    if not grouped_v2_runs("cuda"):
        pytest.skip(f"torch {torch.__version__} runs no F.scaled_grouped_mm on this GPU")
    spec = ExpertsSpec(groups=(32, 0, 16, 48), in_features=64, out_features=32, padding=8)
    first, (x, offs) = build_experts_model(spec, "cuda", convert=_convert)
    second, _ = build_experts_model(_v2(spec), "cuda", convert=ReferenceBackend().convert_scaled_grouped_experts)
    results = []
    for model in (first, second):
        xi = x.detach().clone().requires_grad_()
        out = model(xi, offs)
        out.backward(torch.ones_like(out))
        results.append((out, xi.grad, model.experts.weight.grad))
    for a, b in zip(*results):  # the same FP8 operands and scales, the same grouped GEMMs
        assert torch.equal(a, b), _rel(a, b)


@pytest.mark.fp8_sm90
@pytest.mark.parametrize("api", ["first", "second"])
@pytest.mark.parametrize("mode", ["full", "regional"])
def test_compiled_moe_graph_matches_eager_on_gpu(mode, api):
    from conformance.draw.moe import v2_grouped_structure
    from conformance.draw.strategies import grouped_v2_runs

    spec = MoESpec(dim=64, hidden=128, experts=4, top_k=2, layers=2, tokens=64, unused=(1,))
    convert = _convert
    if api == "second":
        if not grouped_v2_runs("cuda"):
            pytest.skip(f"torch {torch.__version__} runs no F.scaled_grouped_mm on this GPU")
        spec, convert = _v2(spec), ReferenceBackend().convert_scaled_grouped_experts
    model, args = build_moe_model(spec, "cuda", convert=convert)
    with v2_grouped_structure():  # for the second API: tracing and compiling propagate fake tensors through it
        gm = fp8conf.trace_joint(model, args)
        compiled = fp8conf.compile_joint(gm, mode=mode, strict=True)
        assert any("_scaled_grouped_mm_v2" in str(n.target) for n in gm.graph.nodes) == (api == "second")
        if mode == "regional":
            assert compiled.compiled_nodes, "no region was compiled"
        grad = torch.randn(spec.tokens, spec.dim, device="cuda")
        (out_e,), grads_e = _moe_step(model, args, grad, gm=gm)
        (out_c,), grads_c = _moe_step(model, args, grad, fn=compiled, gm=gm)
    assert _rel(out_c, out_e) < 1e-2
    for key in grads_e:
        assert _rel(grads_c[key], grads_e[key]) < 1e-2, key
