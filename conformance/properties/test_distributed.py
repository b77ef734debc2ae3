"""DP: FP8 across data and tensor parallelism (capability ``distributed``, since spec 1.3).

The backend shards the suite's models itself (``Backend.shard_data_parallel``,
``Backend.shard_tensor_parallel``) and traces the sharded step with its own ``trace_joint``.
The structural properties (DP-001, DP-002, DP-004) read that graph, traced over torch's fake
process group in this one process (:func:`conformance.run.distributed.fake_mesh`, world size 2):
which all-gathers reach a quantized module's weight is found by data flow from the module's
forward matmuls (the module as the suite's own annotation says), what they move from the
dtypes on their inputs and outputs. DP-003 runs the sharded step in two gloo processes on CPU,
once per session, against the unsharded eager step (marked ``fp8_gloo``: the run checks first
that two gloo ranks can connect on this machine, and ranks that cannot are the machine's problem,
not the backend's).

The backend declares how its weights travel (``Backend.weight_gathers``): as FP8 bytes (DP-001)
and/or in high precision, quantized after the gather (DP-002, DP-005); a property about another is
``not_supported``. A backend that claims ``float8_modules`` is sharded with its own float8 linears
(of its first declared recipe) in DP-001, DP-002, DP-003 and DP-005; DP-004 builds TorchAO's, and
so do float8 all-gather's steps where the backend's own are exactly TorchAO's (the setting is
their config's).
"""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings

from conformance.run.distributed import (
    DP_GRADIENT_TOLERANCE, WORLD_SIZE, GlooCase, casts_after, descendants, fake_mesh, forward_matmuls, gloo_gradients,
    moves_fp8_bytes, only_views_between, weight_gathers, weight_operand,
)
from conformance.run.environment import EnvironmentProblem
from conformance.observe.graphs import is_fp8_compute, scale_operands, trace_with_oracle
from conformance.observe import evidence
from conformance.run.harness import built_with, check, fail, float8_config_settable, fp8_ops, owns_float8
from conformance.draw.models import LayerSpec, ModelSpec, build_model, recipe_compute_counts
from conformance.report.notes import note
from conformance.run.gating import NOT_SUPPORTED
from conformance.draw.strategies import served_spec, sharded_specs

# A sharded trace costs about as much as an unsharded one; two models per property.
_budget = settings(max_examples=max(2, settings.default.max_examples // 12))
_TP_PLAN = {"layers.0": "colwise", "layers.1": "rowwise"}


def _how(float8_all_gather) -> str:
    return (
        f"(the model built by conformance.draw.models.build_model(spec, float8_all_gather={float8_all_gather}), or with "
        f"float8=backend.convert_float8 for a backend's own float8 linears, sharded by "
        f"backend.shard_data_parallel(model, mesh, float8_all_gather={float8_all_gather}) over "
        f"conformance.run.distributed.fake_mesh() and traced by backend.trace_joint)"
    )


def _declared(backend, gather: str) -> None:
    """Skip as not_supported unless the backend's data-parallel steps move weights as ``gather``."""
    if gather not in backend.weight_gathers:
        pytest.skip(f"{NOT_SUPPORTED} backend {backend.name!r} declares weight_gathers {sorted(backend.weight_gathers)}: "
                    f"its data-parallel steps do not gather weights as {gather}")


def _own_modules(backend, float8_all_gather: bool) -> bool:
    """Whether the backend's own float8 linears are the ones sharded (capability ``float8_modules``):
    with float8 all-gather on, TorchAO's are where the backend's are exactly TorchAO's, built
    with the setting (``conformance.run.harness.float8_config_settable``)."""
    if not owns_float8(backend):
        return False
    if float8_all_gather and float8_config_settable(backend):
        note("float8 all-gather on: the backend's own float8 linears are TorchAO's Float8Linear, built by TorchAO with "
             "enable_fsdp_float8_all_gather=True")
        return False
    return True


def sharded_model(backend, spec, float8_all_gather: bool):
    """``(model, args)`` of ``spec`` as the DP properties shard it: TorchAO's float8 linears with
    the setting, or the backend's own float8 linears (``spec`` as served: of recipes they have)."""
    own = _own_modules(backend, float8_all_gather)
    if own:
        model, args = build_model(spec, "cpu", float8=backend.convert_float8)
    else:
        model, args = build_model(spec, "cpu", float8_all_gather=float8_all_gather)
    evidence.built(built_with(backend, spec, model, float8_by_torchao=not own))
    return model, args


@functools.lru_cache(maxsize=32)
def _data_parallel(backend, spec, float8_all_gather: bool):
    with fake_mesh() as mesh:
        model, args = sharded_model(backend, spec, float8_all_gather)
        sharded = backend.shard_data_parallel(model, mesh, float8_all_gather=float8_all_gather)
        return trace_with_oracle(backend, sharded, args, list(spec.quantized_modules()), backend.is_backward)


def _traced_data_parallel(property_id, backend, spec, float8_all_gather):
    try:
        return _data_parallel(backend, spec, float8_all_gather)
    except Exception as exc:
        fail(property_id, f"backend {backend.name!r}: sharding or tracing raised {type(exc).__name__}: {exc} {_how(float8_all_gather)}", spec)


def _weight_gathers_of(property_id, backend, spec, gm, oracle, float8_all_gather):
    """Per quantized module: its forward matmuls and the all-gathers reaching their weight operand;
    a module whose weight no forward all-gather moves fails (an unsharded step passes nothing)."""
    matmuls = forward_matmuls(gm, oracle, backend.is_backward, fp8_ops(property_id, backend))
    found = {}
    for fqn in spec.quantized_modules():
        mms = matmuls.get(fqn, [])
        check(bool(mms), property_id, f"module '{fqn}' issues no forward matmul in the sharded step {_how(float8_all_gather)}", spec)
        gathers = weight_gathers(mms, backend.is_backward)
        check(
            bool(gathers), property_id,
            f"the weight of module '{fqn}' reaches its forward matmul(s) {[m.name for m in mms]} through no all-gather: the "
            f"step is not sharded, or the weight is gathered outside the traced step {_how(float8_all_gather)}", spec,
        )
        found[fqn] = (mms, gathers)
    return found


@pytest.mark.fp8_property("DP-001")
@_budget
@given(spec=sharded_specs())
def test_DP_001_float8_all_gather_moves_every_quantized_weight_as_fp8_bytes(fp8_backend, spec):
    """Cheapest defect, the one users report most: float8 all-gather on, yet the step gathers the
    high-precision weight and quantizes it after the gather (a tracer that bypasses TorchAO's FSDP
    hooks). Every all-gather reaching a quantized module's forward weight operand must move one
    byte per element of FP8 and reach the FP8 matmul through views only."""
    _declared(fp8_backend, "float8")
    spec = served_spec(spec)
    gm, oracle = _traced_data_parallel("DP-001", fp8_backend, spec, True)
    ops = fp8_ops("DP-001", fp8_backend)
    for fqn, (_mms, gathers) in _weight_gathers_of("DP-001", fp8_backend, spec, gm, oracle, True).items():
        for found in gathers:
            where = f"module '{fqn}', forward pass: {found.describe()}"
            dtype = found.wire_dtype
            check(moves_fp8_bytes(found.gather) and getattr(dtype, "itemsize", 0) == 1, "DP-001",
                  f"{where}: float8 all-gather is on, yet the weight is gathered in high precision {_how(True)}", spec)
            computing = only_views_between(found.gather, found.operand)
            check(not computing, "DP-001",
                  f"{where}: the gathered FP8 bytes are computed on before the matmul ({[n.name for n in computing][:4]}: "
                  f"{sorted({str(n.target) for n in computing})[:4]}), not used as gathered {_how(True)}", spec)
            check(is_fp8_compute(found.matmul, ops), "DP-001",
                  f"{where}: the matmul fed by the gathered weight is no FP8 compute {_how(True)}", spec)
            scales = scale_operands(found.matmul)
            after = descendants(found.gather)
            check(len(scales) < 2 or scales[1] not in after, "DP-001",
                  f"{where}: the weight's scale '{scales[1].name if len(scales) > 1 else '?'}' is computed from the gathered "
                  f"bytes (recomputed after the gather), not carried beside them {_how(True)}", spec)


@pytest.mark.fp8_property("DP-002")
@_budget
@given(spec=sharded_specs())
def test_DP_002_without_float8_all_gather_no_weight_gather_moves_fp8(fp8_backend, spec):
    """Cheapest defect: a backend that gathers FP8 whatever the setting says (a trainer that
    ignores ``enable_fsdp_float8_all_gather=False``, which a user turns off for the loss
    divergence TorchAO #4300 reports). With it off, no all-gather reaching a quantized module's
    weight operand may move FP8 bytes, and each module keeps its forward FP8 compute."""
    _declared(fp8_backend, "high_precision")
    spec = served_spec(spec)
    gm, oracle = _traced_data_parallel("DP-002", fp8_backend, spec, False)
    ops = fp8_ops("DP-002", fp8_backend)
    for fqn, (mms, gathers) in _weight_gathers_of("DP-002", fp8_backend, spec, gm, oracle, False).items():
        for found in gathers:
            check(not moves_fp8_bytes(found.gather), "DP-002",
                  f"module '{fqn}', forward pass: {found.describe()}: FP8 bytes on the wire although float8 all-gather is off "
                  f"{_how(False)}", spec)
        computes = [m for m in mms if is_fp8_compute(m, ops)]
        check(len(computes) == 1, "DP-002",
              f"module '{fqn}' issues {len(computes)} forward FP8 matmul(s) in the sharded step, expected 1 (one call) "
              f"{_how(False)}", spec)


@pytest.mark.fp8_property("DP-005")
@_budget
@given(spec=sharded_specs())
def test_DP_005_quantize_after_gather_casts_the_gathered_weight_with_its_own_scale(fp8_backend, spec):
    """Cheapest defects of quantize-after-gather: a weight scale computed from the rank's own
    shard before the gather (ranks then cast the same weight with different scales, and each
    with a scale that does not bound the whole weight), or an FP8 weight cast from the shard
    and upcast for the wire. With float8 all-gather off, every all-gather reaching a quantized
    module's forward weight operand moves high precision, the FP8 weight operand is cast from
    its output (a cast on the path from the gather to the matmul), and the weight's scale is
    computed from its output too."""
    _declared(fp8_backend, "high_precision")
    spec = served_spec(spec)
    gm, oracle = _traced_data_parallel("DP-005", fp8_backend, spec, False)
    ops = fp8_ops("DP-005", fp8_backend)
    for fqn, (mms, gathers) in _weight_gathers_of("DP-005", fp8_backend, spec, gm, oracle, False).items():
        for found in gathers:
            where = f"module '{fqn}', forward pass: {found.describe()}"
            if not is_fp8_compute(found.matmul, ops):
                continue  # DP-002 counts the module's FP8 compute
            check(not moves_fp8_bytes(found.gather), "DP-005", f"{where}: FP8 bytes on the wire {_how(False)}", spec)
            casts = casts_after(found.gather, found.operand)
            check(bool(casts), "DP-005",
                  f"{where}: the FP8 weight operand '{found.operand.name}' is not cast from the gathered weight (no cast to "
                  f"FP8 on the path from the gather to the matmul): it was quantized before the gather {_how(False)}", spec)
            scales = scale_operands(found.matmul, ops)
            weight_scale = scales[-1] if len(scales) == 2 else None
            check(weight_scale is not None, "DP-005",
                  f"{where}: matmul '{found.matmul.name}' reads {len(scales)} scale(s), not one per operand: the weight's "
                  f"scale cannot be told apart {_how(False)}", spec)
            check(weight_scale in descendants(found.gather), "DP-005",
                  f"{where}: the weight's scale '{weight_scale.name}' is not computed from the gathered weight: it comes "
                  f"from this rank's shard, before the gather, so the ranks cast one weight with different scales "
                  f"{_how(False)}", spec)


#: DP-003's models: two tensorwise layers (a backend's own float8 linears: of their first recipe),
#: one with a bias, with float8 all-gather on and off (each as the backend declares).
_GLOO_SPEC = ModelSpec(32, (LayerSpec(64, "tensorwise", bias=True), LayerSpec(32, "tensorwise", activation="none")))
_GLOO_CASES = (GlooCase(_GLOO_SPEC, True), GlooCase(_GLOO_SPEC, False))


@pytest.mark.fp8_property("DP-003")
@pytest.mark.fp8_gloo
def test_DP_003_sharded_gradients_match_the_unsharded_step_over_gloo(fp8_backend):
    """Cheapest defect: summing the ranks' gradients in the reduce-scatter instead of averaging
    them (a reduce op left at its default), off by the world size; and a step that keeps each
    rank's local gradient unreduced. Each rank runs its half of the batch, so only gradients
    averaged over the ranks match the mean of the unsharded step's on the halves."""
    spec = served_spec(_GLOO_SPEC)
    cases = tuple(GlooCase(spec, on, _own_modules(fp8_backend, on)) for on, gather in ((True, "float8"), (False, "high_precision"))
                  if gather in fp8_backend.weight_gathers)
    if len(cases) < len(_GLOO_CASES):
        note(f"run with float8 all-gather {'on' if cases[0].float8_all_gather else 'off'} only: the backend's weight_gathers "
             f"declare {sorted(fp8_backend.weight_gathers)}")
    try:
        results = gloo_gradients(type(fp8_backend), cases)
    except EnvironmentProblem:
        raise  # the ranks could not connect: reported environment_error, not a failure of the backend
    except Exception as exc:
        fail("DP-003", f"backend {fp8_backend.name!r}: the {WORLD_SIZE} gloo processes failed: {type(exc).__name__}: {exc}", spec)
    for case, per_rank in zip(cases, results):
        setting = f"float8 all-gather {'on' if case.float8_all_gather else 'off'}"
        for rank, (status, value) in enumerate(per_rank):
            check(status == "ok", "DP-003", f"rank {rank}, {setting}: the sharded step failed: {value}", case.spec)
            off = {fqn: e for fqn, e in value.items() if e == "missing" or not e <= DP_GRADIENT_TOLERANCE}
            check(not off, "DP-003",
                  f"rank {rank}, {setting}: gradients differ from the mean over the ranks of the unsharded step's on each "
                  f"rank's half of the batch by more than {DP_GRADIENT_TOLERANCE:g} in relative norm: "
                  + ", ".join(f"{fqn}: {e if e == 'missing' else f'{e:.3g}'}" for fqn, e in sorted(off.items())), case.spec)


@functools.lru_cache(maxsize=32)
def _tensor_parallel(backend, spec, rank: int):
    with fake_mesh(rank=rank) as mesh:
        model, args = build_model(spec, "cpu")
        sharded = backend.shard_tensor_parallel(model, mesh, plan=dict(_TP_PLAN))
        return trace_with_oracle(backend, sharded, args, list(spec.quantized_modules()), backend.is_backward)


@pytest.mark.fp8_property("DP-004")
@_budget
@given(spec=sharded_specs(tensor_parallel=True))
def test_DP_004_a_tensor_parallel_fp8_linear_keeps_its_fp8_compute_on_every_rank(fp8_backend, spec):
    """Cheapest defect: tensor parallelism applied with styles that know nothing of FP8, or a
    conversion that skips linears whose weight is a ``DTensor``: the sharded linears compute in
    high precision on every rank. Each module's FP8 matmuls are counted per rank and pass, and
    the forward one must work on the rank's shard of the weight, not on a gathered whole."""
    ops = fp8_ops("DP-004", fp8_backend)
    expected = recipe_compute_counts(spec.calls(), spec.quantized_modules())
    widths = [spec.in_features] + [layer.width for layer in spec.layers]
    shard_of = {  # the weight operand x @ W.T takes: W.T of the rank's shard
        "layers.0": (widths[0], widths[1] // WORLD_SIZE),
        "layers.1": (widths[1] // WORLD_SIZE, widths[2]),
    }
    how = f"(plan {_TP_PLAN}, backend.shard_tensor_parallel over conformance.run.distributed.fake_mesh(rank=..))"
    for rank in range(WORLD_SIZE):
        try:
            gm, oracle = _tensor_parallel(fp8_backend, spec, rank)
        except Exception as exc:
            fail("DP-004", f"rank {rank}: sharding or tracing raised {type(exc).__name__}: {exc} {how}", spec)
        counts = {}
        for node in gm.graph.nodes:
            fqn = oracle.issued_by.get(node)
            if fqn is not None and is_fp8_compute(node, ops):
                key = (fqn, "backward" if fp8_backend.is_backward(node) else "forward")
                counts[key] = counts.get(key, 0) + 1
                if key[1] == "forward":
                    operand = weight_operand(node)
                    shape = tuple(getattr(operand.meta.get("val") if operand is not None else None, "shape", ()))
                    check(shape == shard_of[fqn], "DP-004",
                          f"rank {rank}, module '{fqn}' ({_TP_PLAN[fqn]}): forward FP8 matmul '{node.name}' takes a weight "
                          f"operand of shape {shape}, expected the rank's shard {shard_of[fqn]} {how}", spec)
        for key in sorted(expected, key=lambda k: (k[1] != "forward", k)):  # a lost forward FP8 matmul first
            check(counts.get(key, 0) == expected[key], "DP-004",
                  f"rank {rank}, module '{key[0]}' ({_TP_PLAN[key[0]]}), {key[1]} pass: {counts.get(key, 0)} FP8 matmul(s), "
                  f"expected {expected[key]} {how}", spec)
