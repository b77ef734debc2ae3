"""A trainer's own FP8 linear, declared through the quantized-module protocol, in every pass.

The module (``docs/examples/trainer_float8.py``) is written as a leading graph trainer writes
its own: recipes ``rowwise`` and ``rowwise_with_gw_hp`` only, the weight quantized under
``torch.no_grad()`` outside its autograd function, the forward on ``F.scaled_mm`` and the
backward on ``torch._scaled_mm``. ``docs/examples/own_module_walkthrough.py`` declares it from
outside and runs every pass strictly; these tests run that walkthrough, and show what each pass
says of the same module left undeclared.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path

import pytest
import torch

import fp8conf
from fp8conf.graph.provenance import get_provenance, node_passes
from fp8conf.quantized.scaled_mm import has_scaled_mm_v2

pytestmark = pytest.mark.skipif(not has_scaled_mm_v2(), reason="the example's forward runs on F.scaled_mm (torch 2.12 and newer)")

EXAMPLES = Path(__file__).resolve().parent.parent / "docs" / "examples"
sys.path.insert(0, str(EXAMPLES))

import own_module_walkthrough as walkthrough  # noqa: E402  (registers the module's describer)
import trainer_float8  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
COMBINATIONS = [(d, r, c) for d in DTYPES for r in trainer_float8.RECIPES for c in (1, 2)]
# Every dtype, recipe and call count is compiled (both modes) in some combination: two of the
# eight cover each value of each (a cold compile is tens of seconds of Inductor on CPU); the bf16
# rowwise block is the one whose C++ code needs the regional engine's retry.
COMPILED = {("float32", "rowwise_with_gw_hp", 1), ("bfloat16", "rowwise", 2)}


def _fp8_compute(gm):
    return [n for n in gm.graph.nodes if fp8conf.is_fp8_compute(n)]


def _tolerance(dtype):
    return {"rtol": 1e-2, "atol": 1e-2} if dtype is torch.bfloat16 else {"rtol": 1e-3, "atol": 1e-4}


def _assert_same(got, want, what, **tolerance):
    (out_g,), grads_g = got
    (out_w,), grads_w = want
    assert grads_g.keys() == grads_w.keys(), what
    for name, value in [("output", out_g), *grads_g.items()]:
        expected = out_w if name == "output" else grads_w[name]
        if tolerance:
            torch.testing.assert_close(value, expected, **tolerance, msg=lambda m: f"{what}, {name}: {m}")
        else:
            assert torch.equal(value, expected), f"{what}, {name}: not bitwise equal"


@pytest.mark.parametrize("dtype, recipe, calls", COMBINATIONS, ids=["-".join(map(str, c)) for c in COMBINATIONS])
def test_the_trainers_own_linear_passes_every_pass_strict(dtype, recipe, calls):
    modes = ("regional", "full") if (dtype, recipe, calls) in COMPILED else ()
    # Inductor computes bfloat16 elementwise chains in float32 unless told to round as eager
    # does; a value off by one bfloat16 ulp before a cast to e4m3 may round to another FP8 value.
    with torch._inductor.config.patch(emulate_precision_casts=True):
        result = walkthrough.walk(recipe, DTYPES[dtype], calls, compile_modes=modes)
    gm, report = result["gm"], result["report"]
    # Validation: every call's FP8 matmuls counted, grad_weight in FP8 for rowwise only.
    backward_per_call = 2 if recipe == "rowwise" else 1
    calls_per_step = {"w1": 1, "w3": 1, "w2": 1, "proj": calls}
    assert report.findings == ()
    assert report.compute_counts == {
        **{(m, "forward"): n for m, n in calls_per_step.items()},
        **{(m, "backward"): n * backward_per_call for m, n in calls_per_step.items()},
    }
    # Provenance: every FP8 matmul, forward and backward, names its module, kind and recipe.
    compute = _fp8_compute(gm)
    assert len(compute) == sum(calls_per_step.values()) * (1 + backward_per_call)
    for node in compute:
        provenance = get_provenance(node)
        assert provenance is not None and provenance.kind == "trainer_float8_linear" and provenance.recipe == recipe, node.name
    # Regions: all complete, every FP8 matmul in exactly one.
    regions = result["regions"]
    assert regions and all(r.complete for r in regions)
    held = [n for r in regions for n in r.compute_nodes]
    assert sorted(n.name for n in held) == sorted(n.name for n in compute)
    # Compiled (regional compiles every FP8 matmul) and split runs match the joint graph.
    for mode, (joint, run) in result["compiled"].items():
        if mode == "regional":
            assert {n.name for n in compute} <= joint.compiled_nodes
        _assert_same(run, result["eager"], f"{mode} compile", **_tolerance(DTYPES[dtype]))
    _assert_same(result["split_run"], result["eager"], "split")
    # Fingerprint: the four modules, declared through the protocol.
    assert {m.fqn: (m.kind, m.recipe, m.emulate) for m in result["signature"].modules} == {
        m: ("trainer_float8_linear", recipe, False) for m in calls_per_step
    }


def test_the_fingerprint_tells_plain_recipes_and_emulation_apart():
    signatures = {
        "plain": fp8conf.QuantizationSignature.from_model(walkthrough.Block()),
        **{
            f"{recipe}, emulate={emulate}": fp8conf.QuantizationSignature.from_model(walkthrough.build(recipe, emulate=emulate)[0])
            for recipe in trainer_float8.RECIPES
            for emulate in (False, True)
        },
    }
    digests = {name: s.sha256 for name, s in signatures.items()}
    assert len(set(digests.values())) == len(digests), digests


def test_the_first_calls_backward_keeps_its_provenance_when_the_module_is_called_again():
    # The second call's weight cast (under no_grad) carries the first call's sequence number.
    model, args = walkthrough.build("rowwise", calls=2)
    gm = fp8conf.trace_joint(model, args)
    passes = node_passes(gm.graph)
    seen = {(get_provenance(n).module_fqn, get_provenance(n).call, passes[n]) for n in _fp8_compute(gm) if get_provenance(n)}
    assert {("proj", 0, "backward"), ("proj", 1, "backward")} <= seen
    assert all(get_provenance(n) is not None for n in _fp8_compute(gm))


class _CachedCast(trainer_float8.TrainerFloat8Linear):
    """Casts its weight at the first call of a step and reuses the cast when called again."""

    def forward(self, x):
        if getattr(self, "cast", None) is None:
            with torch.no_grad():
                self.cast = trainer_float8.quantize_rowwise(self.weight)
        return trainer_float8._Float8LinearFunction.apply(x, self.weight, *self.cast, self.recipe, self.emulate)


class _Step(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        self.inner.proj.cast = None  # a new step casts anew
        return self.inner(x)


def test_a_weight_cast_cached_across_calls_is_attributed_and_its_reuse_is_said():
    inner, args = walkthrough.build("rowwise", calls=2)
    inner.proj.__class__ = _CachedCast
    model = _Step(inner)
    gm = fp8conf.trace_joint(model, args)
    # Attribution: both calls' matmuls, forward and backward, are the module's.
    report = fp8conf.validate_fp8_graph(gm, strict=True)
    assert report.compute_counts[("inner.proj", "forward")] == 2 and report.compute_counts[("inner.proj", "backward")] == 4
    # The second call's forward reads the first call's cast: its region does not hold its whole
    # quantization chain, so it is reported (naming the cast and the call that made it) and left
    # eager, never compiled as a region without its quantization.
    regions = {r.id: r for r in fp8conf.identify_fp8_regions(gm)}
    incomplete = [r for r in regions.values() if not r.complete]
    assert [r.id for r in incomplete] == ["inner.proj/forward/call1/0"]
    assert "made outside the region" in incomplete[0].reason and "call=0" in incomplete[0].reason
    with pytest.raises(fp8conf.IncompleteRegionError, match="inner.proj"):
        fp8conf.compile_joint(gm, mode="regional", strict=True)


# --- the same module, undeclared ------------------------------------------------------------------


def _undeclared_module():
    """The example module under another import name: a class no describer is registered for."""
    spec = importlib.util.spec_from_file_location("trainer_float8_undeclared", EXAMPLES / "trainer_float8.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def undeclared():
    """``(model, args, joint graph)`` of the block converted by the undeclared module."""
    module = _undeclared_module()
    torch.manual_seed(0)
    model = module.convert(walkthrough.Block(calls=2), recipe="rowwise")
    args = (torch.randn(32, 32, requires_grad=True),)
    return model, args, fp8conf.trace_joint(model, args)


def _says_undeclared(error, fqn="w1"):
    text = str(error)
    assert error.module_fqn == fqn, error.module_fqn
    assert f"module '{fqn}' (trainer_float8_undeclared.TrainerFloat8Linear) computes FP8" in text, text
    assert "register_quantized_module('trainer_float8_undeclared.TrainerFloat8Linear'" in text, text
    assert "rewrite" not in text.split("\n")[0], text  # nothing was rewritten: not the rewrite diagnosis


def test_undeclared_fp8_is_named_by_strict_validation(undeclared):
    _, _, gm = undeclared
    assert fp8conf.find_quantized_modules(undeclared[0]) == {}
    with pytest.raises(fp8conf.UndeclaredFP8ModuleError) as caught:
        fp8conf.validate_fp8_graph(gm, strict=True)
    _says_undeclared(caught.value)
    assert caught.value.property_id == "VAL-003" and isinstance(caught.value, fp8conf.MissingProvenanceError)
    # Every pass of the graph's FP8 matmuls is named, the backward ones too.
    named = {(f.module_fqn, f.pass_name) for f in caught.value.findings if f.property_id == "VAL-003"}
    assert {(m, p) for m in ("w1", "w2", "w3", "proj") for p in ("forward", "backward")} <= named


@pytest.mark.parametrize("mode", ["regional", "full"])
def test_undeclared_fp8_is_refused_by_strict_compile(undeclared, mode):
    _, _, gm = undeclared
    with pytest.raises(fp8conf.UndeclaredFP8ModuleError) as caught:
        fp8conf.compile_joint(gm, mode=mode, strict=True)
    _says_undeclared(caught.value)


def test_undeclared_fp8_is_refused_by_the_strict_signature_and_keyed_apart_otherwise(undeclared, caplog):
    model = undeclared[0]
    with pytest.raises(fp8conf.UndeclaredFP8ModuleError) as caught:
        fp8conf.QuantizationSignature.from_model(model, strict=True)
    _says_undeclared(caught.value, caught.value.module_fqn)
    assert "more module(s) like it" in str(caught.value)
    loose = fp8conf.QuantizationSignature.from_model(model, strict=False)
    plain = fp8conf.QuantizationSignature.from_model(walkthrough.Block(calls=2), strict=False)
    assert loose.sha256 != plain.sha256
    entry = loose.to_dict()["modules"]["w1"]
    assert entry["kind"] == "undeclared" and entry["config"]["class"] == "trainer_float8_undeclared.TrainerFloat8Linear"
    assert entry["config"]["fp8_ops"] == ["aten._scaled_mm_v2.default"]
    # The whole model on example inputs sees the same modules as the module-by-module look.
    assert fp8conf.QuantizationSignature.from_model(model, strict=False, example_inputs=undeclared[1]) == loose


def test_a_declaration_that_is_not_a_config_is_refused_naming_its_source():
    class Declares(torch.nn.Linear):
        def fp8_quantization(self):
            return {"kind": "mine", "recipe": "rowwise", "emulate": False, "granularity": "row"}

    with pytest.raises(fp8conf.FP8ConfigError, match=r"Declares\.fp8_quantization\(\) declared .*unknown field\(s\) \['granularity'\]"):
        fp8conf.find_quantized_modules(torch.nn.Sequential(Declares(16, 16)))
    with pytest.raises(fp8conf.FP8ConfigError, match="not a dotted class name"):
        fp8conf.register_quantized_module("Float8Linear", walkthrough.describe)


def test_a_module_declaring_itself_needs_no_import_of_fp8conf():
    class Own(torch.nn.Linear):
        def fp8_quantization(self):
            return {"kind": "own_linear", "recipe": "rowwise", "emulate": True}

    assert isinstance(Own(16, 16), fp8conf.QuantizedModule)
    found = fp8conf.find_quantized_modules(torch.nn.Sequential(torch.nn.Linear(16, 16), Own(16, 16)))
    assert found == {"1": fp8conf.QuantizationConfig("own_linear", "rowwise", True)}


def test_an_undeclared_module_is_not_blamed_on_a_rewrite_while_a_dropped_provenance_still_is(undeclared, caplog):
    _, _, gm = undeclared
    with caplog.at_level(logging.WARNING, logger="fp8conf"):
        fp8conf.tag_fp8_regions(fp8conf.copy_graph_module(gm), strict=False)
    said = [r.getMessage() for r in caplog.records if r.name == "fp8conf"]
    assert said and all("is not a quantized module fp8conf knows" in m for m in said), said
    # A declared module's node whose provenance a rewrite dropped: the rewrite diagnosis, naming the module.
    model, args = walkthrough.build("rowwise")
    traced = fp8conf.copy_graph_module(fp8conf.trace_joint(model, args))
    victim = _fp8_compute(traced)[0]
    victim.meta.pop("fp8conf_provenance")
    with pytest.raises(fp8conf.MissingProvenanceError) as caught:
        fp8conf.validate_fp8_graph(traced, strict=True)
    assert type(caught.value) is fp8conf.MissingProvenanceError
    assert "A rewrite probably replaced the node" in str(caught.value) and "quantized module 'w1'" in str(caught.value)
