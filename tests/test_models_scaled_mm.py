"""Linears on ``F.scaled_mm`` in the suite's drawn models: ``LayerSpec(recipe="scaled_mm_tensorwise"
| "scaled_mm_rowwise")``, built through the backend's ``convert_scaled_mm`` (the reference's,
fp8conf's ``ScaledMMLinear``; the makefx trainer's own), drawn only for a backend that claims
``scaled_mm_v2``."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

import fp8conf
from conformance.backends.makefx import MakeFxBackend
from conformance.backends.reference import ReferenceBackend
from conformance.run.harness import supported_kinds
from conformance.draw.models import LayerSpec, ModelSpec, build_model
from conformance.draw.strategies import ALL_KINDS, FLOAT8_KIND, MX_KIND, MX_SWIZZLED_KIND, NVFP4_KIND, SCALED_MM_KIND, Constraints, corpus, model_specs
from fp8conf.quantized.scaled_mm import ScaledMMLinear, has_scaled_mm_v2

pytestmark = pytest.mark.skipif(not has_scaled_mm_v2(), reason="this torch has no F.scaled_mm (2.12 and newer)")

reference = ReferenceBackend()
_fast = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))


def _kinds(spec) -> set[str]:
    return {kind for kind, _, _ in spec.quantized_modules().values()}


def test_scaled_mm_layers_build_through_the_backend_and_count_like_tensorwise():
    spec = ModelSpec(
        in_features=32,
        layers=(LayerSpec(width=16, recipe="scaled_mm_rowwise"), LayerSpec(width=16, recipe="scaled_mm_tensorwise", calls=2)),
        input_requires_grad=False,
    )
    model, _ = build_model(spec, scaled_mm=reference.convert_scaled_mm)
    assert isinstance(model.layers[0], ScaledMMLinear) and model.layers[0].recipe == "rowwise"
    assert spec.quantized_modules() == {
        "layers.0": ("float8_scaled_mm_linear", "rowwise", False),
        "layers.1": ("float8_scaled_mm_linear", "tensorwise", False),
    }
    found = fp8conf.find_quantized_modules(model)
    assert {k: (c.kind, c.recipe, c.emulate) for k, c in found.items()} == spec.quantized_modules()
    assert spec.expected_compute_counts() == {
        ("layers.0", "forward"): 1, ("layers.0", "backward"): 1,  # no grad_input: its input needs none
        ("layers.1", "forward"): 2, ("layers.1", "backward"): 4,
    }


def test_a_scaled_mm_model_needs_the_backend_and_prints_with_it():
    spec = ModelSpec(in_features=32, layers=(LayerSpec(width=32, recipe="mxfp8"), LayerSpec(width=16, recipe="scaled_mm_rowwise")))
    with pytest.raises(ValueError, match=r"scaled-matmul layers layers\.1 \(scaled_mm_rowwise\): pass scaled_mm="):
        build_model(spec, mx=reference.convert_mx)
    code = spec.to_python(backend="conformance.backends.reference:ReferenceBackend")
    assert "build_model(spec, mx=backend.convert_mx, scaled_mm=backend.convert_scaled_mm)" in code
    namespace = {}
    exec(code, namespace)
    assert isinstance(namespace["model"].layers[1], ScaledMMLinear)


@pytest.mark.parametrize(
    "layers, message",
    [
        ((LayerSpec(width=32, recipe="scaled_mm_rowwise", adapter=True),), "no nested adapter"),
        ((LayerSpec(width=32, recipe="scaled_mm_tensorwise", emulate=True),), "never emulated"),
    ],
)
def test_invalid_scaled_mm_layers_are_rejected(layers, message):
    with pytest.raises(ValueError, match=message):
        ModelSpec(in_features=32, layers=layers)


def test_only_a_backend_claiming_scaled_mm_v2_is_shown_such_layers():
    assert SCALED_MM_KIND in supported_kinds(reference)
    assert SCALED_MM_KIND in supported_kinds(MakeFxBackend())

    class NoV2(ReferenceBackend):
        capabilities = ReferenceBackend.capabilities - {"scaled_mm_v2"}

    # Its swizzled MX linears are declared in mx_recipes, apart from the scaled-matmul linears.
    assert supported_kinds(NoV2()) == (FLOAT8_KIND, MX_KIND, NVFP4_KIND, MX_SWIZZLED_KIND)
    without = corpus(Constraints(kinds=(FLOAT8_KIND, MX_KIND)), n=25)
    assert not any(SCALED_MM_KIND in _kinds(s) for s in without)


@pytest.mark.parametrize(
    "c",
    [Constraints(kinds=ALL_KINDS, emulate=True), Constraints(kinds=ALL_KINDS, recipes=("rowwise_with_gw_hp",))],
)
def test_no_scaled_mm_layer_where_the_constraints_exclude_it(c):
    assert not c.admits(ModelSpec(in_features=32, layers=(LayerSpec(width=32, recipe="scaled_mm_rowwise"),)))
    assert not any(SCALED_MM_KIND in _kinds(s) for s in corpus(c, n=25))


def test_a_property_taking_two_models_gets_one_of_each_kind():
    two = corpus(Constraints(kinds=(FLOAT8_KIND, SCALED_MM_KIND)), n=2)
    assert [SCALED_MM_KIND in _kinds(s) for s in two].count(True) >= 1
    assert any(FLOAT8_KIND in _kinds(s) for s in two)


def test_a_backend_claiming_only_scaled_mm_v2_draws_such_models_about_half_the_time():
    models = corpus(Constraints(kinds=(FLOAT8_KIND, SCALED_MM_KIND)), n=25)
    share = sum(SCALED_MM_KIND in _kinds(s) for s in models) / len(models)
    assert 0.25 <= share <= 0.75, share


@_fast
@given(spec=model_specs(kinds=ALL_KINDS))
def test_drawn_models_build_with_the_backends_converters(spec):
    model, _ = build_model(spec, mx=reference.convert_mx, scaled_mm=reference.convert_scaled_mm, nvfp4=reference.convert_nvfp4)
    found = fp8conf.find_quantized_modules(model)
    assert {k: (c.kind, c.recipe, c.emulate) for k, c in found.items()} == spec.quantized_modules()
