"""The model families (conformance/draw/families.py): which properties run which family, and that
they do run them, first, in every profile.

A family is run by a property as an explicit Hypothesis example (``family_examples``), so a
defect that needs attention, equal leaf names under two parents, a reused module or a model's
own annotations is shown to every property whose rule it can break, not left to a draw.
"""

from __future__ import annotations

import collections
import importlib
import os
import sys
from pathlib import Path

import pytest
import torch  # imported before the in-process pytester run, which would otherwise unload it
# The in-process run compiles (NUM-002): Dynamo's debug backends register themselves by name when
# this module is first imported; imported inside the run, it would be unloaded after it and
# register again at the next torch.compile of this worker ("duplicate name").
import torch._dynamo.repro.after_dynamo  # noqa: F401
import torch._inductor.compile_fx  # noqa: F401

import conformance
import conformance.run.harness  # noqa: F401  (imported before the in-process run, which patches its evidence)
from conformance.observe import evidence
from conformance.draw.families import FAMILIES, FamilySpec, user_annotations
from conformance.draw.family_examples import family_specs
from conformance.observe.graphs import trace_with_oracle

pytest_plugins = ["pytester"]

PROPERTIES = Path(conformance.__file__).resolve().parent / "properties"
_ALL = set(FAMILIES)
_REAL_AND_EMULATED = {"llama", "siblings"}
#: Per area, the families each property runs first: every family its constraints admit. PROV-006
#: asks for a module both reused and nesting another, which no family has (the ``siblings``'
#: reused module meets the other rules, REG-002's one region per call among them); EMU-002 for
#: emulated and real modules in one model (``llama`` and ``siblings`` with ``emulate=None``).
#: NUM compiles with Inductor in every example, so its properties run the ``llama`` family only,
#: without its MLP (``LLAMA_ATTENTION``: attention through SDPA with grouped-query attention,
#: norms, the residual stream, the embedding and the high-precision head; a cold full compile of
#: the whole family costs about 25 s on 2 cores, without the MLP about 14 s). The areas left out
#: (FPR, E8M0, MOE) draw models of their own.
DRAWN = {
    "PROV": {"PROV-001": _ALL, "PROV-002": _ALL, "PROV-003": _ALL, "PROV-004": _ALL, "PROV-005": _ALL, "PROV-006": set()},
    "VAL": {f"VAL-00{i}": _ALL for i in range(1, 8)},
    "EMU": {"EMU-001": _ALL, "EMU-002": _REAL_AND_EMULATED, "EMU-003": set()},
    "REG": {f"REG-00{i}": _ALL for i in range(1, 8)},
    "BND": {f"BND-00{i}": _ALL for i in range(1, 8)},
    "NUM": {"NUM-001": {"llama"}, "NUM-002": {"llama"}, "NUM-003": {"llama"}, "NUM-004": set()},
}
#: The families each area runs on some property: all of them, but for NUM.
COVERED = {area: {"llama"} if area == "NUM" else _ALL for area in DRAWN}


def _property_tests():
    """``{property ID: test function}`` of the suite's property modules."""
    found = {}
    for path in sorted(PROPERTIES.glob("test_*.py")):
        module = importlib.import_module(f"conformance.properties.{path.stem}")
        for name, test in vars(module).items():
            for mark in getattr(test, "pytestmark", ()):
                if name.startswith("test_") and mark.name == "fp8_property":
                    found[mark.args[0]] = test
    return found


def test_every_area_runs_the_families_its_rules_can_meet():
    tests = _property_tests()
    for area, expected in DRAWN.items():
        seen = {pid: set(getattr(tests[pid], "fp8_families", ())) for pid in expected}
        assert seen == expected, f"{area}: families run first per property {seen}, expected {expected}"
        covered = set().union(*seen.values())
        assert covered == COVERED[area], f"{area} runs the families {sorted(covered)}, expected {sorted(COVERED[area])}"


def test_each_family_varies_what_its_rules_meet():
    tests = _property_tests()
    specs = {spec.family: spec for spec in family_specs(tests["VAL-002"].hypothesis._given_kwargs["spec"])}
    assert specs["llama"].kv_heads < specs["llama"].heads, "the Llama family with grouped-query attention"
    assert specs["annotated"].kv_heads == specs["annotated"].heads
    siblings = specs["siblings"].quantized_modules()
    assert siblings["attn.proj"][1] != siblings["mlp.proj"][1], "siblings of one leaf name and two recipes"
    assert not any(emulate for _kind, _recipe, emulate in siblings.values())
    for pid, emulated in (("NUM-001", {"layers.0.attention.wv"}), ("NUM-002", {"layers.0.attention.wv"}), ("NUM-003", set())):
        (compiled,) = family_specs(tests[pid].hypothesis._given_kwargs["spec"])
        assert not compiled.mlp and compiled.kv_heads < compiled.heads, f"{pid}: the Llama family without its MLP, with GQA"
        assert {fqn for fqn, (_k, _r, e) in compiled.quantized_modules().items() if e} == emulated, pid
        model, _ = compiled.build()
        kinds = {type(m).__name__ for m in model.modules()}
        assert {"Embedding", "RMSNorm", "Attention", "Float8Linear"} <= kinds and "FeedForward" not in kinds, (pid, kinds)
    mixed = family_specs(tests["EMU-002"].hypothesis._given_kwargs["spec"])
    assert all({e for _k, _r, e in spec.quantized_modules().values()} == {True, False} for spec in mixed)
    assert {fqn for fqn, _ in specs["siblings"].calls()} == set(siblings)
    assert collections.Counter(fqn for fqn, _ in specs["siblings"].calls())["shared"] == 2


def test_the_annotated_family_carries_its_annotations_through_tracing():
    from conformance.backends.reference import ReferenceBackend

    backend = ReferenceBackend()
    spec = FamilySpec("annotated", blocks=2)
    model, args = spec.build()
    gm, oracle = trace_with_oracle(backend, model, args, list(spec.quantized_modules()), backend.is_backward)
    annotated = 0
    for node in gm.graph.nodes:
        fqn = oracle.issued_by.get(node)
        if fqn and not backend.is_backward(node):
            wanted = user_annotations(spec, fqn)
            assert wanted and all(node.meta["custom"][k] == v for k, v in wanted.items()), (node.name, fqn)
            annotated += 1
    assert annotated > 14  # every projection of both blocks, several nodes each


@pytest.mark.slow
def test_the_families_run_first_on_one_property_per_area(pytester, monkeypatch):
    """Against the reference, with explicit examples only: each property ran every family model
    it lists (``evidence.drawn`` sees every model a property traces; a property's own forced
    examples may add drawn stacks) and passed."""
    ran = collections.defaultdict(set)
    real = evidence.drawn

    def drawn(model):
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split("::")[-1].split(" ")[0]
        ran[test].add(model)
        real(model)

    monkeypatch.setattr(evidence, "drawn", drawn)
    from hypothesis import Phase, settings

    settings.register_profile("fp8conf-families-only", database=None, deadline=None, derandomize=True, phases=(Phase.explicit,))
    chosen = {"PROV-004", "VAL-001", "EMU-002", "REG-007", "BND-002", "NUM-002"}
    tests = {pid: test for pid, test in _property_tests().items() if pid in chosen}
    # This worker may have imported project tests whose basenames the suite's property modules
    # share (tests/test_graphpp.py, tests/test_fingerprint.py) as top-level modules; where the
    # suite is installed rather than editable, pytest would collect those in their place.
    for path in PROPERTIES.glob("test_*.py"):
        monkeypatch.delitem(sys.modules, path.stem, raising=False)
    result = pytester.runpytest(
        # importlib: the worker may have imported tests/test_fingerprint.py, whose basename the
        # suite's own test_fingerprint.py shares.
        "-p", "no:cacheprovider", "-p", "no:randomly", "--import-mode=importlib", "--fp8-backend=reference",
        "--hypothesis-profile=fp8conf-families-only",
        "-k", " or ".join(test.__name__ for test in tests.values()), str(PROPERTIES),
    )
    assert result.ret == 0, "\n".join(result.outlines[-40:])
    for pid, test in tests.items():
        expected = set(family_specs(test.hypothesis._given_kwargs["spec"]))
        assert expected and expected <= ran[test.__name__], f"{pid} ran {ran[test.__name__]}, expected {expected}"


def test_a_property_that_draws_from_its_model_runs_every_kind_first():
    """Drawing a module, a pass or a node from its model, a property visits about 19 of the 25
    models it samples: VAL-002 and VAL-003 ran no NVFP4 model for the reference. Each kind it
    draws runs first, on the smallest of its models holding it; a property that draws only its
    model visits them all and adds none."""
    from hypothesis.errors import UnsatisfiedAssumption

    from conformance.draw.family_examples import KindExample, _smallest_of_kind
    from conformance.draw.strategies import ALL_KINDS, FLOAT8_KIND, MX_KIND, NVFP4_KIND, supported_kinds

    tests = _property_tests()
    for pid in ("VAL-002", "VAL-003", "VAL-004", "VAL-006", "VAL-007", "EMU-002", "REG-005", "REG-007", "BND-006"):
        assert set(tests[pid].fp8_kinds) == set(ALL_KINDS) - {FLOAT8_KIND}, pid
        assert {KindExample(k) for k in tests[pid].fp8_kinds} <= {kw["spec"] for kw in _explicit(tests[pid])}, pid
    assert tests["VAL-001"].fp8_kinds == () and tests["PROV-001"].fp8_kinds == ()
    strategy = tests["VAL-002"].hypothesis._given_kwargs["spec"]
    for kind in set(ALL_KINDS) - {FLOAT8_KIND}:
        found = _smallest_of_kind(strategy, kind)
        assert kind in {"mxfp8_swizzled" if r == "mxfp8_swizzled" else k for k, r, _ in found.quantized_modules().values()}, (kind, found)
    with supported_kinds((FLOAT8_KIND, MX_KIND)):
        with pytest.raises(UnsatisfiedAssumption):
            _smallest_of_kind(strategy, NVFP4_KIND)


def _explicit(test) -> list:
    return [example.kwargs for example in getattr(test, "hypothesis_explicit_examples", ())]


def test_the_hard_shapes_are_forced_first():
    """E8M0-001 runs ``b`` as a transposed weight and a non-contiguous ``a`` first, then every
    output dtype with every storage of ``a`` and ``b``; MOE-006 and MOE-007 run groups made only
    of padding (padding equal to the group's size) beside empty ones."""
    import itertools

    from conformance.draw.e8m0 import A_LAYOUTS, B_LAYOUTS, OUT_DTYPES

    tests = _property_tests()
    cases = [kwargs["case"] for kwargs in _explicit(tests["E8M0-001"])]
    assert any(case.a_layout == "column_major" and case.b_layout == "transposed_weight" for case in cases)
    assert {(c.out_dtype, c.a_layout, c.b_layout) for c in cases} == set(itertools.product(OUT_DTYPES, A_LAYOUTS, B_LAYOUTS))
    a, b, _, _ = next(case for case in cases if case.a_layout == "column_major" and case.b_layout == "transposed_weight").build()
    assert not a.is_contiguous() and not b.is_contiguous() and b.t().is_contiguous()
    for pid in ("MOE-006", "MOE-007"):
        specs = [kwargs["spec"] for kwargs in _explicit(tests[pid])]
        assert any(0 in spec.groups and spec.padding in spec.groups for spec in specs), f"{pid} forces no group of padding alone"


# --- a backend's own float8 linears (float8_modules) --------------------------------------------


def test_a_family_property_runs_the_variant_of_the_backends_own_recipes():
    from conformance.draw.family_examples import served_variant
    from conformance.draw.strategies import model_specs, supported_kinds

    strategy = model_specs(families=FAMILIES)
    shown = family_specs(strategy)
    assert "tensorwise" in {s.recipe for s in shown}  # what is fixed at import, for TorchAO
    with supported_kinds(("float8_linear",), float8_recipes=("rowwise_with_gw_hp",), float8_emulation=False):
        served = [served_variant(strategy, s) for s in shown]
    assert [s.family for s in served] == [s.family for s in shown]
    assert all(s.recipe == "rowwise_with_gw_hp" and s.sibling_recipe in (None, "rowwise_with_gw_hp") and s.emulate is False for s in served), served
    assert [served_variant(strategy, s) for s in shown] == list(shown)


def test_a_backends_own_linear_takes_a_nested_adapter_and_its_declaration():
    import trainer_float8

    import fp8conf
    from conformance.draw.models import LayerSpec, ModelSpec, build_model

    def convert(model, *, module_filter_fn, recipe, emulate):
        trainer_float8.convert(model, recipe=recipe, emulate=emulate, module_filter_fn=module_filter_fn)

    spec = ModelSpec(32, (LayerSpec(32, "rowwise", adapter=True, adapter_recipe="rowwise_with_gw_hp"),))
    model, (x,) = build_model(spec, float8=convert)
    outer = model.layers[0]
    assert isinstance(outer, trainer_float8.TrainerFloat8Linear) and type(outer) is not trainer_float8.TrainerFloat8Linear
    assert type(outer.adapter) is trainer_float8.TrainerFloat8Linear and outer.adapter.recipe == "rowwise_with_gw_hp"
    inner_out = trainer_float8.TrainerFloat8Linear.forward(outer, x) + outer.adapter(x)
    torch.testing.assert_close(outer(x), inner_out)
    # The subclass keeps what the class declares to fp8conf (docs/examples/own_module_walkthrough.py).
    import own_module_walkthrough  # noqa: F401  (registers the describer)

    from fp8conf.quantized.protocol import quantization_config_of

    assert quantization_config_of(outer).recipe == "rowwise"
