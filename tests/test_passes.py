"""Unit tests of fp8conf's passes on models converted by real TorchAO, every recipe, emulate on/off."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import fp8conf
from conformance.draw.models import LayerSpec, ModelSpec, build_model
from conformance.draw.strategies import runnable_recipes

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.fp8_sm89)]


def _spec(recipe, emulate, *, input_requires_grad=True):
    # Layer 1 is a plain Linear, layer 2 is called twice: provenance must skip one, count the other twice.
    return ModelSpec(
        in_features=32,
        layers=(
            LayerSpec(32, recipe, emulate, bias=True, activation="relu"),
            LayerSpec(32, None, residual=True),
            LayerSpec(32, recipe, emulate, calls=2, activation="gelu"),
            LayerSpec(16, recipe, emulate, activation="none"),
        ),
        input_requires_grad=input_requires_grad,
    )


@pytest.fixture(scope="module")
def traced():
    cache = {}

    def get(recipe, emulate, device="cpu", input_requires_grad=True):
        key = (recipe, emulate, device, input_requires_grad)
        if key not in cache:
            spec = _spec(recipe, emulate, input_requires_grad=input_requires_grad)
            model, args = build_model(spec, device=device)
            cache[key] = (spec, model, args, fp8conf.trace_joint(model, args))
        return cache[key]

    return get


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("emulate", [False, True], ids=["real", "emulated"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_trace_validate_and_run_match_eager(traced, recipe, emulate, device):
    spec, model, args, gm = traced(recipe, emulate, device)
    if not emulate and recipe not in runnable_recipes(device):
        # Tracing and validation hold everywhere; only running the graph needs the kernel.
        fp8conf.validate_fp8_graph(gm, strict=True)
        pytest.skip(f"this torch's {device} _scaled_mm cannot run {recipe} scales (torch 2.11 CPU: tensorwise only)")
    report = fp8conf.validate_fp8_graph(gm, strict=True)
    assert report.ok and report.compute_counts == spec.expected_compute_counts(), report.summary
    computes = [n for n in gm.graph.nodes if fp8conf.is_fp8_compute(n)]
    assert all(fp8conf.get_provenance(n) is not None for n in computes)
    assert bool(computes) is not emulate

    grad_out = torch.randn(spec.batch, 16, device=device, generator=torch.Generator(device).manual_seed(0))
    outputs, grads = fp8conf.run_joint(gm, model, args, (grad_out,))
    x = args[0].detach().clone().requires_grad_(True)
    model.zero_grad()
    expected = model(x)
    expected.backward(grad_out)
    # The joint graph runs the same aten ops as eager, in the same order: bitwise equal.
    assert torch.equal(outputs[0], expected)
    for name, param in model.named_parameters():
        assert torch.equal(grads[name], param.grad), name
    assert torch.equal(grads["input.0"], x.grad)


@pytest.mark.parametrize("recipe", RECIPES)
def test_provenance_names_module_recipe_and_call(traced, recipe):
    _, _, _, gm = traced(recipe, False)
    seen = {(p.module_fqn, p.recipe, p.call) for n in gm.graph.nodes if (p := fp8conf.get_provenance(n))}
    assert seen == {("layers.0", recipe, 0), ("layers.2", recipe, 0), ("layers.2", recipe, 1), ("layers.3", recipe, 0)}
    # The annotation fp8conf used while tracing is gone from node.meta["custom"].
    assert not any("fp8conf.module" in n.meta.get("custom", {}) for n in gm.graph.nodes)


def test_first_layer_without_input_grad_issues_no_grad_input_matmul(traced):
    spec, _, _, gm = traced("tensorwise", False, input_requires_grad=False)
    report = fp8conf.validate_fp8_graph(gm)
    assert report.compute_counts[("layers.0", "backward")] == 1  # grad_weight only
    assert report.compute_counts == spec.expected_compute_counts()


def test_rowwise_with_gw_hp_keeps_grad_weight_in_high_precision(traced):
    _, _, _, gm = traced("rowwise_with_gw_hp", False)
    backward_mm = [
        n for n in gm.graph.nodes
        if str(n.target) == "aten.mm.default" and (p := fp8conf.get_provenance(n)) and p.module_fqn == "layers.3"
    ]
    assert backward_mm, "grad_weight of rowwise_with_gw_hp is a plain mm attributed to its module"
    counts = fp8conf.validate_fp8_graph(gm).compute_counts
    assert counts[("layers.3", "forward")] == 1 and counts[("layers.3", "backward")] == 1


def test_op_roles(traced):
    _, _, _, gm = traced("tensorwise", False)
    roles = fp8conf.op_roles(gm.graph)
    by_role = {role: [n for n, r in roles.items() if r is role] for role in fp8conf.OpRole}
    assert all(str(n.target) == "aten._scaled_mm.default" for n in by_role[fp8conf.OpRole.COMPUTE])
    assert all("float8" in str(n.meta["val"].dtype) for n in by_role[fp8conf.OpRole.CAST])
    assert by_role[fp8conf.OpRole.AMAX] and by_role[fp8conf.OpRole.SCALE]
    assert not by_role[fp8conf.OpRole.INPUT_BOUNDARY]  # a joint graph takes no FP8 input


def test_scaled_op_with_fp8_scale_but_float_operands_is_not_compute():
    graph = torch.fx.Graph()
    fake = torch._subclasses.FakeTensorMode()
    with fake:
        values = {
            "a": torch.empty(16, 32),
            "b": torch.empty(32, 16),
            "scale": torch.empty((), dtype=torch.float8_e4m3fn),
        }
    nodes = {}
    for name, value in values.items():
        nodes[name] = graph.placeholder(name)
        nodes[name].meta["val"] = value
    mm = graph.call_function(torch.ops.aten._scaled_mm.default, (nodes["a"], nodes["b"], nodes["scale"], nodes["scale"]))
    assert not fp8conf.is_fp8_compute(mm)
    assert fp8conf.classify_node(mm) is fp8conf.OpRole.OTHER
    assert fp8conf.classify_node(nodes["scale"]) is fp8conf.OpRole.INPUT_BOUNDARY


def test_recipe_recognition_names_custom_configs():
    from torchao.float8 import Float8LinearConfig

    from fp8conf.quantized.float8 import recognize_float8_recipe

    for recipe in RECIPES:
        config = Float8LinearConfig.from_recipe_name(recipe)
        assert recognize_float8_recipe(config) == recipe
        assert recognize_float8_recipe(dataclasses.replace(config, emulate=True)) == recipe
    custom = dataclasses.replace(Float8LinearConfig.from_recipe_name("tensorwise"), round_scales_to_power_of_2=True)
    assert recognize_float8_recipe(custom) == "custom"


def test_errors_are_one_tree_of_sibling_branches():
    from conformance.api import errors as contract

    branches = [
        fp8conf.FP8ConfigError, fp8conf.FP8TraceError, fp8conf.FP8ValidationError, fp8conf.FP8RegionError,
        fp8conf.FP8GraphSplitError, fp8conf.ArtifactError, fp8conf.MXArgumentError, fp8conf.MXConversionError,
    ]
    for branch in branches:
        assert issubclass(branch, fp8conf.FP8Error)
        assert [other for other in branches if other is not branch and issubclass(branch, other)] == [], branch
    # Catching a stage's error never swallows a split or region failure.
    for error in (fp8conf.FP8GraphSplitError, fp8conf.IncompleteRegionError, fp8conf.RegionCompileError):
        assert not issubclass(error, fp8conf.FP8ValidationError) and not issubclass(error, contract.ValidationFailure)
    assert issubclass(fp8conf.FP8ValidationError, contract.ValidationFailure)
    assert issubclass(fp8conf.FP8GraphSplitError, contract.SplitFailure)
    assert issubclass(fp8conf.FingerprintMismatchError, fp8conf.ArtifactError)
    assert issubclass(fp8conf.FingerprintMismatchError, contract.FingerprintMismatch)
    assert issubclass(fp8conf.FP8ConfigError, ValueError) and issubclass(fp8conf.FP8ConfigError, TypeError)
    assert set(fp8conf.errors.__all__) <= set(fp8conf.__all__)
    located = fp8conf.IncompleteRegionError("x", module_fqn="layers.0", pass_name="backward")
    assert (located.module_fqn, located.pass_name, located.node_name, located.property_id) == ("layers.0", "backward", None, "REG-004")


def test_the_joint_signature_is_computed_once_when_tracing(traced):
    _, model, args, gm = traced("tensorwise", False)
    signature = fp8conf.joint_signature(gm)
    assert signature is gm.meta["fp8conf_joint_signature"]
    placeholders = gm.graph.find_nodes(op="placeholder")
    assert len(signature.inputs) == len(placeholders)
    params = {fqn for fqn, _ in model.named_parameters()}
    assert {i.target for i in signature.inputs if i.kind == "param"} == params
    assert [i.index for i in signature.inputs if i.kind == "input"] == [0]
    assert [i.index for i in signature.inputs if i.kind == "tangent"] == [0]
    assert [i.is_tangent for i in signature.inputs] == sorted(i.is_tangent for i in signature.inputs)  # primals first
    outputs = [o for o in signature.outputs if o is not None]
    assert [o.index for o in outputs if o.kind == "output"] == [0]
    assert {o.target for o in outputs if o.kind == "param_grad"} == params
    assert [o.target for o in outputs if o.kind == "input_grad"] == ["input.0"]
    # Rewrites that keep gm.meta keep it; descriptors are not read again.
    copy = fp8conf.copy_graph_module(gm)
    for node in copy.graph.find_nodes(op="placeholder"):
        node.meta.pop("desc")
    grad = (torch.ones(16, 16),)
    (out,), grads = fp8conf.run_joint(copy, model, args, grad)
    (expected,), expected_grads = fp8conf.run_joint(gm, model, args, grad)
    assert torch.equal(out, expected) and grads.keys() == expected_grads.keys() == params | {"input.0"}
    copy.meta.pop("fp8conf_joint_signature")
    with pytest.raises(fp8conf.FP8TraceError, match="joint signature"):
        fp8conf.run_joint(copy, model, args, grad)


def test_compile_joint_rejects_unknown_modes(traced):
    _, _, _, gm = traced("tensorwise", False)
    with pytest.raises(fp8conf.FP8ConfigError, match="'full', 'regional'"):
        fp8conf.compile_joint(gm, mode="fast")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_compile_joint_refuses_cuda_graphs_without_cuda(traced):
    _, _, _, gm = traced("tensorwise", False)
    with pytest.raises(fp8conf.FP8ConfigError, match="CUDA"):
        fp8conf.compile_joint(gm, mode="full", cudagraph=True)


def test_bad_inputs_get_clear_errors():
    with pytest.raises(fp8conf.FP8TraceError, match="expects a torch.nn.Module"):
        fp8conf.trace_joint(lambda x: x, (torch.randn(2),))
    model, _ = build_model(_spec("tensorwise", False))
    with pytest.raises(fp8conf.FP8TraceError, match=r"shapes \[\(16, 7\)\]"):
        fp8conf.trace_joint(model, (torch.randn(16, 7),))


def test_model_without_quantized_modules():
    gm = fp8conf.trace_joint(torch.nn.Linear(16, 16), (torch.randn(4, 16),))
    with pytest.raises(fp8conf.NoQuantizedModulesError, match="no quantized module"):
        fp8conf.validate_fp8_graph(gm, strict=True)
    with pytest.warns(fp8conf.FP8ValidationWarning, match="VAL-001"):
        report = fp8conf.validate_fp8_graph(gm, strict=False)
    assert "0 quantized module" in report.summary


def test_strict_error_names_module_pass_and_all_findings(traced):
    from conformance.observe.graphs import copy_graph_module
    from conformance.judge.rewrites import lower_to_high_precision

    _, _, _, gm = traced("rowwise", False)
    gm = copy_graph_module(gm)
    for node in [n for n in gm.graph.nodes if fp8conf.is_fp8_compute(n)]:
        if fp8conf.get_provenance(node).module_fqn == "layers.3":
            lower_to_high_precision(gm, node)
    with pytest.raises(fp8conf.UnsupportedLoweringError) as caught:
        fp8conf.validate_fp8_graph(gm, strict=True)
    error = caught.value
    assert (error.module_fqn, error.pass_name) == ("layers.3", "forward")
    assert "'layers.3'" in str(error) and "forward pass" in str(error) and "aten.mm" in str(error)
    assert {f.pass_name for f in error.findings} == {"forward", "backward"}
    with warnings.catch_warnings(record=True) as caught_warnings:
        warnings.simplefilter("always")
        report = fp8conf.validate_fp8_graph(gm, strict=False)
    assert len(caught_warnings) == len(report.findings) == 2
