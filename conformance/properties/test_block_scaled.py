"""NVF and MXS: block-scaled layers keep their swizzled block layout and compute what it means.

Two kinds of layer hand ``F.scaled_mm`` block scales in cuBLAS's ``SWIZZLE_32_4_4`` layout
(``conformance.judge.block_scaled``):

* NVFP4 linears (capability ``nvfp4``, ``Backend.convert_nvfp4``; kind ``nvfp4_linear``): packed
  FP4 operands, e4m3 scales of blocks of 16 and a float32 global scale.
* Swizzled MX linears (capability ``mx`` with recipe ``mxfp8_swizzled`` in ``Backend.mx_recipes``,
  ``Backend.convert_mx``; kind ``mxfp8_linear``): e4m3 operands, e8m0 scales of blocks of 32.

The other areas draw such layers too, beside float8 ones (PROV, VAL, REG, BND, EMU-002, RWR): they
trace on any device, under torch's own Meta kernel of ``aten._scaled_mm_v2``. These properties
look at what only they have:

* NVF-001 / MXS-001, the layout reaching each matmul, read off the traced graph (the rewritten
  one for a backend that claims ``rewrites``), off each piece of its GraphPP split, and (MXS-001)
  off the matmuls the compiled step runs: the format's operands, recipes, swizzles and scales
  (``conformance.judge.block_scaled.layout_problems``), as many per module and pass as the recipe issues.
* NVF-002 / MXS-002, what the step computes: run with its block-scaled matmuls executed by the
  device's kernel or, where no device here has one (any but sm100), by the suite's own reading of
  the declared layout (``conformance.judge.block_scaled.read_by_the_suite``; the report row says which),
  each operand read in its declared layout reconstructs the high-precision tensor it was
  quantized from (observed at torch's dispatcher), and the step stays near the high-precision
  step. A layout that is declared but not the one the scales are in (row-major scales passed as
  swizzled) reads the wrong block's scale, and fails.
"""

from __future__ import annotations

import collections

import pytest
from hypothesis import given

from conformance.judge import block_scaled
from conformance.api.types import Compiled, StageSplit
from conformance.run.harness import call_backend, check, device, fail, eager_step, fresh_args, grad_outputs, high_precision_twin, traced
from conformance.report.notes import note
from conformance.draw.strategies import MX_SWIZZLED_KIND, NVFP4_KIND, model_specs, runnable_kinds

#: NVF-002's bound on each operand: the relative norm of the difference between the operand
#: dequantized in its declared layout and the high-precision tensor it was quantized from. NVFP4
#: keeps one mantissa bit under a scale per 16 elements: the reference's operands are within
#: 0.11 of their sources over 60 drawn models. A scale read from another block (a wrong layout)
#: is off by the ratio of two blocks' magnitudes, or zero where it lands in padding: the row-major
#: mutant's worst operand is 0.9 or more on every model. MXFP8 keeps three mantissa bits under a
#: power-of-two scale per 32 elements: its bound is tighter (the reference's worst operand over
#: 41 drawn models: 0.05; the row-major mutant's worst per model is 0.86 or more on every one).
_OPERAND_TOLERANCE = {"NVFP4": 0.3, "MXFP8": 0.15}
#: And on the step: closer to the high-precision step than zero is, per output and gradient (the
#: reference's worst NVFP4 step over the same models: 0.68, an early gradient through three NVFP4
#: layers).
_STEP_TOLERANCE = 1.0

#: What each area judges: its property IDs, the format, the drawing kind and the recipe of its
#: real modules.
_AREAS = {
    "NVFP4": ("NVF-001", "NVF-002", block_scaled.NVFP4, NVFP4_KIND, "nvfp4"),
    "MXFP8": ("MXS-001", "MXS-002", block_scaled.MXFP8, MX_SWIZZLED_KIND, "mxfp8_swizzled"),
}

#: MXS-001 compiles this many models per backend and session (a compile costs seconds; NUM-001
#: and NUM-002 compile two as well); the report row says when it stopped.
_COMPILED_MODELS = 2
_compiled_so_far: collections.Counter = collections.Counter()

_real_nvfp4 = model_specs(kinds=(NVFP4_KIND,), emulate=False)
_swizzled_mx = model_specs(kinds=(MX_SWIZZLED_KIND,), emulate=False)


def _format_matmuls(gm, fmt) -> list:
    return [n for n in gm.graph.nodes if block_scaled.matmul_format(n) is fmt]


def _module_matmuls(case, recipe: str) -> list:
    """The low-precision matmuls of the traced graph that modules of ``recipe`` issued, by the
    suite's own attribution: whatever op or layout they take."""
    modules = {fqn for fqn, (_kind, r, _emulate) in case.spec.quantized_modules().items() if r == recipe}
    return [n for n in case.gm.graph.nodes
            if block_scaled.is_low_precision_matmul(n) and case.oracle.issued_by.get(n) in modules]


def _expected_counts(spec, recipe: str) -> dict:
    """(fqn, pass) -> matmuls the recipe issues: forward one per call, backward one for
    grad_input when the call's input needs a gradient and one for grad_weight."""
    counts: dict = {}
    configs = spec.quantized_modules()
    for fqn, input_grad in spec.calls():
        _kind, module_recipe, emulate = configs[fqn]
        if module_recipe != recipe or emulate:
            continue
        counts[(fqn, "forward")] = counts.get((fqn, "forward"), 0) + 1
        counts[(fqn, "backward")] = counts.get((fqn, "backward"), 0) + int(input_grad) + 1
    return counts


def _layout_findings(nodes, fmt, where: str) -> list[str]:
    """One sentence per matmul of ``nodes`` whose layout is not ``fmt``'s declared one."""
    found = []
    for node in nodes:
        problems = block_scaled.layout_problems(node, fmt)
        if problems:
            found.append(f"{where}: {fmt.name} matmul '{node.name}' ({node.target}): " + "; ".join(problems))
    return found


def _kernel(area: str) -> bool:
    """Whether this device runs the area's matmuls (else the suite computes them), said in the row."""
    _layout_id, _numeric_id, fmt, kind, _recipe = _AREAS[area]
    kernel = kind in runnable_kinds(device())
    if kernel:
        note(f"{fmt.name} matmuls run by torch's {device()} kernel, their operands read by the suite")
    else:
        note(f"{fmt.name} matmuls computed by the suite's reading of the declared layout (conformance.judge.block_scaled): this "
             f"torch has no {device()} kernel for them (sm100 GPUs have one)")
    return kernel


def _run_read(property_id: str, fmt, backend, case, args, grad_out, kernel: bool, fn=None):
    """Run the step (``fn``: a compiled one) under the suite's reading; ``(outputs, grads, reads)``."""
    try:
        with block_scaled.read_by_the_suite(compute=not kernel) as reads:
            outputs, grads = call_backend(property_id, backend, "run_joint", case.gm, case.model, args, grad_out, fn=fn,
                                          passing=(block_scaled.LayoutUnreadable,))
    except block_scaled.LayoutUnreadable as exc:
        where = "the compiled step" if fn is not None else "the step"
        fail(property_id, f"{where}: {fmt.name} matmul {reads.count[fmt.name] - 1} (in the order they ran) could not be "
                          f"computed: {exc}", case.spec)
    return outputs, grads, reads


def _layout_findings_of_step(area: str, backend, spec) -> list[str]:
    """NVF-001 / MXS-001: what differs from the declared layout at every matmul of the area's
    modules, traced, split and (MXS) compiled, and from their count per module and pass, one
    sentence each (empty: the rule holds)."""
    property_id, _numeric_id, fmt, _kind, recipe = _AREAS[area]
    case = traced(property_id, backend, spec)
    issued = _module_matmuls(case, recipe)
    # Every FP4 matmul is NVFP4's; an MX matmul elsewhere (the e8m0 op of an mxfp8 module) may
    # take another layout, and the drawn models hold none.
    others = [n for n in _format_matmuls(case.gm, fmt) if n not in issued] if fmt is block_scaled.NVFP4 else []
    found = _layout_findings(issued + others, fmt, "traced graph")
    joint = len(_format_matmuls(case.gm, fmt))
    seen = dict(collections.Counter(
        (case.oracle.issued_by.get(n), "backward" if backend.is_backward(n) else "forward") for n in issued
    ))
    expected = _expected_counts(spec, recipe)
    if seen != expected:
        found.append(
            f"low-precision matmuls of the {recipe} modules per (module, pass), by the suite's count: {seen}; the recipe "
            f"issues {expected} (one forward per call; backward one for grad_input where the input needs a gradient and one "
            "for grad_weight)")
    if "graphpp" not in backend.capabilities:
        note("GraphPP pieces not checked: the backend does not claim graphpp")
    else:
        split = call_backend(property_id, backend, "split_stage", case.gm, strict=True, expect=StageSplit)
        pieces = 0
        for name in ("forward", "backward_input", "backward_weight"):
            nodes = _format_matmuls(getattr(split, name), fmt)
            pieces += len(nodes)
            found += _layout_findings(nodes, fmt, f"split_stage's {name}")
        if pieces != joint:
            found.append(f"split_stage's forward, dI and dW callables hold {pieces} {fmt.name} matmuls; the joint graph {joint}")
    if area == "MXFP8":
        found += _compiled_layout_findings(property_id, fmt, backend, case, joint)
    return found


def _compiled_layout_findings(property_id: str, fmt, backend, case, joint: int) -> list[str]:
    """MXS-001's compiled clause: the matmuls the compiled step runs, observed at the dispatcher,
    take the declared layout, as many as the graph holds. A compile that refuses the graph is
    said in the row (NUM-001 and NUM-002 judge what compiles)."""
    mode = next((m for m in ("full", "regional") if f"compile.{m}" in backend.capabilities), None)
    if mode is None:
        note("compiled step not checked: the backend claims neither compile.full nor compile.regional")
        return []
    key = (type(backend).__module__, type(backend).__qualname__, backend.name)
    if _compiled_so_far[key] >= _COMPILED_MODELS:
        note(f"compiled step checked on the first {_COMPILED_MODELS} models of the session only")
        return []
    _compiled_so_far[key] += 1
    try:
        compiled = backend.compile(case.gm, mode=mode)
    except Exception as exc:  # the backend's word on a graph Inductor may not lower: said, not judged
        note(f"compiled step not checked: compile(mode={mode!r}) refused the graph: {type(exc).__name__}: "
             f"{str(exc).splitlines()[0][:200]}")
        return []
    if not isinstance(compiled, Compiled):
        return [f"compile() returned {type(compiled).__qualname__}, expected Compiled"]
    kernel = _kernel("MXFP8")
    spec = case.spec
    _outputs, _grads, reads = _run_read(property_id, fmt, backend, case, fresh_args(spec, 13), grad_outputs(spec, 14),
                                        kernel, fn=compiled.fn)
    found = [f"compiled step (mode {mode!r}): {fmt.name} matmul {index} (in the order they ran): " + "; ".join(problems)
             for _name, index, problems in reads.problems]
    if reads.count[fmt.name] < joint:
        found.append(f"the compiled step (mode {mode!r}) ran {reads.count[fmt.name]} {fmt.name} matmuls in the declared "
                     f"layout; the graph holds {joint}")
    return found


def _numeric_property(area: str, backend, spec) -> None:
    """NVF-002 / MXS-002: every matmul runs, each operand read in its declared layout is near
    its high-precision source, and the step near the high-precision step."""
    _layout_id, property_id, fmt, _kind, _recipe = _AREAS[area]
    case = traced(property_id, backend, spec)
    matmuls = len(_format_matmuls(case.gm, fmt))
    args, grad_out = fresh_args(spec, 11), grad_outputs(spec, 12)
    outputs, grads, reads = _run_read(property_id, fmt, backend, case, args, grad_out, _kernel(area))
    check(reads.count[fmt.name] >= matmuls, property_id,
          f"the step ran {reads.count[fmt.name]} {fmt.name} matmuls; its graph holds {matmuls}: run_joint() did not run "
          "the traced graph", spec)
    bound = _OPERAND_TOLERANCE[area]
    for operand in reads.operands:
        if operand.format != fmt.name:
            continue
        check(
            operand.error < bound,
            property_id,
            f"{fmt.name} matmul {operand.matmul} (in the order they ran), {operand.name} {operand.shape}: read in its "
            f"declared layout ({fmt.describe()}) it differs by {operand.error:.3g} in relative norm from every "
            f"high-precision tensor it was computed from (bound {bound:g}): its scales are not in the layout the "
            "matmul is told",
            spec,
        )
    twin = high_precision_twin(property_id, spec, case.model)
    hp_outputs, hp_grads = eager_step(twin, args, grad_out)
    missing = sorted(set(hp_grads) - set(grads))
    check(not missing, property_id, f"run_joint() returned no gradients for {missing}, which the high-precision step has", spec)
    pairs = [(f"output {i}", o, hp) for i, (o, hp) in enumerate(zip(outputs, hp_outputs))]
    pairs += [(f"gradient of {name}", grads[name], hp) for name, hp in sorted(hp_grads.items())]
    for label, got, want in pairs:
        error = ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-12)).item()
        check(
            error < _STEP_TOLERANCE,
            property_id,
            f"{label}: the {fmt.name} step differs from the high-precision step by {error:.3g} in relative norm (below "
            f"{_STEP_TOLERANCE:g}: closer to it than zero is): its {fmt.name} compute is wrong, not merely imprecise",
            spec,
        )


@pytest.mark.fp8_property("NVF-001")
@given(spec=_real_nvfp4)
def test_NVF_001_every_nvfp4_matmul_takes_its_declared_two_level_block_layout(fp8_backend, spec):
    """Cheapest defects: NVFP4 layers that drop the global scale (one e4m3 scale list, which
    torch accepts and which works until a tensor's range outgrows e4m3), or that quantize with
    MX's e8m0 scales of blocks of 32 (MXFP4, which torch accepts too), or that fall back to FP8 or
    high precision for a matmul. Every NVFP4 matmul of the traced graph and of each piece of its
    GraphPP split must have the declared layout, and each NVFP4 module must issue its recipe's
    count of them per pass, by the suite's own attribution."""
    found = _layout_findings_of_step("NVFP4", fp8_backend, spec)
    check(not found, "NVF-001", "\n".join(found), spec)


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
    _numeric_property("NVFP4", fp8_backend, spec)


@pytest.mark.fp8_property("MXS-001")
@given(spec=_swizzled_mx)
def test_MXS_001_every_swizzled_mx_matmul_takes_its_declared_layout(fp8_backend, spec):
    """Cheapest defects: swizzled MX layers that hand ``F.scaled_mm`` their scales with
    ``NO_SWIZZLE`` (row-major, which torch accepts), or that fall back for a matmul to the
    row-major e8m0 op, to tensorwise FP8 or to high precision; or a compile that re-lays the
    scales out. Every low-precision matmul the swizzled MX modules issue (by the suite's own
    attribution), and every MX matmul of each piece of the GraphPP split and of the compiled step,
    must be ``F.scaled_mm`` with ``BlockWise1x32`` e8m0 scales in ``SWIZZLE_32_4_4``, as many per
    module and pass as the recipe issues."""
    found = _layout_findings_of_step("MXFP8", fp8_backend, spec)
    check(not found, "MXS-001", "\n".join(found), spec)


@pytest.mark.fp8_property("MXS-002")
@given(spec=_swizzled_mx)
def test_MXS_002_the_swizzled_mx_step_computes_what_its_declared_layout_means(fp8_backend, spec):
    """Cheapest defect: e8m0 scales kept row-major (padded to the swizzled size) while the matmul
    is told ``SWIZZLE_32_4_4``: every shape check passes and each row reads another row's scale.
    Run on fresh inputs, every swizzled MX matmul must run, each operand read in its declared
    layout must reconstruct the high-precision tensor it was quantized from, and the step must be
    closer to the high-precision step than zero is."""
    _numeric_property("MXFP8", fp8_backend, spec)
