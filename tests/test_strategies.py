"""The model strategies: constraints hold for every drawn model, and a derandomized run draws
every property's models from one shared corpus, the same in every process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance.draw.models import LayerSpec, ModelSpec
from conformance.draw.strategies import (
    ALL_KINDS, CORPUS_SIZE, FLOAT8_RECIPES, Constraints, corpus, float8_left_out, served, served_spec, supported_kinds,
)
from conformance.draw.strategies import _drawn_specs  # the strategy behind the corpus

pytest_plugins = ["pytester"]

constraints = st.builds(
    Constraints,
    max_layers=st.integers(1, 3),
    recipes=st.sampled_from([FLOAT8_RECIPES, ("tensorwise",), ("rowwise", "rowwise_with_gw_hp")]),
    emulate=st.sampled_from([None, True, False]),
    reuse=st.booleans(),
    nesting=st.booleans(),
    require_reuse=st.booleans(),
    require_nesting=st.booleans(),
    kinds=st.sampled_from([("float8_linear",), ("float8_linear", "float8_scaled_mm_linear"), ALL_KINDS]),
    # What a backend's own float8 linears narrow a property's float8 layers to (served()).
    float8_recipes=st.sampled_from([None, ("rowwise",), ("rowwise", "rowwise_with_gw_hp")]),
    float8_emulation=st.booleans(),
).filter(
    lambda c: (c.reuse or not c.require_reuse) and (c.nesting or not c.require_nesting)
    and set(c.float8_choices) <= set(c.recipes) and bool(c.float8_choices) and (c.float8_emulation or c.emulate is not True)
)


@given(c=constraints, data=st.data())
def test_every_drawn_model_is_admitted_by_its_constraints(c, data):
    spec = data.draw(_drawn_specs(c), label="spec")
    assert c.admits(spec), f"{c} does not admit the model it drew: {spec!r}"


def _spec(*layers: LayerSpec, in_features: int = 32) -> ModelSpec:
    return ModelSpec(in_features=in_features, layers=layers)


REAL = LayerSpec(32, "tensorwise")


@pytest.mark.parametrize(
    "c, spec",
    [
        (Constraints(), _spec(LayerSpec(32, None))),  # no quantized layer
        (Constraints(max_layers=1), _spec(REAL, REAL)),
        (Constraints(recipes=("tensorwise",)), _spec(LayerSpec(32, "rowwise"))),
        (Constraints(emulate=False), _spec(REAL, LayerSpec(32, "tensorwise", emulate=True))),
        (Constraints(emulate=True), _spec(REAL)),
        (Constraints(reuse=False), _spec(LayerSpec(32, None, calls=2), REAL)),
        (Constraints(nesting=False), _spec(LayerSpec(32, "tensorwise", adapter=True))),
        (Constraints(require_reuse=True), _spec(LayerSpec(32, None, calls=2), REAL)),
        (Constraints(require_nesting=True), _spec(REAL)),
        (Constraints(require_reuse=True, require_nesting=True), _spec(LayerSpec(32, "tensorwise", calls=2), LayerSpec(32, "tensorwise", adapter=True))),
        (Constraints(), _spec(LayerSpec(32, "mxfp8"))),  # float8 kinds only
        (Constraints(kinds=("mxfp8_linear",)), _spec(REAL)),
        (Constraints(kinds=("float8_linear", "mxfp8_linear")), _spec(LayerSpec(32, "scaled_mm_rowwise"))),
        (Constraints(kinds=ALL_KINDS, recipes=("tensorwise",)), _spec(LayerSpec(32, "scaled_mm_rowwise"))),
        (Constraints(kinds=ALL_KINDS, emulate=True), _spec(LayerSpec(32, "scaled_mm_tensorwise"))),
        (Constraints(float8_recipes=("rowwise",)), _spec(REAL)),  # a backend's own float8 linears lack tensorwise
        (Constraints(float8_emulation=False), _spec(LayerSpec(32, "rowwise", emulate=True))),
        (Constraints(float8_recipes=("rowwise",)), _spec(LayerSpec(32, "rowwise", adapter=True, adapter_recipe="tensorwise"))),
        (Constraints(kinds=("float8_linear", "mxfp8_linear")), _spec(LayerSpec(32, "mxfp8_swizzled"))),  # drawn apart
        (Constraints(kinds=("float8_linear", "mxfp8_swizzled")), _spec(LayerSpec(32, "mxfp8"))),
        (Constraints(kinds=ALL_KINDS, emulate=True), _spec(LayerSpec(32, "mxfp8_swizzled"))),  # never emulated
    ],
)
def test_constraints_reject_models_they_cannot_draw(c, spec):
    assert not c.admits(spec)


def test_the_corpus_serves_distinct_admitted_models():
    c = Constraints(kinds=ALL_KINDS, emulate=False, require_reuse=True, require_nesting=True)
    got = corpus(c, n=25)
    assert len(got) == len(set(got)) == 25
    assert all(c.admits(spec) for spec in got)
    general = corpus(Constraints(kinds=ALL_KINDS), n=CORPUS_SIZE)
    assert len(set(general)) > 200, "the shared corpus should hold well over 200 distinct models"
    assert {layer.recipe for spec in general for layer in spec.layers} >= set(FLOAT8_RECIPES) | {
        "mxfp8", "mxfp8_emulated", "scaled_mm_tensorwise", "scaled_mm_rowwise", "nvfp4", "nvfp4_emulated", None,
    }


def test_properties_with_the_same_constraints_share_models_and_others_overlap():
    everything, real = corpus(Constraints(kinds=ALL_KINDS)), corpus(Constraints(kinds=ALL_KINDS, emulate=False))
    assert everything == corpus(Constraints(kinds=ALL_KINDS))
    shared = set(everything) & set(real)
    # Both take the first admitted models of one corpus: every real model among the first 25 is shared.
    assert shared == {s for s in everything if Constraints(kinds=ALL_KINDS, emulate=False).admits(s)}
    assert shared


_PRINT_CORPUS = (
    "from conformance.draw.strategies import Constraints, ALL_KINDS, corpus\n"
    "import json\n"
    "print(json.dumps([repr(s) for s in corpus(Constraints(kinds=ALL_KINDS, emulate=False), n=25)]))\n"
)


def test_the_corpus_is_the_same_in_every_process():
    runs = []
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", _PRINT_CORPUS], env=env, capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert runs[0] == runs[1]
    assert runs[0] == [repr(s) for s in corpus(Constraints(kinds=ALL_KINDS, emulate=False), n=25)]


# fp8conf's profiles exist in a run without --fp8-backend only where a conftest asks for them.
PROFILES_CONFTEST = """
import pytest
from conformance import plugin

@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    plugin.register_profiles()
    plugin.load_profile(config)
"""


def test_a_derandomized_profile_draws_from_the_corpus_and_others_draw_afresh(pytester):
    pytester.makeconftest(PROFILES_CONFTEST)
    pytester.makepyfile(
        """
        from hypothesis import given, settings, strategies as st
        from conformance.draw.strategies import ALL_KINDS, Constraints, corpus, model_specs

        seen = []

        # The first use in the process, from inside a test's body: the corpus is drawn then.
        @given(data=st.data())
        def test_draw_in_the_body(data):
            data.draw(model_specs(max_layers=1, reuse=False, nesting=False, emulate=False))

        @given(spec=model_specs(kinds=ALL_KINDS))
        def test_draw(spec):
            seen.append(spec)

        def test_check():
            expected = set(corpus(Constraints(kinds=ALL_KINDS), n=settings.default.max_examples))
            print("FROM-CORPUS", set(seen) <= expected, len(set(seen)))
        """
    )
    ci = pytester.runpytest_subprocess("--hypothesis-profile=fp8conf-ci", "-s", "-p", "no:cacheprovider")
    ci.stdout.fnmatch_lines(["*FROM-CORPUS True 25*"])
    ci.assert_outcomes(passed=3)
    dev = pytester.runpytest_subprocess("--hypothesis-profile=fp8conf-thorough", "-s", "-p", "no:cacheprovider")
    dev.stdout.fnmatch_lines(["*FROM-CORPUS False*"])
    dev.assert_outcomes(passed=3)


# --- a backend's own float8 linears (float8_modules) --------------------------------------------

OWN = {"float8_recipes": ("rowwise", "rowwise_with_gw_hp"), "float8_emulation": False}


def test_a_backends_own_float8_linears_get_only_their_recipes_and_no_emulation():
    with supported_kinds(ALL_KINDS, **OWN):
        c = served(Constraints())
        models = corpus(c, n=25)
    assert c.float8_recipes == OWN["float8_recipes"] and not c.float8_emulation
    assert len(models) == 25
    float8 = [(recipe, emulate) for m in models for kind, recipe, emulate in m.quantized_modules().values() if kind == "float8_linear"]
    assert float8 and {r for r, _ in float8} <= set(OWN["float8_recipes"]) and not any(e for _, e in float8)
    # TorchAO's float8 linears (no backend of its own) keep every recipe and emulation.
    assert served(Constraints()) == Constraints()


@pytest.mark.parametrize("c", [Constraints(recipes=("tensorwise",)), Constraints(emulate=True)])
def test_a_property_asking_only_for_what_the_backend_lacks_is_not_supported(c):
    from conformance.run.gating import NOT_SUPPORTED

    with supported_kinds(("float8_linear",), **OWN), pytest.raises(pytest.skip.Exception) as skipped:
        served(c)
    assert str(skipped.value).startswith(NOT_SUPPORTED), skipped.value
    assert float8_left_out(c) is None  # outside the backend's run: TorchAO has it all


def test_a_fixed_model_is_built_with_the_backends_recipes():
    fixed = ModelSpec(32, (LayerSpec(32, "tensorwise", adapter=True, adapter_recipe="rowwise_with_gw_hp", adapter_emulate=True),
                           LayerSpec(32, "rowwise", emulate=True), LayerSpec(32, "mxfp8")))
    with supported_kinds(ALL_KINDS, **OWN):
        served_model = served_spec(fixed)
    assert [(l.recipe, l.emulate, l.adapter_recipe, l.adapter_emulate) for l in served_model.layers] == [
        ("rowwise", False, "rowwise_with_gw_hp", False), ("rowwise", False, "parent", None), ("mxfp8", False, "parent", None),
    ]
    assert served_spec(fixed) == fixed


def _backend(**attributes):
    from conformance.backends.reference import ReferenceBackend

    return type("Declared", (ReferenceBackend,), {"name": "declared", **attributes})()


@pytest.mark.parametrize("mx_recipes, wanted, lacked", [
    (frozenset({"mxfp8", "mxfp8_emulated"}), "mxfp8_linear", "mxfp8_swizzled"),
    (frozenset({"mxfp8_swizzled"}), "mxfp8_swizzled", "mxfp8_linear"),
])
def test_mx_layers_are_drawn_of_the_declared_recipes_and_a_property_asking_for_others_is_not_supported(mx_recipes, wanted, lacked):
    from conformance.run.harness import supported_kinds as kinds_of
    from conformance.run.gating import NOT_SUPPORTED

    kinds = kinds_of(_backend(mx_recipes=mx_recipes))
    assert wanted in kinds and lacked not in kinds
    with supported_kinds(kinds):
        models = corpus(served(Constraints(kinds=ALL_KINDS)), n=25)
        with pytest.raises(pytest.skip.Exception) as skipped:
            served(Constraints(kinds=(lacked,)))
    recipes = {r for m in models for kind, r, _e in m.quantized_modules().values() if kind == "mxfp8_linear"}
    assert recipes and recipes <= set(mx_recipes)
    assert str(skipped.value).startswith(NOT_SUPPORTED) and "mx_recipes do not declare" in str(skipped.value)


@pytest.mark.parametrize("mx_recipes", [frozenset(), frozenset({"mxfp8"}), frozenset({"mxfp8_rceil"}), "mxfp8_swizzled"])
def test_a_backend_declaring_mx_recipes_the_contract_lacks_is_refused_at_class_creation(mx_recipes):
    with pytest.raises(TypeError, match="mx_recipes must be a non-empty set"):
        _backend(mx_recipes=mx_recipes)


def test_a_drawn_model_is_initialised_as_after_torch_manual_seed():
    # build_model seeds the CPU generator alone where torch has no lazily seeded device: the
    # parameters must be those torch.manual_seed(seed) gives.
    import torch

    from conformance.draw.models import build_model

    spec = ModelSpec(in_features=16, layers=(LayerSpec(width=32, recipe=None), LayerSpec(width=16, recipe=None)), seed=7)
    torch.manual_seed(123)  # another state before the build
    model = build_model(spec)[0]
    torch.manual_seed(spec.seed)
    expected, built = type(model)(spec).state_dict(), model.state_dict()
    assert built.keys() == expected.keys() and all(torch.equal(built[k], expected[k]) for k in built)
