"""MX layers in the suite's drawn models: ``LayerSpec(recipe="mxfp8" | "mxfp8_emulated")``, built
through the backend's ``convert_mx`` (here the reference's, fp8conf's ``MXLinear``)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

import fp8conf
from conformance.backends.reference import ReferenceBackend
from conformance.draw.models import LayerSpec, ModelSpec, build_model
from conformance.draw.strategies import ALL_KINDS, FLOAT8_AND_MX, model_specs
from fp8conf.quantized.mx import MXLinear

convert_mx = ReferenceBackend().convert_mx
convert_scaled_mm = ReferenceBackend().convert_scaled_mm
convert_nvfp4 = ReferenceBackend().convert_nvfp4

_fast = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))


def test_mx_layers_build_as_mxlinear_and_count_like_tensorwise():
    spec = ModelSpec(
        in_features=32,
        layers=(
            LayerSpec(width=64, recipe="mxfp8"),
            LayerSpec(width=64, recipe="mxfp8_emulated", emulate=True, residual=True, calls=2),
            LayerSpec(width=48, recipe="tensorwise"),
        ),
        input_requires_grad=False,
    )
    model, _ = build_model(spec, mx=convert_mx)
    assert isinstance(model.layers[0], MXLinear) and model.layers[0].recipe == "mxfp8"
    assert isinstance(model.layers[1], MXLinear) and model.layers[1].emulate
    assert spec.quantized_modules() == {
        "layers.0": ("mxfp8_linear", "mxfp8", False),
        "layers.1": ("mxfp8_linear", "mxfp8_emulated", True),
        "layers.2": ("float8_linear", "tensorwise", False),
    }
    found = fp8conf.find_quantized_modules(model)
    assert {k: (c.kind, c.recipe, c.emulate) for k, c in found.items()} == spec.quantized_modules()
    # the first call's input needs no gradient: no grad_input matmul; emulated: none at all
    assert spec.expected_compute_counts() == {
        ("layers.0", "forward"): 1,
        ("layers.0", "backward"): 1,
        ("layers.2", "forward"): 1,
        ("layers.2", "backward"): 2,
    }


def test_an_mx_model_needs_the_backend_to_convert_it():
    spec = ModelSpec(in_features=32, layers=(LayerSpec(width=32, recipe=None), LayerSpec(width=32, recipe="mxfp8")))
    with pytest.raises(ValueError, match=r"MX layers layers\.1 \(mxfp8\): pass mx=backend.convert_mx"):
        build_model(spec)
    converted = []
    build_model(spec, mx=lambda model, *, module_filter_fn, recipe: converted.append(
        (recipe, [fqn for fqn, m in model.named_modules() if fqn and module_filter_fn(m, fqn)])
    ))
    assert converted == [("mxfp8", ["layers.1"])]


def test_an_mx_reproducer_builds_the_model_with_the_named_backend():
    spec = ModelSpec(in_features=32, layers=(LayerSpec(width=32, recipe="mxfp8"),))
    code = spec.to_python(backend="conformance.backends.reference:ReferenceBackend")
    assert "from conformance.backends.reference import ReferenceBackend\n" in code
    namespace = {}
    exec(code, namespace)
    assert isinstance(namespace["model"].layers[0], MXLinear)
    float8 = ModelSpec(in_features=16, layers=(LayerSpec(width=16),))
    assert float8.to_python(backend="conformance.backends.reference:ReferenceBackend") == float8.to_python()
    assert "convert_mx" not in float8.to_python()


@pytest.mark.parametrize(
    "layers, message",
    [
        ((LayerSpec(width=48, recipe="mxfp8"),), "multiples of 32"),
        ((LayerSpec(width=32, recipe=None), LayerSpec(width=32, recipe="mxfp8", adapter=True)), "no nested adapter"),
        ((LayerSpec(width=32, recipe="mxfp8", emulate=True),), "emulate=False"),
        ((LayerSpec(width=32, recipe="mxfp8_emulated"),), "emulate=True"),
    ],
)
def test_invalid_mx_layers_are_rejected(layers, message):
    with pytest.raises(ValueError, match=message):
        ModelSpec(in_features=32, layers=layers)


def test_mx_needs_in_features_multiple_of_32():
    with pytest.raises(ValueError, match="multiples of 32"):
        ModelSpec(in_features=16, layers=(LayerSpec(width=32, recipe="mxfp8"),))


@_fast
@given(spec=model_specs())
def test_default_draws_no_mx(spec):
    assert all(kind == "float8_linear" for kind, _, _ in spec.quantized_modules().values())


@_fast
@given(spec=model_specs(kinds=ALL_KINDS))
def test_mx_draws_are_valid_and_build(spec):
    model, _ = build_model(spec, mx=convert_mx, scaled_mm=convert_scaled_mm, nvfp4=convert_nvfp4)
    found = fp8conf.find_quantized_modules(model)
    assert {k: (c.kind, c.recipe, c.emulate) for k, c in found.items()} == spec.quantized_modules()


def test_mx_draws_hold_mx_layers_about_half_the_time():
    seen = []

    @settings(max_examples=40, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(spec=model_specs(kinds=FLOAT8_AND_MX, emulate=False))  # as for a backend claiming mx only
    def draw(spec):
        seen.append(any(kind == "mxfp8_linear" for kind, _, _ in spec.quantized_modules().values()))

    draw()
    assert 0.25 <= sum(seen) / len(seen) <= 0.75
