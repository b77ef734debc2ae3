"""FPR: a precompiled artifact is only ever used under the FP8 configuration it was built for.

The changes are the suite's own (``conformance.draw.fingerprints``): it converts real models with
TorchAO, flips recipes, ``emulate`` flags and ``Float8LinearConfig`` fields, the ``strict`` flag and
the torch/torchao versions (``__version__`` and package metadata), and knows which words a
readable error or diff must name. Compilation happens once per session (FPR-004 saves one
artifact of a fixed model and loads it under drawn changes); everything else only fingerprints
models and stays fast.

What the rules hold a fingerprint to depends on what the backend declares it covers
(``Backend.fingerprint_scope``, :data:`conformance.judge.fingerprint_scopes.SCOPE_PROMISES`): every scope
changes with every quantization input and is equal for models built alike, in any process; only
a ``"quantization"`` fingerprint must also ignore structure, registration order and unrelated job
settings. Config-field changes are drawn from what the backend's jobs can express
(``Backend.expressible_config_fields``); refusing an inexpressible one
(``conformance.api.UnsupportedConfig``) is ``not_supported``, refusing a model converted from
named recipes a failure. Every message says which of signature and fingerprint changed.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import shutil
import tempfile
import warnings

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance.api.errors import FingerprintMismatch, UnsupportedConfig
from conformance.api.types import JobConfigs
from conformance.judge.fingerprint_scopes import promises_of
from conformance.draw.fingerprints import (
    ARTIFACT_SPEC,
    CONFIG_FIELDS,
    CONFIG_KINDS,
    QUANTIZATION_KINDS,
    STRUCTURE_KINDS,
    UNRELATED_KINDS,
    Variant,
    drawable_config_fields,
    fingerprints_in_subprocess,
    flippable,
    grouped_kind,
    json_diff,
    layer_changes,
    quantization_changes,
    reordered,
    unrelated_changes,
)
from conformance.observe import evidence
from conformance.draw import strategies
from conformance.run.harness import built_with, call_backend, check, fail, float8_config_settable, float8_converter, owns_float8
from conformance.draw.models import MX_RECIPES, NVFP4_RECIPES, SCALED_MM_RECIPES, LayerSpec, ModelSpec, build_model
from conformance.draw.moe import MoESpec, experts_family
from conformance.report.notes import note
from conformance.run.gating import NOT_SUPPORTED
from conformance.draw.strategies import FLOAT8_RECIPES, model_specs, served_spec
from conformance.draw.versions import current_version, other_version


def _fingerprint(property_id, backend, variant: Variant, model=None) -> tuple[str, str]:
    """``(fingerprint, signature JSON)`` of ``variant`` as the backend computes them."""
    if model is None:
        model, _ = _build(property_id, backend, variant)
    with variant.patched():
        try:
            fingerprint = call_backend(property_id, backend, "fingerprint", model, strict=variant.strict, expect=str, passing=UnsupportedConfig)
            signature = call_backend(property_id, backend, "quantization_signature", model, strict=variant.strict, expect=str, passing=UnsupportedConfig)
        except UnsupportedConfig as exc:
            _refused(property_id, backend, variant, exc)
    return fingerprint, signature


class _RefusedAsInexpressible(Exception):
    """A model with a config field the backend declares inexpressible was refused: a right
    answer for that example, while its jobs' expressible fields are still drawn."""


def _refused(property_id, backend, variant: Variant, exc: UnsupportedConfig) -> None:
    """The backend refused ``variant``'s model as inexpressible: ``not_supported`` when the model
    holds flipped config fields the backend does not declare expressible, a failure otherwise."""
    flipped = sorted({name for _, name in variant.config_fields})
    declared = getattr(backend, "expressible_config_fields", None)
    if flipped and (declared is None or not all(set(CONFIG_FIELDS[name][0]) <= set(declared) for name in flipped)):
        declared_text = "" if declared is None else f"; expressible_config_fields {sorted(declared)}"
        note(f"config-field changes the backend refuses as inexpressible (UnsupportedConfig{declared_text}) are not_supported: {', '.join(flipped)}")
        if declared:
            # Its jobs express other fields: their changes are still drawn and checked.
            raise _RefusedAsInexpressible
        pytest.skip(
            f"{NOT_SUPPORTED} backend {backend.name!r} refuses a config its jobs cannot express "
            f"(Float8LinearConfig {', '.join(flipped)} flipped; UnsupportedConfig: {exc})"
        )
    why = (
        f"it declares the flipped fields {flipped} expressible (expressible_config_fields)" if flipped
        else "every quantized module of it is converted from a named recipe, which every job can express"
    )
    fail(property_id, f"backend {backend.name!r} refused the model ({variant.describe()}) with UnsupportedConfig, yet {why}: {exc}", variant.spec)


def _config_fields(fp8_backend, kind, *, inexpressible=False):
    """The ``CONFIG_FIELDS`` entries ``kind``'s changes may flip for the backend (None for a kind
    that flips none): those its jobs can express, or every one with ``inexpressible``. A config
    kind the backend's jobs can express no change of is skipped as ``not_supported``, at the
    first example, before any change is drawn."""
    if kind not in CONFIG_KINDS:
        return None
    fields = drawable_config_fields(None if inexpressible else getattr(fp8_backend, "expressible_config_fields", None))
    flips = [(n,) for n in fields] if kind == "config_field" else [(a, b) for a in fields for b in fields if a != b]
    if not any(flippable(recipe, names) for recipe in FLOAT8_RECIPES for names in flips):
        declared = sorted(fp8_backend.expressible_config_fields or ())
        note(f"{kind} changes not_supported: the backend's jobs express none (expressible_config_fields {declared})")
        pytest.skip(
            f"{NOT_SUPPORTED} backend {fp8_backend.name!r}'s jobs express no {kind} change: "
            f"expressible_config_fields is {declared}"
        )
    if not float8_config_settable(fp8_backend):
        note(f"{kind} changes not_supported: the backend builds its own float8 linears (float8_modules), which have no Float8LinearConfig")
        pytest.skip(
            f"{NOT_SUPPORTED} backend {fp8_backend.name!r} builds its own float8 linears (float8_modules): "
            f"{kind} changes flip TorchAO's Float8LinearConfig, which they do not have"
        )
    if owns_float8(fp8_backend):
        note(f"{kind} changes built with TorchAO: the backend's own float8 linears (float8_modules) are TorchAO's Float8Linear "
             "with its recipes' configs, so TorchAO's build differs in the flipped fields alone")
    return fields


def _drawn_changes(fp8_backend, kind, data, fields):
    """The change of ``kind`` and, where the backend claims grouped experts and ``kind`` has a
    change of theirs (:data:`~conformance.draw.fingerprints.GROUPED_KINDS`), that change too, on an
    MoE model: every example asks about both families, at the cost of two fingerprints of a
    model that is never traced."""
    changes = [data.draw(quantization_changes(kind, fields=fields), label="change")]
    grouped = grouped_kind(kind, fp8_backend.capabilities)
    if grouped is not None:
        changes.append(data.draw(quantization_changes(grouped), label="change of grouped experts"))
    return changes


def _what_else(name: str, before: str, after: str) -> str:
    """How the other of signature and fingerprint (``name``) went, for a failure message."""
    return f"the {name} changed too" if before != after else f"the {name} stayed the same"


def _build(property_id, backend, variant: Variant):
    """Build ``variant``'s model; its MX, ``F.scaled_mm`` and NVFP4 layers and its grouped
    experts, if any, through the backend's converters, and its float8 linears too unless the
    variant flips config fields, which only TorchAO's build can (:func:`float8_config_settable`)."""
    claims = backend.capabilities
    by_torchao = bool(variant.config_fields) and owns_float8(backend)
    try:
        model, args = variant.build(
            mx=backend.convert_mx if "mx" in claims else None, float8=None if by_torchao else float8_converter(backend),
            scaled_mm=backend.convert_scaled_mm if "scaled_mm_v2" in claims else None,
            nvfp4=backend.convert_nvfp4 if "nvfp4" in claims else None,
            grouped=backend.convert_grouped_experts if "moe" in claims else None,
            scaled_grouped=backend.convert_scaled_grouped_experts if "scaled_grouped_mm_v2" in claims else None,
        )
    except Exception as exc:
        fail(property_id, f"backend {backend.name!r}: building the model ({variant.describe()}) raised {type(exc).__name__}: {exc}", variant.spec)
    built = built_with(backend, variant.spec, model, float8_by_torchao=by_torchao)
    if isinstance(variant.spec, MoESpec):
        built = tuple((experts_family(variant.spec), *entry[1:]) for entry in built)
    evidence.built(built)
    return model, args


def _built(backend, spec):
    """``build_model(spec)``, the float8 layers the backend's own where it claims ``float8_modules``."""
    return build_model(spec, float8=float8_converter(backend))


def _artifact_spec() -> ModelSpec:
    """The artifact's model as the backend under test builds it (``served_spec``)."""
    return served_spec(ARTIFACT_SPEC)


def _fail(property_id, message, change) -> None:
    fail(property_id, message + "\n\nThe change (runnable):\n" + change.to_python())


# --- FPR-001 --------------------------------------------------------------------------------------


@pytest.mark.fp8_property("FPR-001")
@pytest.mark.parametrize("kind", QUANTIZATION_KINDS)
@given(data=st.data())
def test_FPR_001_changing_a_quantization_input_changes_the_fingerprint(fp8_backend, kind, data):
    """Cheapest defects once let through: a signature keyed by the position of each quantized
    module rather than its FQN (conversion only ever added or removed, never moved); one that
    drops a config field, hidden because every flip started from a named recipe and so renamed
    it "custom"; one that ignores the forward operands' cast configs or MX modules, never flipped
    or drawn. Now conversion also moves to another plain layer with the same config, flips also
    start from a custom config, every numerics-relevant field of ``Float8LinearConfig`` and its
    cast and gemm configs is flipped, and MX layers are drawn for a backend that claims ``mx``.
    A version read from package metadata (``importlib.metadata.version``) rather than
    ``__version__`` sees the change too; it holds for every fingerprint scope. A backend that
    declares some config fields inexpressible (``expressible_config_fields``) and then ignores a
    change of one, neither refusing the model nor changing its fingerprint, would load an
    artifact built for another config: such fields are flipped too, and only a refusal
    (``UnsupportedConfig``, not_supported) or another fingerprint passes. A fingerprint that lists
    linears only, identical with and without FP8 experts, passed every change of linears: for a
    backend that claims ``moe``, every example of a kind with a change of grouped experts (which
    experts modules are converted, ``emulate``, and with ``scaled_grouped_mm_v2`` the API of
    their grouped GEMMs) also makes that change, on an MoE model of either API."""
    fields = _config_fields(fp8_backend, kind, inexpressible=True)
    for change in _drawn_changes(fp8_backend, kind, data, fields):
        try:
            before, signature_before = _fingerprint("FPR-001", fp8_backend, change.before)
            after, signature_after = _fingerprint("FPR-001", fp8_backend, change.after)
        except _RefusedAsInexpressible:
            continue
        if before == after:
            _fail("FPR-001", f"{change.description}, yet the fingerprint stayed {before} "
                  f"({_what_else('signature', signature_before, signature_after)})", change)


@pytest.mark.fp8_property("FPR-001")
def test_FPR_001_every_config_field_flip_of_every_recipe_changes_the_fingerprint(fp8_backend):
    """Cheapest defect: a fingerprint that leaves out one config field (the forward operands'
    target dtype, say), asked about only when a draw happens to flip that field. The config
    fields are a finite space, so they are enumerated rather than sampled. On a one-layer model of each of the
    backend's float8 recipes, every :data:`~conformance.draw.fingerprints.CONFIG_FIELDS` entry torchao
    accepts for that recipe is flipped, from a custom config (another field flipped in both
    models, so that the recipe's name cannot stand in for the field); each must change the
    fingerprint (or, for a field the backend declares inexpressible, be refused). Every field
    missed is named at once."""
    fields = _config_fields(fp8_backend, "config_field", inexpressible=True)
    # The base flip is one the backend's jobs express where one is, so that it is not refused.
    expressible = set(drawable_config_fields(getattr(fp8_backend, "expressible_config_fields", None)))
    bases = sorted(fields, key=lambda f: f not in expressible)
    missed, refused, flipped = [], [], 0
    spec_of = {recipe: ModelSpec(32, (LayerSpec(32, recipe, activation="none"),)) for recipe in strategies.float8_recipes()}
    for recipe, spec in spec_of.items():
        for name in fields:
            first = next((f for f in bases if f != name and flippable(recipe, (f, name))), None)
            if first is None:
                continue
            before_variant = Variant(spec, config_fields=((0, first),))
            try:
                before, _ = _fingerprint("FPR-001", fp8_backend, before_variant)
                after, _ = _fingerprint("FPR-001", fp8_backend, dataclasses.replace(before_variant, config_fields=((0, first), (0, name))))
            except _RefusedAsInexpressible:
                refused.append(f"{recipe}: {name}")
                continue
            flipped += 1
            if after == before:
                missed.append(f"{recipe}: {name} (from {first} flipped)")
    note(f"enumerated {flipped} config-field flips over recipes {list(strategies.float8_recipes())}"
         + (f"; refused as inexpressible: {', '.join(refused)}" if refused else ""))
    check(not missed, "FPR-001",
          f"flipping each of these Float8LinearConfig fields (on layers.0, a one-layer model of that recipe, from a custom "
          f"config) left the fingerprint unchanged: {', '.join(missed)}; the fingerprint must cover every numerics-relevant field "
          f"(conformance.draw.fingerprints.CONFIG_FIELDS)")


@pytest.mark.fp8_property("FPR-001")
def test_FPR_001_every_recipe_change_and_emulate_flip_changes_the_fingerprint(fp8_backend):
    """Cheapest defect: a fingerprint that tells two recipes apart by something one pair of them
    shares (rowwise and rowwise_with_gw_hp, say), or leaves one kind's emulation out, asked about
    only when a draw happens to change that layer to that recipe. Recipes are a finite space, so
    their changes are enumerated rather than sampled: on a one-layer model of each recipe of
    each kind of linear the backend converts, every recipe the layer can take and its emulation
    flipped (:func:`~conformance.draw.fingerprints.layer_changes`) must change the fingerprint. Every
    change missed is named at once."""
    missed, changed = [], 0
    for recipe in _layer_recipes(fp8_backend):
        base = Variant(ModelSpec(32, (LayerSpec(32, recipe, emulate=recipe.endswith("_emulated"), activation="none"),)))
        for change in layer_changes("recipe", base, 0) + layer_changes("emulate", base, 0):
            before, _ = _fingerprint("FPR-001", fp8_backend, change.before)
            after, _ = _fingerprint("FPR-001", fp8_backend, change.after)
            changed += 1
            if after == before:
                missed.append(change.description.removeprefix("layers.0: "))
    note(f"enumerated {changed} recipe changes and emulate flips over recipes {list(_layer_recipes(fp8_backend))}")
    check(not missed, "FPR-001",
          f"on a one-layer model (layers.0), these changes left the fingerprint unchanged: {', '.join(missed)}; the fingerprint "
          "must cover each quantized module's recipe and emulation")


#: How a version change is made (``conformance.draw.versions.other_version``): a post-release or a local label.
VERSION_CHANGES = ("post", "local")


@pytest.mark.fp8_property("FPR-001")
def test_FPR_001_every_version_change_changes_the_fingerprint(fp8_backend):
    """Cheapest defect: a fingerprint that reads a version only up to its public release
    (``2.13.0`` of ``2.13.0+cpu.other``) or only from ``__version__``, asked about only when a
    draw picks that package and that kind of change. The versions are a finite space: torch's
    and torchao's, each changed as a post-release and as a local label (``__version__`` and
    package metadata alike), on a one-layer model; every change must change the fingerprint,
    every one missed named at once."""
    recipe = strategies.float8_recipes()[0]
    base = Variant(ModelSpec(32, (LayerSpec(32, recipe, emulate=False, activation="none"),)))
    before, _ = _fingerprint("FPR-001", fp8_backend, base)
    missed = []
    for name in ("torch", "torchao"):
        for how in VERSION_CHANGES:
            version = other_version(current_version(name), how)
            after, _ = _fingerprint("FPR-001", fp8_backend, dataclasses.replace(base, versions=((name, version),)))
            if after == before:
                missed.append(f"{name} {current_version(name)!r} -> {version!r}")
    note(f"enumerated {2 * len(VERSION_CHANGES)} version changes (torch, torchao; {', '.join(VERSION_CHANGES)})")
    check(not missed, "FPR-001",
          f"on a one-layer {recipe} model, these version changes (__version__ and package metadata) left the fingerprint "
          f"unchanged: {', '.join(missed)}; the fingerprint must cover the torch and torchao versions in full")


def _layer_recipes(backend) -> tuple[str, ...]:
    """The recipes of every kind of linear the suite shows the backend: its float8 linears', and
    those of the kinds it claims (``F.scaled_mm``, its declared MX recipes, NVFP4)."""
    claims = backend.capabilities
    return (
        strategies.float8_recipes()
        + (SCALED_MM_RECIPES if "scaled_mm_v2" in claims else ())
        + (tuple(r for r in MX_RECIPES if r in backend.mx_recipes) if "mx" in claims else ())
        + (NVFP4_RECIPES if "nvfp4" in claims else ())
    )


# --- FPR-002 --------------------------------------------------------------------------------------


@pytest.mark.fp8_property("FPR-002")
@given(spec=model_specs())
def test_FPR_002_equal_configs_give_equal_fingerprints_in_any_registration_order(fp8_backend, spec):
    """Cheapest defect within one process: a signature listing modules, parameters or config
    fields in registration order, unsorted, or a ``"quantization"``-scope fingerprint that
    digests the parameters in registration order. The model is built twice and once with
    modules, parameters and buffers registered in reverse order; the two builds must agree in
    both, the reversed one in its signature, and in its fingerprint where the scope promises it
    (a ``"whole_step"`` key may bind state by position)."""
    variant = Variant(spec)
    first = _fingerprint("FPR-002", fp8_backend, variant)
    second = _fingerprint("FPR-002", fp8_backend, variant)
    fresh, _ = _built(fp8_backend, spec)
    turned = _fingerprint("FPR-002", fp8_backend, variant, model=reordered(fresh, spec))
    check(first[0] == second[0], "FPR-002",
          f"two builds of one model give different fingerprints: {first[0]} vs {second[0]} ({_what_else('signature', first[1], second[1])})", spec)
    check(first[1] == second[1], "FPR-002", f"two builds of one model give different signatures:\n{first[1]}\nvs\n{second[1]}", spec)
    check(
        first[1] == turned[1],
        "FPR-002",
        f"registering the modules, parameters and buffers in reverse order changed the signature "
        f"({_what_else('fingerprint', first[0], turned[0])}):\n{first[1]}\nvs\n{turned[1]}",
        spec,
    )
    if promises_of(fp8_backend).registration_order:
        check(
            first[0] == turned[0],
            "FPR-002",
            f"registering the modules, parameters and buffers in reverse order changed the fingerprint: {first[0]} vs "
            f"{turned[0]} (the signature stayed the same); backend {fp8_backend.name!r} declares fingerprint_scope "
            f"{fp8_backend.fingerprint_scope!r}, a digest of the signature alone (a key that binds state by position "
            f"declares 'whole_step')",
            spec,
        )
    else:
        note(f"reverse registration order: signature compared, fingerprint not (fingerprint_scope {fp8_backend.fingerprint_scope!r})")


#: Models the cross-process check builds in every process: nesting, several recipes, emulation.
CROSS_PROCESS_SPECS = (
    ModelSpec(
        in_features=16,
        layers=(
            LayerSpec(width=16, recipe="tensorwise", bias=True, adapter=True),
            LayerSpec(width=32, recipe=None),
            LayerSpec(width=32, recipe="rowwise_with_gw_hp", emulate=True, calls=2),
        ),
    ),
    ModelSpec(in_features=32, layers=(LayerSpec(width=16, recipe="rowwise", emulate=False, activation="gelu"),)),
)


@pytest.mark.fp8_property("FPR-002")
def test_FPR_002_equal_fingerprints_across_processes_and_hash_seeds(fp8_backend):
    """Cheapest defect that one process cannot see: a digest through Python's ``hash()``, stable
    until ``PYTHONHASHSEED`` changes. A child process with another seed than this one's (0, or
    1 where this process runs with 0) builds each model in registration order and in reverse
    order, and must compute the same fingerprints and signatures; a
    ``"whole_step"`` fingerprint of the reversed model is compared with this process's of the
    reversed model, so the hash seed is still checked for it."""
    order_free = promises_of(fp8_backend).registration_order
    specs = [served_spec(spec) for spec in CROSS_PROCESS_SPECS]
    here = [_fingerprint("FPR-002", fp8_backend, Variant(spec)) for spec in specs]
    here_reversed = here if order_free else [
        _fingerprint("FPR-002", fp8_backend, Variant(spec), model=reordered(_built(fp8_backend, spec)[0], spec)) for spec in specs
    ]
    try:
        children = fingerprints_in_subprocess(fp8_backend, specs)
    except Exception as exc:
        fail("FPR-002", f"backend {fp8_backend.name!r}: fingerprinting in a child process failed: {exc}")
    for child in children:
        mine = here_reversed if child["reordered"] else here
        for spec, (_, signature), (fingerprint, _), theirs in zip(specs, here, mine, child["results"]):
            order = "reverse" if child["reordered"] else "the same"
            check(
                theirs["fingerprint"] == fingerprint,
                "FPR-002",
                f"a process with PYTHONHASHSEED={child['seed']} building the model with {order} registration order "
                f"computes fingerprint {theirs['fingerprint']}, this process {fingerprint} with {order if not order_free else 'the same'} "
                f"order ({_what_else('signature', theirs['signature'], signature)})",
                spec,
            )
            check(
                theirs["signature"] == signature,
                "FPR-002",
                f"a process with PYTHONHASHSEED={child['seed']} ({order} registration order) computes another signature "
                f"than this process:\n{theirs['signature']}\nvs here\n{signature}",
                spec,
            )


# --- FPR-003 --------------------------------------------------------------------------------------


@pytest.mark.fp8_property("FPR-003")
@pytest.mark.parametrize("kind", UNRELATED_KINDS)
@given(data=st.data())
def test_FPR_003_settings_unrelated_to_quantization_leave_the_signature_alone(fp8_backend, kind, data):
    """Cheapest defect: recording a setting that is not quantization (a module's ``training``
    flag, a parameter's ``requires_grad``, an unrelated buffer), so ``eval()`` or freezing a
    layer recompiles. Each unrelated change must leave the signature alone, and the fingerprint
    too, except that a ``"whole_step"`` key may change with structure (unrelated buffers, the
    model around the quantized modules); it must still ignore mode, flags, values and plain
    attributes."""
    change = data.draw(unrelated_changes(kind), label="change")
    before = _fingerprint("FPR-003", fp8_backend, change.before)
    after = _fingerprint("FPR-003", fp8_backend, change.after)
    if before[1] != after[1]:
        differences = json_diff(json.loads(before[1]), json.loads(after[1]))
        _fail("FPR-003", f"{change.description} is unrelated to quantization, yet the signature changed "
              f"({_what_else('fingerprint', before[0], after[0])}): {differences[:8]}", change)
    if before[0] == after[0]:
        return
    if kind in STRUCTURE_KINDS and not promises_of(fp8_backend).structure:
        note(f"structure changes: signature compared, fingerprint not (fingerprint_scope {fp8_backend.fingerprint_scope!r})")
        return
    scope = fp8_backend.fingerprint_scope
    hint = "" if kind not in STRUCTURE_KINDS else " (a key that covers structure declares fingerprint_scope 'whole_step')"
    _fail("FPR-003", f"{change.description} is unrelated to quantization, yet the fingerprint changed: {before[0]} -> {after[0]} "
          f"(the signature stayed the same; fingerprint_scope {scope!r}){hint}", change)


# --- FPR-004 --------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _saved_artifact(backend) -> str:
    directory = tempfile.mkdtemp(prefix="fp8conf-fpr-")
    atexit.register(shutil.rmtree, directory, True)
    path = f"{directory}/artifact.fp8"
    model, args = _built(backend, _artifact_spec())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        backend.save_artifact(path, model, args, strict=True)
    return path


def _artifact(backend) -> str:
    try:
        return _saved_artifact(backend)
    except Exception as exc:
        fail("FPR-004", f"backend {backend.name!r}: save_artifact() raised {type(exc).__name__}: {exc}", _artifact_spec())


def _relative_error(a, b) -> float:
    import torch

    a, b = a.detach().double(), b.detach().double()
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30))


@pytest.mark.fp8_property("FPR-004")
def test_FPR_004_an_artifact_loads_and_runs_under_its_own_fingerprint(fp8_backend, warm_inductor):
    """Cheapest defect that the mismatch test alone lets through: a loader that refuses every
    artifact, or returns a callable that computes something else. The artifact must load under
    its own configuration and match the joint graph within 3e-2."""
    import torch

    path = _artifact(fp8_backend)
    model, args = _built(fp8_backend, _artifact_spec())
    run = call_backend("FPR-004", fp8_backend, "load_artifact", path, model, strict=True)
    check(callable(run), "FPR-004", f"load_artifact() returned {type(run).__qualname__}, not a callable", _artifact_spec())
    grad_outputs = (torch.ones(_artifact_spec().batch, _artifact_spec().layers[-1].width),)
    try:
        outputs, grads = run(args, grad_outputs)
    except Exception as exc:
        fail("FPR-004", f"the loaded artifact raised {type(exc).__name__}: {exc}", _artifact_spec())
    gm = call_backend("FPR-004", fp8_backend, "trace_joint", model, args)
    eager_outputs, eager_grads = call_backend("FPR-004", fp8_backend, "run_joint", gm, model, args, grad_outputs)
    check(sorted(grads) == sorted(eager_grads), "FPR-004", f"the loaded artifact gives gradients of {sorted(grads)}, the joint graph of {sorted(eager_grads)}", _artifact_spec())
    for name, got, want in [("output", o, e) for o, e in zip(outputs, eager_outputs)] + [(k, grads[k], eager_grads[k]) for k in sorted(grads)]:
        error = _relative_error(got, want)
        check(error <= 3e-2, "FPR-004", f"the loaded artifact's {name} differs from the joint graph's by relative norm {error:.3g} (> 3e-2)", _artifact_spec())


@pytest.mark.fp8_property("FPR-004")
@pytest.mark.parametrize("kind", [k for k in QUANTIZATION_KINDS if k != "config_field_from_custom"])
@given(data=st.data())
def test_FPR_004_loading_under_another_fingerprint_fails_naming_the_fields(fp8_backend, kind, data):
    """Cheapest defect: warning about a mismatch and loading the stale artifact anyway. Under each
    drawn change (conversion moved to an equal layer, any config field, versions, ``strict``)
    ``load_artifact`` must raise ``FingerprintMismatch`` naming the changed module and field,
    after loading under the unchanged configuration (so refusing everything fails). Refusing a
    config the backend's jobs cannot express (``UnsupportedConfig``) is not_supported."""
    # The one artifact is of _artifact_spec() as converted: a change from a custom config would not
    # start from it, so FPR-001 alone flips from custom configs.
    path = _artifact(fp8_backend)
    change = data.draw(quantization_changes(kind, specs=st.just(_artifact_spec()), strict=True, fields=_config_fields(fp8_backend, kind)), label="change")
    # It loads under its own configuration (so a loader that refuses everything cannot pass) ...
    same, _ = _build("FPR-004", fp8_backend, change.before)
    with change.before.patched():
        try:
            call_backend("FPR-004", fp8_backend, "load_artifact", path, same, strict=change.before.strict, passing=UnsupportedConfig)
        except UnsupportedConfig as exc:
            _refused("FPR-004", fp8_backend, change.before, exc)
    # ... and under the changed one it must refuse, before returning anything.
    other, _ = _build("FPR-004", fp8_backend, change.after)
    loaded = None
    with change.after.patched():
        try:
            loaded = fp8_backend.load_artifact(path, other, strict=change.after.strict)
        except FingerprintMismatch as exc:
            missing = [word for word in change.words if not _names(exc, word)]
            if missing:
                _fail("FPR-004", f"the FingerprintMismatch must name {list(change.words)} (in .fields or its message); "
                      f"it lacks {missing}: fields={tuple(exc.fields)!r}: {exc}", change)
            return
        except UnsupportedConfig as exc:
            _refused("FPR-004", fp8_backend, change.after, exc)
        except Exception as exc:
            _fail("FPR-004", f"{change.description}: load_artifact() raised {type(exc).__name__}, not conformance.api.FingerprintMismatch: {exc}", change)
    _fail(
        "FPR-004",
        f"an artifact saved before the change ({change.description}) was loaded after it and returned "
        f"{type(loaded).__qualname__}; it must raise conformance.api.FingerprintMismatch and never be used",
        change,
    )


def _names(exc: FingerprintMismatch, word: str) -> bool:
    """Whether the mismatch names ``word``: among its differing field paths when the backend set
    ``fields``, else (and for values such as a version string) in its message."""
    fields = tuple(getattr(exc, "fields", None) or ())
    return any(word in str(field) for field in fields) or word in str(exc)


# --- FPR-005 --------------------------------------------------------------------------------------


def _keys(value) -> set[str]:
    if isinstance(value, dict):
        return set(value) | {k for v in value.values() for k in _keys(v)}
    if isinstance(value, list):
        return {k for v in value for k in _keys(v)}
    return set()


def _strings(value) -> set[str]:
    if isinstance(value, dict):
        return {s for v in value.values() for s in _strings(v)}
    if isinstance(value, list):
        return {s for v in value for s in _strings(v)}
    return {value} if isinstance(value, str) else set()


@pytest.mark.fp8_property("FPR-005")
@pytest.mark.parametrize("kind", QUANTIZATION_KINDS)
@given(data=st.data())
def test_FPR_005_signature_is_canonical_readable_json_that_diffs_field_by_field(fp8_backend, kind, data):
    """Readable signatures: a change shows as differing fields under the right keys, grouped
    experts' changes too for a backend that claims ``moe``. A global change (``strict``, a
    version) may leave the signature of a ``"whole_step"`` backend alone, whose fingerprint
    covers it (FPR-001 checks that)."""
    for change in _drawn_changes(fp8_backend, kind, data, _config_fields(fp8_backend, kind)):
        _check_readable_diff(fp8_backend, change)


def _check_readable_diff(fp8_backend, change) -> None:
    """FPR-005 on one change: canonical JSON naming every quantized module and its recipe, and a
    diff under the keys of what changed, naming it."""
    spec = change.before.spec
    fingerprint_before, before = _fingerprint("FPR-005", fp8_backend, change.before)
    fingerprint_after, after = _fingerprint("FPR-005", fp8_backend, change.after)
    docs = []
    for text in (before, after):
        try:
            doc = json.loads(text)
        except ValueError as exc:
            _fail("FPR-005", f"the signature is not JSON ({exc}): {text[:300]}", change)
        canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        if not isinstance(doc, dict) or text != canonical:
            _fail("FPR-005", f"the signature is not canonical JSON (an object, sorted keys, separators (',', ':'), ASCII):\n{text[:400]}\nvs\n{canonical[:400]}", change)
        docs.append(doc)
    keys, strings = _keys(docs[0]), _strings(docs[0])
    # A layer whose config fields the change flipped in both models has a custom config: its
    # recipe is no named recipe any more.
    custom = {f"layers.{i}" for i, _ in change.before.config_fields}
    for fqn, (_kind, recipe, _emulate) in spec.quantized_modules().items():
        if fqn in custom or fqn.rpartition(".adapter")[0] in custom:
            recipe = None
        if fqn not in keys or (recipe is not None and recipe not in strings):
            _fail("FPR-005", f"the signature must be readable: module {fqn!r} as a key and its recipe {recipe!r} as a value:\n{before[:600]}", change)
    differences = json_diff(*docs)
    if not differences and not change.module_fqns and not promises_of(fp8_backend).global_inputs_in_signature:
        note(f"global changes (strict, versions) not required in the signature (fingerprint_scope {fp8_backend.fingerprint_scope!r})")
        return
    if not differences:
        fingerprint = (f"the fingerprint changed: {fingerprint_before} -> {fingerprint_after}" if fingerprint_before != fingerprint_after
                       else f"the fingerprint stayed the same too: {fingerprint_before}")
        _fail("FPR-005", f"{change.description}, yet the signature stayed the same, no field differs ({fingerprint})", change)
    if change.module_fqns:
        stray = [path for path, _, _ in differences if not set(path) & set(change.module_fqns)]
        if stray:
            _fail("FPR-005", f"{change.description} touches only {list(change.module_fqns)}, yet fields outside their entries differ: {stray[:5]}", change)
    else:
        quantized = set(spec.quantized_modules())
        stray = [path for path, _, _ in differences if set(path) & quantized]
        if stray:
            _fail("FPR-005", f"{change.description} is global, yet per-module fields differ: {stray[:5]}", change)
    for word in change.words:
        if not any(word in ".".join(path) or word in str(a) or word in str(b) for path, a, b in differences):
            _fail("FPR-005", f"{change.description}: no differing field names {word!r}; the diff is {differences[:8]}", change)


# --- FPR-006 --------------------------------------------------------------------------------------


# Session scope and a fixture, not the test body: a backend without job configurations is
# skipped before Hypothesis draws anything.
@pytest.fixture(scope="session")
def job_configs(fp8_backend):
    configs = call_backend("FPR-006", fp8_backend, "job_configs")
    if configs is None:
        pytest.skip(f"{NOT_SUPPORTED} backend {fp8_backend.name!r} declares no job configuration of its own (job_configs() is None)")
    return configs


@pytest.mark.fp8_property("FPR-006")
@given(spec=model_specs())
def test_FPR_006_the_backends_job_configuration_reaches_the_signature(fp8_backend, job_configs, spec):
    """Cheapest defect: a fingerprint computed from the model alone that ignores ``config`` (every
    relevant variant then leaves it unchanged), or a signature that records the whole job
    configuration (an unrelated variant then changes it). Every variant the backend declares, of
    both kinds, is checked on every drawn model (the variants are a finite space, enumerated
    rather than drawn), and either defect fails; a backend declaring no relevant variant fails
    too, since it would make the rule vacuous. Where the scope is ``"quantization"`` the signature
    holds every input of the fingerprint, so it must change with a relevant variant and the
    fingerprint must ignore an unrelated one; a ``"whole_step"`` key may cover the whole job."""
    configs = job_configs
    if not isinstance(configs, JobConfigs):
        fail("FPR-006", f"backend {fp8_backend.name!r}: job_configs() returned {type(configs).__qualname__}, expected conformance.JobConfigs or None")
    if not configs.relevant:
        fail("FPR-006", f"backend {fp8_backend.name!r}: job_configs() names no quantization-relevant variant: nothing to check")
    model, _ = _built(fp8_backend, spec)
    signature = lambda c: call_backend("FPR-006", fp8_backend, "quantization_signature", model, strict=True, config=c, expect=str)
    fingerprint = lambda c: call_backend("FPR-006", fp8_backend, "fingerprint", model, strict=True, config=c, expect=str)
    before = (signature(configs.base), fingerprint(configs.base))
    for label, config in sorted(configs.relevant.items()):
        _check_job_variant(fp8_backend, spec, label, before, (signature(config), fingerprint(config)), relevant=True)
    for label, config in sorted(configs.unrelated.items()):
        _check_job_variant(fp8_backend, spec, label, before, (signature(config), fingerprint(config)), relevant=False)


def _check_job_variant(fp8_backend, spec, label, before, after, *, relevant: bool) -> None:
    """FPR-006 for one job configuration variant: ``before`` and ``after`` are the (signature,
    fingerprint) of the base configuration and of the variant ``label``."""
    promises = promises_of(fp8_backend)
    scope = f"fingerprint_scope {fp8_backend.fingerprint_scope!r}"
    if relevant:
        check(before[1] != after[1], "FPR-006",
              f"job configuration {label!r} changes quantized numerics, yet the fingerprint stayed {before[1]} "
              f"({_what_else('signature', before[0], after[0])})", spec)
        if promises.global_inputs_in_signature:
            check(before[0] != after[0], "FPR-006",
                  f"job configuration {label!r} changes quantized numerics, yet the signature stayed the same (the fingerprint "
                  f"changed: {before[1]} -> {after[1]}); with {scope} the signature holds every input of the fingerprint", spec)
        else:
            note(f"relevant job settings: fingerprint compared, signature not ({scope})")
    else:
        check(before[0] == after[0], "FPR-006",
              f"job configuration {label!r} is unrelated to quantization, yet the signature changed "
              f"({_what_else('fingerprint', before[1], after[1])}): {json_diff(json.loads(before[0]), json.loads(after[0]))[:8]}", spec)
        if promises.unrelated_job_settings:
            check(before[1] == after[1], "FPR-006",
                  f"job configuration {label!r} is unrelated to quantization, yet the fingerprint changed: {before[1]} -> {after[1]} "
                  f"(the signature stayed the same; {scope}: the digest of the signature alone)", spec)
        else:
            note(f"unrelated job settings: signature compared, fingerprint not ({scope})")
