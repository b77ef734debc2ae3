"""EMU: emulated modules are exempt from FP8 compute, one module at a time; real ones compute
what their recipe defines (EMU-005 for linears, EMU-006 for grouped experts)."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.judge import block_scaled, rewrites
from conformance.observe import evidence
from conformance.draw.families import FAMILIES
from conformance.draw.family_examples import family_examples
from conformance.judge.dead_compute import needed_fp8_compute
from conformance.observe.graphs import fp8_compute_nodes
from conformance.run.harness import (
    attributed, built_with, call_backend, check, device, eager_step, fail, fp8_ops, grad_outputs, high_precision_twin,
    moe_settings, names_module, strict_error, traced, traced_graph,
)
from conformance.report.notes import note
from conformance.draw.strategies import (
    ALL_KINDS, FLOAT8_KIND, MX_SWIZZLED_KIND, NVFP4_KIND, SCALED_MM_KIND, grouped_fp8_runs, grouped_v2_runs, model_specs,
    moe_specs, runnable_kinds, runnable_recipes,
)

#: The kinds of layers whose FP8 matmuls this torch runs on the device (EMU-004 runs the step).
RUNNABLE_KINDS = tuple(k for k in (FLOAT8_KIND, SCALED_MM_KIND) if k in runnable_kinds())



def real_and_emulated(spec) -> bool:
    """The model holds both emulated and real (non-emulated) quantized modules, nested ones too."""
    return {emulate for _kind, _recipe, emulate in spec.quantized_modules().values()} == {True, False}


@pytest.mark.fp8_property("EMU-001")
@family_examples
@given(spec=model_specs(emulate=True, families=FAMILIES))
def test_EMU_001_emulated_modules_pass_strict_validation_without_fp8_compute(fp8_backend, spec):
    """Cheapest defect: requiring FP8 compute from emulated modules too, or emulation that still
    issues FP8 matmuls. All-emulated models (nested adapters emulated as well) must hold no FP8
    compute and pass strict validation."""
    case = traced("EMU-001", fp8_backend, spec)
    computes = fp8_compute_nodes(case.gm, fp8_ops("EMU-001", fp8_backend))
    check(not computes, "EMU-001", f"an all-emulated model should issue no FP8 compute; found {[n.name for n in computes]}", spec)
    exc = strict_error("EMU-001", fp8_backend, case.gm)
    check(exc is None, "EMU-001", f"strict validation rejected an all-emulated model: {type(exc).__name__}: {exc}", spec)


@pytest.mark.fp8_property("EMU-002")
@family_examples
@given(spec=model_specs(kinds=ALL_KINDS, where=real_and_emulated, families=FAMILIES), data=st.data())
def test_EMU_002_an_emulated_module_never_excuses_another(fp8_backend, spec, data):
    """Cheapest defects once let through: exempting the whole graph once any module is emulated,
    and exempting an emulated module's nested modules with it (emulation inherited down the
    tree). Nested adapters now draw their own ``emulate`` flag, so a real adapter inside an
    emulated layer (and the reverse) is drawn; one real module loses its FP8 and must be named."""
    gm, oracle = traced_graph("EMU-002", fp8_backend, spec)
    nodes = attributed("EMU-002", fp8_backend, oracle, fp8_compute_nodes(gm, fp8_ops("EMU-002", fp8_backend)), spec)
    fqn = data.draw(st.sampled_from(sorted({oracle.issued_by[n] for n in nodes})), label="module losing its FP8")
    for node in nodes:
        if oracle.issued_by[node] == fqn:
            rewrites.lower_to_high_precision(gm, node)
    exc = strict_error("EMU-002", fp8_backend, gm)
    check(
        exc is not None and names_module(exc, fqn),
        "EMU-002",
        f"non-emulated {fqn!r} lost all its FP8 compute next to an emulated module; strict validation must fail "
        f"naming {fqn!r}, saw {exc!r}",
        spec,
    )


# Measured on CPU for one layer: tensorwise emulation matches the real path to 1e-7 in norm;
# rowwise by 0.15% to 1.3% (the real path rounds its output differently). Through more
# layers a tiny difference flips FP8 roundings in the next backward and grows to ~10%, which no
# useful bound separates from a bug; a ReLU kink does the same to one layer. So the property is
# checked one quantized layer at a time, without activation. On CUDA the real path's FP8 GEMM
# accumulates in its own order and precision: tensorwise differs by about 3e-5 on an H200
# (sm90), so the rule allows 1e-4 there; rowwise keeps its bound.
_TOLERANCE = {
    "cpu": {"tensorwise": 1e-5, "rowwise": 3e-2, "rowwise_with_gw_hp": 3e-2},
    "cuda": {"tensorwise": 1e-4, "rowwise": 3e-2, "rowwise_with_gw_hp": 3e-2},
}


@pytest.mark.fp8_property("EMU-003")
@given(spec=model_specs(recipes=runnable_recipes(), emulate=False, max_layers=1, reuse=False, nesting=False))
def test_EMU_003_emulated_and_real_models_agree(fp8_backend, spec):
    import torch

    spec = dataclasses.replace(spec, layers=tuple(dataclasses.replace(l, activation="none") for l in spec.layers))
    emulated_spec = dataclasses.replace(spec, layers=tuple(dataclasses.replace(l, emulate=True) for l in spec.layers))
    results = []
    for s in (spec, emulated_spec):
        case = traced("EMU-003", fp8_backend, s)
        grad_out = torch.randn(s.batch, s.layers[-1].width, generator=torch.Generator().manual_seed(1)).to(device())
        results.append(call_backend("EMU-003", fp8_backend, "run_joint", case.gm, case.model, case.args, (grad_out,)))
    (out_real, grads_real), (out_emu, grads_emu) = results
    check(grads_real.keys() == grads_emu.keys(), "EMU-003", f"gradient sets differ: {sorted(grads_real)} vs {sorted(grads_emu)}", spec)
    pairs = [("output", out_real[0], out_emu[0])] + [(f"grad of {k}", grads_real[k], grads_emu[k]) for k in sorted(grads_real)]
    for label, real, emu in pairs:
        error = ((real - emu).norm() / real.norm().clamp_min(1e-12)).item()
        tolerance = _TOLERANCE["cuda" if device().startswith("cuda") else "cpu"][spec.layers[0].recipe]
        if not error <= tolerance:
            fail("EMU-003", f"{label}: real and emulated differ by {error:.3g} in relative norm (tolerance {tolerance:g} on {device()})", spec)


# --- EMU-004: no silent fallback -------------------------------------------------------------------

#: The FP8 step must be closer to the high-precision step than zero is, in every output and
#: gradient: the relative norm of the difference below 1. e4m3 keeps 3 mantissa bits and a
#: gradient through a few layers and ReLUs compounds the rounding (the reference's worst over 200
#: drawn models on CPU: 0.49, an early layer's weight gradient under tensorwise scales; a trainer's
#: own rowwise linear's: 0.42), so a tighter bound would fail sound steps. Below 1 still catches
#: what is wrong rather than imprecise: a scale applied the wrong way round (off by its own
#: magnitude), a transposed or wrong operand (about 1.4), a zeroed or negated gradient (1 and 2).
_FALLBACK_TOLERANCE = 1.0


def _suites_counts(backend, gm, oracle) -> dict:
    """FP8 compute that reaches the outputs (what counts), per (module, pass), by the suite's own
    attribution (its oracle), not the backend's."""
    counts: dict = {}
    for node in needed_fp8_compute(gm, fp8_ops("EMU-004", backend)):
        key = (oracle.issued_by.get(node), "backward" if backend.is_backward(node) else "forward")
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.fp8_property("EMU-004")
@family_examples
@given(spec=model_specs(recipes=runnable_recipes(), kinds=RUNNABLE_KINDS, emulate=False, nesting=False, families=FAMILIES))
def test_EMU_004_a_real_fp8_step_is_no_silent_high_precision_step(fp8_backend, spec):
    """Cheapest defects: a quantized module that computes in high precision while declaring FP8
    (a fast path that forgot to quantize), one that issues its FP8 matmul and returns the
    high-precision result beside it, and one whose FP8 matmul is wrong (a scale the wrong way
    round). On a model whose quantized modules are all real: every module issues its recipe's
    FP8 compute by the suite's own count; the step's output and gradients are not all
    bit-identical to the same weights' high-precision step, nor is the weight gradient of a
    module that computes it in FP8; and each is closer to it than zero is (relative norm of the
    difference below 1)."""
    import torch

    case = traced("EMU-004", fp8_backend, spec)
    expected = spec.expected_compute_counts()
    seen = _suites_counts(fp8_backend, case.gm, case.oracle)
    check(
        seen == {k: v for k, v in expected.items() if v},
        "EMU-004",
        f"the FP8 compute of the traced step that reaches its outputs, per (module, pass) by the suite's own count, is "
        f"{seen}; the recipes issue {expected}: a module that issues less computes in high precision",
        spec,
    )
    grad_out = grad_outputs(spec, 7)
    outputs, grads = call_backend("EMU-004", fp8_backend, "run_joint", case.gm, case.model, case.args, grad_out)
    twin = high_precision_twin("EMU-004", spec, case.model)
    hp_outputs, hp_grads = eager_step(twin, case.args, grad_out)
    missing = sorted(set(hp_grads) - set(grads))
    check(not missing, "EMU-004", f"run_joint() returned no gradients for {missing}, which the high-precision step has", spec)
    pairs = [(f"output {i}", o, hp) for i, (o, hp) in enumerate(zip(outputs, hp_outputs))]
    pairs += [(f"gradient of {name}", grads[name], hp) for name, hp in sorted(hp_grads.items())]
    check(
        not all(torch.equal(a, b) for _, a, b in pairs),
        "EMU-004",
        "the FP8 step's output and every gradient are bit-identical to the high-precision step's: its FP8 compute "
        "does not reach the result (a silent fallback)",
        spec,
    )
    for fqn, (_kind, recipe, _emulate) in spec.quantized_modules().items():
        name = f"{fqn}.weight"
        if recipe != "rowwise_with_gw_hp" and name in hp_grads:
            check(
                not torch.equal(grads[name], hp_grads[name]),
                "EMU-004",
                f"module {fqn!r} ({recipe}) computes its weight gradient with FP8 matmuls, yet the gradient of {name} is "
                "bit-identical to the high-precision step's",
                spec,
            )
    for label, got, want in pairs:
        error = ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-12)).item()
        check(
            error < _FALLBACK_TOLERANCE,
            "EMU-004",
            f"{label}: the FP8 step differs from the high-precision step by {error:.3g} in relative norm (below "
            f"{_FALLBACK_TOLERANCE:g}: closer to it than zero is): its FP8 compute is wrong, not merely imprecise",
            spec,
        )


# --- EMU-005 and EMU-006: each module computes what its recipe defines ---------------------------

#: How far a module's output or gradient may be from what its recipe defines
#: (conformance.judge.definitions: operands quantized by the suite in plain torch, multiplied in float64,
#: on the module's own inputs), relative to the recipe's own rounding there: ``q``, the relative
#: norm of the difference between the definition and the high-precision product. A module that
#: follows the suite's reading differs by its accumulation order (the reference: at most 0.06 q;
#: its grouped experts, whose GEMMs write bfloat16, 0.05 q); one whose convention differs within
#: the recipe rounds its operands independently of the definition, about sqrt(2) q (makefx's
#: linears, scales not rounded to a power of two: at most 1.7 q over the CI corpus; MX scales
#: rounded up, not floored: at most 0.9 q). Allowed: 2.5 q + 0.01 (the floor for a matmul the
#: recipe keeps in high precision). Caught: a gradient off by a constant factor (x1.5 is 0.5 of
#: the definition: about 11 q in MXFP8 and FP8, 3.6 q in NVFP4, whose q is about 0.13), a scale
#: applied twice or not at all, a transposed operand.
_ROUNDINGS_ALLOWED = 2.5
_FLOOR = 0.01

#: The block formats each drawing kind's matmuls take, where a device without a kernel has them
#: computed by the suite's reading (conformance.judge.block_scaled).
_BLOCK_FORMATS = {NVFP4_KIND: block_scaled.NVFP4, MX_SWIZZLED_KIND: block_scaled.MXFP8}


def _observed_modules(model, fqns, args, grad_out, seed: int):
    """Run ``model`` eagerly with autograd, observing each module of ``fqns`` at every call.
    By FQN: a list of calls (``inputs``, ``output``, ``grad_input`` (None where the first input
    needs no gradient), ``grad_output``) and the module's weight gradient. ``grad_out`` None:
    random output gradients, seeded by ``seed``."""
    import torch

    calls = {fqn: [] for fqn in fqns}
    handles = []
    for fqn in fqns:
        module = model.get_submodule(fqn)

        def forward_hook(_module, inputs, output, _fqn=fqn):
            calls[_fqn].append({"inputs": tuple(i.detach() for i in inputs), "output": output.detach()})

        def backward_hook(_module, grad_input, grad_output, _fqn=fqn):
            # Backward reaches the calls in reverse: this is the latest call not yet given its gradients.
            call = next(c for c in reversed(calls[_fqn]) if "grad_output" not in c)
            call["grad_output"] = grad_output[0].detach()
            call["grad_input"] = None if grad_input[0] is None else grad_input[0].detach()

        handles += [module.register_forward_hook(forward_hook), module.register_full_backward_hook(backward_hook)]
    try:
        args = tuple(a.detach().clone().requires_grad_(a.requires_grad) if a.is_floating_point() else a for a in args)
        outputs = model(*args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        if grad_out is None:
            generator = torch.Generator(outputs[0].device.type).manual_seed(seed)
            grad_out = tuple(torch.randn(o.shape, generator=generator, device=o.device, dtype=o.dtype) for o in outputs)
        torch.autograd.backward(outputs, grad_out)
    finally:
        for handle in handles:
            handle.remove()
    return {fqn: (calls[fqn], model.get_submodule(fqn).weight.grad) for fqn in fqns}


def _hold_to_definitions(property_id: str, spec, model, args, grad_out, recipes: dict, step, *, computed=frozenset()):
    """Run ``model`` eagerly (the matmuls of ``computed`` by the suite's reading) and hold each
    module of ``recipes`` (FQN -> (kind, recipe)) to its definition: ``step(definition, module,
    inputs, grad_output)`` gives its output, input gradient and weight gradient (summed over
    its calls). Modules of a recipe the suite does not read are left out; a model without any
    fails (it was drawn for them). Returns what differs from its definition by more than the
    bound, one line each: the property holds when nothing does."""
    import copy

    from conformance.judge.definitions import HIGH_PRECISION, definition

    deviations = []
    known = {fqn: definition(*kr) for fqn, kr in recipes.items() if definition(*kr) is not None}
    check(known, property_id, f"the drawn model holds no real module of a recipe the suite reads ({sorted(set(recipes.values()))})", spec)
    model = copy.deepcopy(model)  # the shared model's gradients stay as they were
    suites_kernels = block_scaled.read_by_the_suite(compute=computed, operands=False) if computed else contextlib.nullcontext()
    try:
        with suites_kernels:
            observed = _observed_modules(model, sorted(known), args, grad_out, seed=11)
    except block_scaled.LayoutUnreadable as exc:
        fail(property_id, f"the eager step's matmuls could not be computed by the suite's reading: {exc}", spec)
    for fqn, recipe in known.items():
        calls, weight_grad = observed[fqn]
        check(calls and all("grad_output" in c for c in calls), property_id,
              f"module {fqn!r} was not called, or got no output gradient, in the eager step", spec)
        module = model.get_submodule(fqn)
        bias = 0 if getattr(module, "bias", None) is None else module.bias.detach().double()
        summed = {"definition": 0, "high precision": 0}
        for i, call in enumerate(calls):
            want = step(recipe, module, call["inputs"], call["grad_output"])
            plain = step(HIGH_PRECISION, module, call["inputs"], call["grad_output"])
            within = (fqn, recipes[fqn])
            deviations += _beyond_definition(*within, f"output of call {i}", call["output"].double() - bias, want["output"], plain["output"])
            if call["grad_input"] is not None:
                deviations += _beyond_definition(*within, f"input gradient of call {i}", call["grad_input"], want["grad_input"], plain["grad_input"])
            summed = {"definition": summed["definition"] + want["grad_weight"], "high precision": summed["high precision"] + plain["grad_weight"]}
        check(weight_grad is not None, property_id, f"module {fqn!r} got no weight gradient in the eager step", spec)
        deviations += _beyond_definition(fqn, recipes[fqn], "weight gradient", weight_grad, summed["definition"], summed["high precision"])
    return deviations


def _beyond_definition(fqn, kind_recipe, label, got, defined, plain) -> list[str]:
    """``[why]`` when ``got`` differs from ``defined`` by more than the bound, else ``[]``."""
    scale = defined.norm().clamp_min(1e-12)
    rounding = ((defined - plain).norm() / scale).item()
    error = ((got.double() - defined).norm() / scale).item()
    allowed = _ROUNDINGS_ALLOWED * rounding + _FLOOR
    if error <= allowed:
        return []
    return [f"module {fqn!r} ({kind_recipe[0]}, recipe {kind_recipe[1]}): its {label} differs from what the recipe defines "
            f"(operands quantized as conformance.judge.definitions reads the recipe, multiplied in float64, on the module's own "
            f"inputs) by {error:.3g} in relative norm; allowed {allowed:.3g} ({_ROUNDINGS_ALLOWED:g} x the recipe's own "
            f"rounding there, {rounding:.3g}, + {_FLOOR:g})"]


def _linear_step(recipe, module, inputs, grad_output):
    from conformance.judge.definitions import linear_step

    return linear_step(recipe, inputs[0], module.weight, grad_output)


def _block_formats_computed(spec) -> frozenset:
    """The block formats of ``spec``'s layers that this device has no kernel for: the suite
    computes them (said in the report row)."""
    kinds = {MX_SWIZZLED_KIND if recipe == MX_SWIZZLED_KIND else kind for kind, recipe, _e in spec.quantized_modules().values()}
    computed = set()
    for kind, fmt in _BLOCK_FORMATS.items():
        if kind in kinds and kind not in runnable_kinds(device()):
            computed.add(fmt.name)
            note(f"{fmt.name} matmuls computed by the suite's reading of the declared layout (conformance.judge.block_scaled): "
                 f"this torch has no {device()} kernel for them")
    return frozenset(computed)


@pytest.mark.fp8_property("EMU-005")
@family_examples
@given(spec=model_specs(recipes=runnable_recipes(), kinds=ALL_KINDS, emulate=False, nesting=False, families=FAMILIES))
def test_EMU_005_each_linear_computes_what_its_recipe_defines(fp8_backend, spec):
    """Cheapest defects: a weight gradient off by a constant factor in eager and compiled alike
    (every property comparing the backend with itself passes it, and EMU-004's bound of 1, like
    NVF-002's and MXS-002's, lets it through), an operand quantized along the wrong dim, a scale
    applied twice. Each real quantized linear of a recipe the suite reads (float8, MX of either
    layout, NVFP4), run eagerly in the backend's own model (its NVFP4 and swizzled MX matmuls
    computed by the suite's reading of the declared layout where the device has no kernel), is
    held to the recipe's definition (conformance.judge.definitions) on its own inputs and output
    gradient: output, input gradient and weight gradient (summed over its calls)."""
    case = traced("EMU-005", fp8_backend, spec)
    recipes = {fqn: (kind, recipe) for fqn, (kind, recipe, emulate) in spec.quantized_modules().items() if not emulate}
    deviations = _hold_to_definitions("EMU-005", spec, case.model, case.args, grad_outputs(spec, 11), recipes, _linear_step,
                                      computed=_block_formats_computed(spec))
    check(not deviations, "EMU-005", "; ".join(deviations), spec)


def _experts_step(recipe, module, inputs, grad_output):
    from conformance.judge.definitions import experts_step

    return experts_step(recipe, inputs[0], module.weight, inputs[1], grad_output)


def _grouped_computed(spec) -> frozenset:
    """Whether the suite computes ``spec``'s grouped GEMMs (the device has no kernel for its
    experts' grouped API), said in the report row."""
    api, runs = ("F.scaled_grouped_mm", grouped_v2_runs) if spec.v2 else ("torch._scaled_grouped_mm", grouped_fp8_runs)
    if runs(device()):
        return frozenset()
    note(f"grouped GEMMs of experts on {api} computed by the suite's reading (conformance.draw.moe.reference_grouped_mm): this "
         f"torch has no {device()} kernel for them")
    return frozenset({block_scaled.GROUPED})


#: MoE models per session: building one costs little, the eager step with the suite's grouped
#: GEMMs about a tenth of a second; as few as the MOE properties take.
_moe_budget = moe_settings()


@pytest.mark.fp8_property("EMU-006")
@_moe_budget
@given(spec=moe_specs(emulate=False, v2=True))
def test_EMU_006_each_experts_module_computes_what_its_recipe_defines(fp8_backend, spec):
    """Cheapest defect: grouped experts whose weight gradient is off by a constant factor in
    eager and compiled alike (MOE-008 compares compiled with eager, on a GPU only, MOE-006 groups
    with groups, MOE-007 looks for NaN: all pass it). Each real experts module of an MoE model, on either grouped API, run eagerly
    in the backend's own model (its grouped GEMMs computed by the suite's reading where the
    device has no kernel), is held to its recipe's definition per token group
    (conformance.judge.definitions.experts_step) on its own inputs, token groups and output gradient:
    output, input gradient and weight gradient."""
    from conformance.draw.moe import build_moe_model, experts_family

    convert = fp8_backend.convert_scaled_grouped_experts if spec.v2 else fp8_backend.convert_grouped_experts
    try:
        model, args = build_moe_model(spec, device(), convert=convert)
    except Exception as exc:
        fail("EMU-006", f"backend {fp8_backend.name!r}: converting the MoE model raised {type(exc).__name__}: {exc}", spec)
    evidence.built((experts_family(spec), *entry[1:]) for entry in built_with(fp8_backend, spec, model))
    recipes = {fqn: (kind, recipe) for fqn, (kind, recipe, emulate) in spec.quantized_modules().items() if not emulate}
    deviations = _hold_to_definitions("EMU-006", spec, model, args, None, recipes, _experts_step, computed=_grouped_computed(spec))
    check(not deviations, "EMU-006", "; ".join(deviations), spec)
