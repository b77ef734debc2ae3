"""NVF: NVFP4 layers keep their two-level block layout and compute what it means (capability ``nvfp4``).

Models are drawn stacks whose quantized layers are NVFP4 linears built by the backend
(``Backend.convert_nvfp4``; kind ``nvfp4_linear``). The other areas draw NVFP4 layers too, beside
float8 ones, for a backend that claims ``nvfp4`` (PROV, VAL, REG, BND, EMU-002, RWR): they trace
on any device, under torch's own Meta kernel of ``aten._scaled_mm_v2``. These two look at what
only NVFP4 has:

* NVF-001, the layout reaching each NVFP4 matmul, read off the traced graph (the rewritten one
  for a backend that claims ``rewrites``) and off each piece of its GraphPP split: packed FP4
  operands, e4m3 scales of blocks of 16 in the ``SWIZZLE_32_4_4`` layout and a float32 global
  scale (``conformance.nvfp4.layout_problems``), as many per module and pass as the recipe issues.
* NVF-002, what the step computes: run with its NVFP4 matmuls executed by the device's kernel or,
  where no device here has one (any but sm100), by the suite's own reading of the declared layout
  (``conformance.nvfp4.read_by_the_suite``; the report row says which), each operand read in its
  declared layout reconstructs the high-precision tensor it was quantized from (observed at
  torch's dispatcher), and the step stays near the high-precision step. A layout that is
  declared but not the one the scales are in (row-major scales passed as swizzled) reads the
  wrong block's scale, and fails.
"""

from __future__ import annotations

import collections

import pytest
from hypothesis import given

from conformance import nvfp4
from conformance.api.types import StageSplit
from conformance.harness import call_backend, check, device, fail, eager_step, fresh_args, grad_outputs, high_precision_twin, traced
from conformance.notes import note
from conformance.strategies import NVFP4_KIND, model_specs, runnable_kinds

#: NVF-002's bound on each operand: the relative norm of the difference between the operand
#: dequantized in its declared layout and the high-precision tensor it was quantized from. NVFP4
#: keeps one mantissa bit under a scale per 16 elements: the reference's operands are within
#: 0.11 of their sources over 60 drawn models. A scale read from another block (a wrong layout)
#: is off by the ratio of two blocks' magnitudes, or zero where it lands in padding: the row-major
#: mutant's worst operand is 0.9 or more on every model.
_OPERAND_TOLERANCE = 0.3
#: And on the step: closer to the high-precision step than zero is, per output and gradient (the
#: reference's worst over the same models: 0.68, an early gradient through three NVFP4 layers).
_STEP_TOLERANCE = 1.0

_real_nvfp4 = model_specs(kinds=(NVFP4_KIND,), emulate=False)


def _nvfp4_matmuls(gm) -> list:
    return [n for n in gm.graph.nodes if nvfp4.is_nvfp4_matmul(n)]


def _expected_counts(spec) -> dict:
    """(fqn, pass) -> NVFP4 matmuls the recipe issues: forward one per call, backward one for
    grad_input when the call's input needs a gradient and one for grad_weight."""
    counts: dict = {}
    configs = spec.quantized_modules()
    for fqn, input_grad in spec.calls():
        kind, _recipe, emulate = configs[fqn]
        if kind != "nvfp4_linear" or emulate:
            continue
        counts[(fqn, "forward")] = counts.get((fqn, "forward"), 0) + 1
        counts[(fqn, "backward")] = counts.get((fqn, "backward"), 0) + int(input_grad) + 1
    return counts


def _check_layouts(gm, where: str, spec) -> int:
    found = _nvfp4_matmuls(gm)
    for node in found:
        problems = nvfp4.layout_problems(node)
        check(not problems, "NVF-001", f"{where}: NVFP4 matmul '{node.name}' ({node.target}): " + "; ".join(problems), spec)
    return len(found)


@pytest.mark.fp8_property("NVF-001")
@given(spec=_real_nvfp4)
def test_NVF_001_every_nvfp4_matmul_takes_its_declared_two_level_block_layout(fp8_backend, spec):
    """Cheapest defects: NVFP4 layers that drop the global scale (one e4m3 scale list, which
    torch accepts and which works until a tensor's range outgrows e4m3), or that quantize with
    MX's e8m0 scales of blocks of 32 (MXFP4, which torch accepts too), or that fall back to FP8 or
    high precision for a matmul. Every NVFP4 matmul of the traced graph and of each piece of its
    GraphPP split must have the declared layout, and each NVFP4 module must issue its recipe's
    count of them per pass, by the suite's own attribution."""
    case = traced("NVF-001", fp8_backend, spec)
    joint = _check_layouts(case.gm, "traced graph", spec)
    seen = collections.Counter(
        (case.oracle.issued_by.get(n), "backward" if fp8_backend.is_backward(n) else "forward") for n in _nvfp4_matmuls(case.gm)
    )
    expected = _expected_counts(spec)
    check(
        dict(seen) == expected,
        "NVF-001",
        f"NVFP4 matmuls per (module, pass), by the suite's count: {dict(seen)}; the NVFP4 recipe issues {expected} "
        "(one forward per call; backward one for grad_input where the input needs a gradient and one for grad_weight)",
        spec,
    )
    if "graphpp" not in fp8_backend.capabilities:
        note("GraphPP pieces not checked: the backend does not claim graphpp")
        return
    split = call_backend("NVF-001", fp8_backend, "split_stage", case.gm, strict=True, expect=StageSplit)
    pieces = sum(
        _check_layouts(getattr(split, name), f"split_stage's {name}", spec) for name in ("forward", "backward_input", "backward_weight")
    )
    check(pieces == joint, "NVF-001",
          f"split_stage's forward, dI and dW callables hold {pieces} NVFP4 matmuls; the joint graph {joint}", spec)


@pytest.mark.fp8_property("NVF-002")
@given(spec=_real_nvfp4)
def test_NVF_002_the_nvfp4_step_computes_what_its_declared_layout_means(fp8_backend, spec):
    """Cheapest defect: block scales kept row-major (padded to the swizzled size, so every shape
    check passes) while the matmul is told they are swizzled: each row then reads another row's
    scales, or padding. Run on fresh inputs, with the NVFP4 matmuls executed by the device's
    kernel or by the suite's reading of the declared layout, every NVFP4 matmul of the graph must
    run, each operand read in its declared layout must reconstruct the high-precision tensor it
    was quantized from (observed at torch's dispatcher), and the step's output and gradients must
    be closer to the same weights' high-precision step than zero is."""
    case = traced("NVF-002", fp8_backend, spec)
    matmuls = len(_nvfp4_matmuls(case.gm))
    args, grad_out = fresh_args(spec, 11), grad_outputs(spec, 12)
    kernel = NVFP4_KIND in runnable_kinds(device())
    if kernel:
        note(f"NVFP4 matmuls run by torch's {device()} kernel, their operands read by the suite")
    else:
        note(f"NVFP4 matmuls computed by the suite's reading of the declared layout (conformance.nvfp4): this torch has "
             f"no {device()} kernel for them (sm100 GPUs have one)")
    try:
        with nvfp4.read_by_the_suite(compute=not kernel) as reads:
            outputs, grads = call_backend("NVF-002", fp8_backend, "run_joint", case.gm, case.model, args, grad_out,
                                          passing=(nvfp4.LayoutUnreadable,))
    except nvfp4.LayoutUnreadable as exc:
        fail("NVF-002", f"NVFP4 matmul {reads.count - 1} (in the order they ran) could not be computed: {exc} (NVF-001 names "
                        "what differs from the declared layout)", spec)
    check(reads.count >= matmuls, "NVF-002",
          f"the step ran {reads.count} NVFP4 matmuls; its graph holds {matmuls}: run_joint() did not run the traced graph", spec)
    for operand in reads.operands:
        check(
            operand.error < _OPERAND_TOLERANCE,
            "NVF-002",
            f"NVFP4 matmul {operand.matmul} (in the order they ran), {operand.name} {operand.shape}: read in its declared "
            f"layout (BlockWise1x16 e4m3 scales, SWIZZLE_32_4_4, times the global scale) it differs by {operand.error:.3g} "
            f"in relative norm from every high-precision tensor it was computed from (bound {_OPERAND_TOLERANCE:g}): its "
            "scales are not in the layout the matmul is told",
            spec,
        )
    twin = high_precision_twin("NVF-002", spec, case.model)
    hp_outputs, hp_grads = eager_step(twin, args, grad_out)
    missing = sorted(set(hp_grads) - set(grads))
    check(not missing, "NVF-002", f"run_joint() returned no gradients for {missing}, which the high-precision step has", spec)
    pairs = [(f"output {i}", o, hp) for i, (o, hp) in enumerate(zip(outputs, hp_outputs))]
    pairs += [(f"gradient of {name}", grads[name], hp) for name, hp in sorted(hp_grads.items())]
    for label, got, want in pairs:
        error = ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-12)).item()
        check(
            error < _STEP_TOLERANCE,
            "NVF-002",
            f"{label}: the NVFP4 step differs from the high-precision step by {error:.3g} in relative norm (below "
            f"{_STEP_TOLERANCE:g}: closer to it than zero is): its NVFP4 compute is wrong, not merely imprecise",
            spec,
        )
