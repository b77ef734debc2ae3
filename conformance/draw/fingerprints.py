"""What the FPR properties change in a model, and how they compare fingerprints across processes.

The suite never takes the backend's word for what changed: a :class:`Change` is made by the
suite on real torch objects (a TorchAO recipe, an ``emulate`` flag, a ``Float8LinearConfig``
field, the set of converted linears, the ``strict`` flag, the torch or torchao version string) and
carries the words a readable diff or error must name. Versions change where any reader sees
them: ``__version__`` and the installed package metadata (:mod:`conformance.draw.versions`).

*Quantization inputs* (FPR-001, FPR-004, FPR-005) are, per quantized module: its FQN (conversion
moved to another layer with the same config is a change), kind,
recipe, ``emulate`` flag and numerics-relevant config fields (per tensor role the scaling type,
granularity and target dtype; per gemm ``use_fast_accum``; ``round_scales_to_power_of_2``;
``pad_inner_dim``; for MX the block size and scale rounding); and globally the torch and torchao
versions and the ``strict`` flag. Grouped experts (capability ``moe``) have changes of their own
(:data:`GROUPED_KINDS`, drawn beside the linears' change of the same kind): which experts modules
are converted, ``emulate``, and the API their grouped GEMMs go through (``F.scaled_grouped_mm``
with ``scaled_grouped_mm_v2``).

*Unrelated settings* (FPR-003) are everything else a trainer may change without changing what
the quantized modules compute: train/eval mode, ``requires_grad`` flags, parameter values,
attributes and buffers that are not quantization config, and the model around the quantized
modules (activations, residuals, plain linears' bias, an extra plain linear). Shapes and the
model's structure are the trainer's own fingerprint's business, not the quantization signature's.

What a backend's fingerprint covers (``Backend.fingerprint_scope``) decides which of these it
must ignore: :mod:`conformance.judge.fingerprint_scopes` says, per scope, what each FPR rule may hold
it to.
Config-field changes are drawn from the fields the backend's jobs can express
(``Backend.expressible_config_fields``, :func:`drawable_config_fields`).

``python -m conformance.draw.fingerprints`` is the child process of FPR-002: it reads a JSON request
on stdin, builds the models in its own process (with its own ``PYTHONHASHSEED``) and prints the
backend's fingerprints and signatures as JSON.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import json
import os
import subprocess
import sys
from typing import Any

from hypothesis import strategies as st

from conformance.draw.models import MX_RECIPES, NVFP4_RECIPES, SCALED_MM_RECIPES, LayerSpec, ModelSpec, apply_layer, build_model
from conformance.draw.moe import MoESpec, build_moe_model
from conformance.draw import strategies
from conformance.draw.strategies import ALL_KINDS, model_specs, moe_specs
from conformance.draw.versions import current_version, other_version, simulated_versions

__all__ = [
    "ARTIFACT_SPEC",
    "QUANTIZATION_KINDS",
    "GROUPED_KINDS",
    "grouped_kind",
    "CONFIG_KINDS",
    "UNRELATED_KINDS",
    "STRUCTURE_KINDS",
    "CONFIG_FIELDS",
    "NOT_NUMERICS",
    "flippable",
    "drawable_config_fields",
    "Variant",
    "Change",
    "quantization_changes",
    "layer_changes",
    "unrelated_changes",
    "reordered",
    "flatten_json",
    "json_diff",
    "fingerprints_in_subprocess",
]

#: The one model FPR-004 compiles and saves per session: a converted layer with bias, a plain
#: layer, and an emulated layer with a nested quantized adapter.
ARTIFACT_SPEC = ModelSpec(
    in_features=16,
    layers=(
        LayerSpec(width=16, recipe="tensorwise", bias=True, activation="relu"),
        LayerSpec(width=16, recipe=None, activation="none"),
        LayerSpec(width=32, recipe="rowwise", emulate=True, adapter=True, activation="none"),
    ),
    input_requires_grad=False,
)

#: Every kind of quantization input the suite changes.
QUANTIZATION_KINDS = (
    "recipe", "emulate", "quantized_set", "moved_conversion", "config_field", "config_field_from_custom", "strict",
    "torchao_version", "torch_version",
)
#: The change of grouped experts (MoE models) of each :data:`QUANTIZATION_KINDS` entry that has
#: one, and the capabilities a backend claims to be asked it: the grouped GEMMs moved between
#: ``torch._scaled_grouped_mm`` and ``F.scaled_grouped_mm`` (the experts' one recipe stays),
#: ``emulate`` flipped, an experts module no longer converted, conversion moved to another
#: experts module.
GROUPED_KINDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "recipe": ("grouped_api", ("moe", "scaled_grouped_mm_v2")),
    "emulate": ("grouped_emulate", ("moe",)),
    "quantized_set": ("grouped_quantized_set", ("moe",)),
    "moved_conversion": ("grouped_moved_conversion", ("moe",)),
}
_GROUPED_CHANGES = tuple(grouped for grouped, _ in GROUPED_KINDS.values())


def grouped_kind(kind: str, capabilities) -> str | None:
    """The change of grouped experts drawn beside ``kind``'s for a backend of ``capabilities``,
    or None: ``kind`` has none, or the backend does not claim what it needs."""
    grouped, needs = GROUPED_KINDS.get(kind, (None, ()))
    return grouped if grouped is not None and set(needs) <= set(capabilities) else None


#: Kinds that flip ``Float8LinearConfig`` fields: a trainer whose jobs name recipes cannot
#: express them (``Backend.expressible_config_fields``).
CONFIG_KINDS = ("config_field", "config_field_from_custom")
#: Every kind of unrelated setting the suite changes.
UNRELATED_KINDS = (
    "train_eval", "requires_grad", "parameter_values", "unrelated_attributes", "unrelated_buffers", "model_around",
)
#: The unrelated kinds that change the model's structure (its buffers, parameters, the ops
#: around the quantized modules): a whole-step fingerprint may change with them.
STRUCTURE_KINDS = ("unrelated_buffers", "model_around")

_E4M3, _E5M2 = "float8_e4m3fn", "float8_e5m2"

#: The ``CastConfig`` fields of a ``Float8LinearConfig``: one per operand of each matmul.
CAST_CONFIGS = (
    "cast_config_input", "cast_config_input_for_grad_weight", "cast_config_weight", "cast_config_weight_for_grad_input",
    "cast_config_grad_output", "cast_config_grad_output_for_grad_weight",
)

#: Numerics-relevant ``Float8LinearConfig`` fields the suite flips: name -> (the field paths it
#: changes together, the word a diff or error must name). Every field of the config and of its
#: cast and gemm configs is here, except ``emulate`` (a kind of its own) and
#: :data:`NOT_NUMERICS`. torchao wants an operand cast to one dtype for both matmuls it feeds,
#: and both operands of a matmul scaled or both not, so those fields flip in pairs; a flip
#: torchao rejects for a recipe is not drawn for it (:func:`flippable`).
CONFIG_FIELDS: dict[str, tuple[tuple[str, ...], str]] = {
    "round_scales_to_power_of_2": (("round_scales_to_power_of_2",), "round_scales_to_power_of_2"),
    "pad_inner_dim": (("pad_inner_dim",), "pad_inner_dim"),
    "gemm_config_output.use_fast_accum": (("gemm_config_output.use_fast_accum",), "use_fast_accum"),
    "gemm_config_grad_input.use_fast_accum": (("gemm_config_grad_input.use_fast_accum",), "use_fast_accum"),
    "gemm_config_grad_weight.use_fast_accum": (("gemm_config_grad_weight.use_fast_accum",), "use_fast_accum"),
    "input target_dtype": (("cast_config_input.target_dtype", "cast_config_input_for_grad_weight.target_dtype"), "target_dtype"),
    "weight target_dtype": (("cast_config_weight.target_dtype", "cast_config_weight_for_grad_input.target_dtype"), "target_dtype"),
    "grad_output target_dtype": (
        ("cast_config_grad_output.target_dtype", "cast_config_grad_output_for_grad_weight.target_dtype"),
        "target_dtype",
    ),
    **{f"{cast}.scaling_granularity": ((f"{cast}.scaling_granularity",), "scaling_granularity") for cast in CAST_CONFIGS},
    "output scaling_type": (("cast_config_input.scaling_type", "cast_config_weight.scaling_type"), "scaling_type"),
    "grad_input scaling_type": (("cast_config_grad_output.scaling_type", "cast_config_weight_for_grad_input.scaling_type"), "scaling_type"),
    "grad_weight scaling_type": (
        ("cast_config_input_for_grad_weight.scaling_type", "cast_config_grad_output_for_grad_weight.scaling_type"),
        "scaling_type",
    ),
}
#: ``Float8LinearConfig`` fields that change memory or communication, not what is computed.
NOT_NUMERICS = ("enable_fsdp_float8_all_gather", "force_recompute_fp8_weight_in_bwd")


# --- building the models ----------------------------------------------------------------------


def _flip(value):
    import enum

    import torch

    if isinstance(value, bool):
        return not value
    if isinstance(value, torch.dtype):
        return getattr(torch, _E5M2 if value == getattr(torch, _E4M3) else _E4M3)
    if isinstance(value, enum.Enum) and len(type(value)) == 2:  # ScalingType, ScalingGranularity
        return next(member for member in type(value) if member is not value)
    raise TypeError(f"cannot flip {value!r}")


@functools.cache
def flippable(recipe: str, names: tuple[str, ...]) -> bool:
    """Whether torchao accepts ``recipe``'s config with the :data:`CONFIG_FIELDS` ``names``
    flipped one after the other."""
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    try:
        for name in names:
            config = _replace_paths(config, CONFIG_FIELDS[name][0])
    except (AssertionError, ValueError, TypeError):
        return False
    return True


def drawable_config_fields(expressible) -> tuple[str, ...]:
    """The :data:`CONFIG_FIELDS` entries a backend's jobs can express: those whose every field
    path is in ``expressible`` (``Backend.expressible_config_fields``; None: all of them)."""
    if expressible is None:
        return tuple(CONFIG_FIELDS)
    return tuple(name for name, (paths, _) in CONFIG_FIELDS.items() if set(paths) <= set(expressible))


def _replace_paths(config, paths):
    """``config`` with the fields at every dotted path flipped, in one ``replace`` (torchao checks
    that paired fields agree)."""
    changes = {}
    for path in paths:
        head, _, rest = path.partition(".")
        value = changes.get(head, getattr(config, head))
        changes[head] = _replace_paths(value, [rest]) if rest else _flip(value)
    return dataclasses.replace(config, **changes)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One model the suite builds and fingerprints.

    Attributes:
        spec: the drawn model: a stack of linears or an MoE model (grouped experts).
        strict: the ``strict`` flag it is fingerprinted (saved, loaded) under.
        config_fields: ``(layer index, CONFIG_FIELDS key)`` pairs flipped in that layer's config.
        versions: ``(package name, version string)`` simulated while fingerprinting.
        tweaks: changes to the built model: ``"eval"``, ``"freeze:<fqn>"``, ``"attributes"``,
            ``"buffers"``.
    """

    spec: ModelSpec | MoESpec
    strict: bool = True
    config_fields: tuple[tuple[int, str], ...] = ()
    versions: tuple[tuple[str, str], ...] = ()
    tweaks: tuple[str, ...] = ()

    def build(self, mx=None, float8=None, scaled_mm=None, nvfp4=None, grouped=None, scaled_grouped=None):
        """``(model, args)`` with real TorchAO conversion, the config fields flipped, the tweaks
        applied; ``mx`` converts MX layers (``Backend.convert_mx``), ``scaled_mm`` linears on
        ``F.scaled_mm``, ``nvfp4`` NVFP4 layers, ``float8`` the float8 layers
        when given (``Backend.convert_float8``: a backend's own, which have no
        ``Float8LinearConfig`` to flip); an MoE model's experts are converted by ``grouped``
        (``Backend.convert_grouped_experts``) or, on ``F.scaled_grouped_mm``, ``scaled_grouped``."""
        import torch

        import conformance.draw.models as models

        if isinstance(self.spec, MoESpec):
            convert = scaled_grouped if self.spec.v2 else grouped
            if convert is None:
                raise ValueError(f"an MoE model needs a converter of its experts ({'v2' if self.spec.v2 else 'grouped'})")
            return build_moe_model(self.spec, convert=convert)
        if float8 is not None and self.config_fields:
            raise ValueError("config-field changes flip TorchAO's Float8LinearConfig: a backend's own float8 linears have none")
        original = models._float8_config

        def config_for(recipe, emulate, fqn=None):
            config = original(recipe, emulate, fqn)
            for layer, name in self.config_fields:
                if fqn == f"layers.{layer}":
                    config = _replace_paths(config, CONFIG_FIELDS[name][0])
            return config

        models._float8_config = config_for
        try:
            model, args = build_model(self.spec, mx=mx, float8=float8, scaled_mm=scaled_mm, nvfp4=nvfp4)
        finally:
            models._float8_config = original
        for tweak in self.tweaks:
            if tweak == "eval":
                model.eval()
            elif tweak.startswith("freeze:"):
                for p in model.get_submodule(tweak.removeprefix("freeze:")).parameters():
                    p.requires_grad_(False)
            elif tweak == "attributes":
                model.fpr_note = "an attribute unrelated to quantization"
                for fqn in self.spec.quantized_modules():
                    model.get_submodule(fqn).fpr_note = f"note on {fqn}"
            elif tweak == "buffers":
                model.register_buffer("fpr_unrelated_buffer", torch.arange(3.0))
                for fqn in self.spec.quantized_modules():
                    model.get_submodule(fqn).register_buffer("fpr_unrelated_buffer", torch.zeros(2))
            else:
                raise ValueError(f"unknown tweak {tweak!r}")
        return model, args

    def patched(self):
        """Simulate the variant's versions (``__version__`` and package metadata) while the
        backend fingerprints the model; undone when the block ends, however it ends."""
        return simulated_versions(dict(self.versions)) if self.versions else contextlib.nullcontext()

    def describe(self) -> str:
        parts = [f"strict={self.strict}"]
        parts += [f"layers.{i}: {name} flipped" for i, name in self.config_fields]
        parts += [f"{name} version {v!r}" for name, v in self.versions]
        parts += list(self.tweaks)
        return ", ".join(parts)


@dataclasses.dataclass(frozen=True)
class Change:
    """One change the suite makes: from ``before`` to ``after``.

    Attributes:
        kind: a :data:`QUANTIZATION_KINDS` or :data:`UNRELATED_KINDS` entry.
        description: what changed, for failure messages.
        module_fqns: the quantized modules whose entries the change touches (empty: global).
        words: what a readable diff or error must name (FQNs, field names, version strings).
    """

    kind: str
    description: str
    before: Variant
    after: Variant
    module_fqns: tuple[str, ...] = ()
    words: tuple[str, ...] = ()

    def to_python(self) -> str:
        return (
            f"{self.before.spec.to_python()}"
            f"# change ({self.kind}): {self.description}\n"
            f"# before: {self.before!r}\n# after:  {self.after!r}\n"
        )


def _with_layer(spec: ModelSpec, index: int, **changes) -> ModelSpec:
    layers = list(spec.layers)
    layers[index] = dataclasses.replace(layers[index], **changes)
    return dataclasses.replace(spec, layers=tuple(layers))


def _fqns_of_layer(spec: ModelSpec, index: int) -> tuple[str, ...]:
    return tuple(fqn for fqn in spec.quantized_modules() if fqn == f"layers.{index}" or fqn.startswith(f"layers.{index}."))


#: Kinds that flip ``Float8LinearConfig`` fields, so draw models of float8 layers only.
_FLOAT8_ONLY_KINDS = ("config_field", "config_field_from_custom", "moved_conversion")


@st.composite
def quantization_changes(draw, kind: str, specs=None, strict: bool | None = None, fields=None):
    """A drawn model and one change of a quantization input of ``kind``; ``before`` has the
    ``strict`` flag given (drawn for the ``strict`` kind when None, else True). Models hold every
    kind of layer the backend under test converts (MX, swizzled MX, linears on ``F.scaled_mm``,
    NVFP4: ``strategies.supported_kinds``), except for the changes of float8 config fields. A
    grouped kind (a :data:`GROUPED_KINDS` value) changes an MoE model, drawn from ``specs`` or
    ``moe_specs``. ``fields``: the :data:`CONFIG_FIELDS` entries config-field changes may flip
    (None: all; :func:`drawable_config_fields`)."""
    if kind in _GROUPED_CHANGES:
        return _grouped_change(draw, kind, specs, strict)
    if specs is None:
        specs = model_specs() if kind in _FLOAT8_ONLY_KINDS else model_specs(kinds=ALL_KINDS)
    spec = draw(specs)
    base = Variant(spec, strict=True if strict is None else strict)
    if kind in ("recipe", "emulate"):
        return _layer_change(draw, kind, spec, base)
    if kind in CONFIG_KINDS:
        return _config_field_change(draw, kind, spec, base, tuple(CONFIG_FIELDS) if fields is None else tuple(fields))
    if kind == "quantized_set":
        return _quantized_set_change(draw, spec, base)
    if kind == "moved_conversion":
        return _moved_conversion(draw, spec, base)
    if kind == "strict":
        strict = draw(st.booleans(), label="strict before") if strict is None else strict
        before, after = dataclasses.replace(base, strict=strict), dataclasses.replace(base, strict=not strict)
        return Change(kind, f"strict {strict} -> {not strict}", before, after, (), ("strict",))
    if kind in ("torchao_version", "torch_version"):
        name = kind.removesuffix("_version")
        version = other_version(current_version(name), draw(st.sampled_from(["local", "post"]), label="version change"))
        after = dataclasses.replace(base, versions=((name, version),))
        return Change(kind, f"{name} version -> {version!r} (__version__ and package metadata)", base, after, (), (name, version))
    raise ValueError(f"unknown quantization change kind {kind!r}; known: {QUANTIZATION_KINDS + _GROUPED_CHANGES}")


#: The recipe of a block-scaled layer with its emulation flipped (the recipe names it).
_EMULATED_TWIN = {"mxfp8": "mxfp8_emulated", "mxfp8_emulated": "mxfp8", "nvfp4": "nvfp4_emulated", "nvfp4_emulated": "nvfp4"}


def _is_float8(recipe: str) -> bool:
    return recipe not in MX_RECIPES + NVFP4_RECIPES + SCALED_MM_RECIPES


def _layer_change(draw, kind, spec, base):
    from hypothesis import assume

    quantized = [i for i, layer in enumerate(spec.layers) if layer.recipe is not None]
    if kind == "emulate":
        quantized = [i for i in quantized if layer_changes(kind, base, i)]
        assume(quantized)
    i = draw(st.sampled_from(quantized), label="changed layer")
    changes = layer_changes(kind, base, i)
    assume(changes)  # a backend whose float8 linears have one recipe: no recipe change of its own
    return changes[0] if len(changes) == 1 else draw(st.sampled_from(changes), label="new recipe")


def layer_changes(kind: str, base: Variant, i: int) -> list[Change]:
    """Every change of ``kind`` (``recipe`` or ``emulate``) of quantized layer ``i`` of ``base``'s
    model that the backend under test can build: a linear on F.scaled_mm takes the other recipe
    of its kind; a block-scaled layer (MX, NVFP4) may become a Float8Linear of each of the
    backend's float8 recipes (its kind changes too), never the reverse, since a float8 layer's
    widths need not fit their blocks; a float8 layer takes each of the backend's other float8
    recipes. ``emulate`` flips where the layer has an emulated mode: MX and NVFP4 recipes name
    theirs; linears on F.scaled_mm and swizzled MX linears have none; float8 linears have one
    unless the backend's own lack it."""
    spec = base.spec
    layer, fqns = spec.layers[i], _fqns_of_layer(spec, i)
    if kind == "recipe":
        same_kind = SCALED_MM_RECIPES if layer.recipe in SCALED_MM_RECIPES else strategies.float8_recipes()
        return [
            Change(kind, f"layers.{i}: recipe {layer.recipe!r} -> {recipe!r}", base,
                   dataclasses.replace(base, spec=_with_layer(spec, i, recipe=recipe)), fqns, (f"layers.{i}", "recipe"))
            for recipe in same_kind if recipe != layer.recipe
        ]
    if not (layer.recipe in _EMULATED_TWIN or (strategies.float8_emulation() and _is_float8(layer.recipe))):
        return []
    changes = {"emulate": not layer.emulate}
    if layer.recipe in _EMULATED_TWIN:  # an MX or NVFP4 layer's recipe names its emulation
        changes["recipe"] = _EMULATED_TWIN[layer.recipe]
    after = dataclasses.replace(base, spec=_with_layer(spec, i, **changes))
    return [Change(kind, f"layers.{i}: emulate {layer.emulate} -> {not layer.emulate}", base, after, fqns, (f"layers.{i}", "emulate"))]


def _config_field_change(draw, kind, spec, base, fields):
    """One flipped :data:`CONFIG_FIELDS` entry of ``fields``; ``config_field_from_custom`` flips
    another one in both models first, so the change goes from a custom config to another custom
    config and the recipe name cannot stand in for the field. A model none of whose layers'
    recipes admits such a flip is rejected (only possible when ``fields`` are few)."""
    from hypothesis import assume

    def pairs(recipe):
        if kind == "config_field_from_custom":
            return sorted((a, b) for a in fields for b in fields if a != b and flippable(recipe, (a, b)))
        return sorted(((), n) for n in fields if flippable(recipe, (n,)))

    quantized = [i for i, layer in enumerate(spec.layers) if layer.recipe is not None and pairs(layer.recipe)]
    assume(quantized)
    i = draw(st.sampled_from(quantized), label="changed layer")
    recipe = spec.layers[i].recipe
    first = ()
    if kind == "config_field_from_custom":
        options = sorted({a for a, _ in pairs(recipe)})
        first = (draw(st.sampled_from(options), label="config field flipped in both"),)
    options = sorted(n for n in fields if n not in first and flippable(recipe, first + (n,)))
    name = draw(st.sampled_from(options), label="flipped config field")
    before = dataclasses.replace(base, config_fields=tuple((i, f) for f in first))
    after = dataclasses.replace(base, config_fields=tuple((i, f) for f in first + (name,)))
    start = f" (from a custom config: {first[0]} flipped in both)" if first else ""
    return Change(kind, f"layers.{i}: Float8LinearConfig {name} flipped{start}", before, after, _fqns_of_layer(spec, i), (f"layers.{i}", CONFIG_FIELDS[name][1]))


def _quantized_set_change(draw, spec, base):
    quantized = [i for i, layer in enumerate(spec.layers) if layer.recipe is not None]
    plain = [i for i, layer in enumerate(spec.layers) if layer.recipe is None]
    options = [("unquantize", i) for i in quantized] + [("quantize", i) for i in plain]
    action, i = draw(st.sampled_from(options), label="quantized set change")
    if action == "unquantize":
        after = dataclasses.replace(base, spec=_with_layer(spec, i, recipe=None, emulate=False, adapter=False))
        return Change("quantized_set", f"layers.{i} is no longer converted", base, after, _fqns_of_layer(spec, i), (f"layers.{i}",))
    recipe = draw(st.sampled_from(strategies.float8_recipes()), label="recipe of the newly converted layer")
    after = dataclasses.replace(base, spec=_with_layer(spec, i, recipe=recipe))
    return Change("quantized_set", f"layers.{i} is converted with recipe {recipe!r}", base, after, (f"layers.{i}",), (f"layers.{i}",))


def _moved_conversion(draw, spec, base):
    """Conversion moved from a quantized layer to a plain one with the same config: as many
    quantized modules, with the same configs in the same order, only under another FQN. A
    model without a plain layer gets one appended, in both models."""
    if all(layer.recipe is not None for layer in spec.layers):
        width = spec.layers[-1].width
        spec = dataclasses.replace(spec, layers=spec.layers + (LayerSpec(width=width, recipe=None, activation="none"),))
        base = dataclasses.replace(base, spec=spec)
    quantized = [i for i, layer in enumerate(spec.layers) if layer.recipe is not None]
    plain = [i for i, layer in enumerate(spec.layers) if layer.recipe is None]
    i = draw(st.sampled_from(quantized), label="layer losing its conversion")
    j = draw(st.sampled_from(plain), label="layer converted instead")
    source = spec.layers[i]
    moved = {f: getattr(source, f) for f in ("recipe", "emulate", "adapter", "adapter_recipe", "adapter_emulate")}
    after_spec = _with_layer(_with_layer(spec, i, recipe=None, emulate=False, adapter=False), j, **moved)
    fqns = _fqns_of_layer(spec, i) + _fqns_of_layer(after_spec, j)
    after = dataclasses.replace(base, spec=after_spec)
    return Change("moved_conversion", f"conversion ({source.recipe!r}, emulate={source.emulate}) moved from layers.{i} to layers.{j}", base, after, fqns, (f"layers.{i}", f"layers.{j}"))


#: The MoE models each grouped kind draws: ``emulate`` flips on the first API only, and the API
#: changes between real experts.
_GROUPED_SPECS = {
    "grouped_quantized_set": dict(emulate=None, v2=True),
    "grouped_moved_conversion": dict(emulate=None, v2=True),
    "grouped_emulate": dict(emulate=None, v2=False),
    "grouped_api": dict(emulate=False, v2=True),
}


def _grouped_change(draw, kind, specs, strict):
    """One change of grouped experts (:data:`GROUPED_KINDS`) on a drawn MoE model: experts on
    either API where the backend claims both (``moe_specs``), every experts module converted
    before the change except where conversion moves."""
    spec = draw(specs if specs is not None else moe_specs(**_GROUPED_SPECS[kind]))
    base = Variant(spec, strict=True if strict is None else strict)
    experts = spec.experts_modules()
    api = "F.scaled_grouped_mm" if spec.v2 else "torch._scaled_grouped_mm"
    if kind == "grouped_quantized_set":
        fqn = draw(st.sampled_from(experts), label="experts module no longer converted")
        after = Variant(dataclasses.replace(spec, unconverted=(fqn,)), base.strict)
        return Change(kind, f"{fqn} (grouped experts on {api}) is no longer converted", base, after, (fqn,), (fqn,))
    if kind == "grouped_moved_conversion":
        source = draw(st.sampled_from(experts), label="experts module losing its conversion")
        target = draw(st.sampled_from([f for f in experts if f != source]), label="experts module converted instead")
        before = Variant(dataclasses.replace(spec, unconverted=(target,)), base.strict)
        after = Variant(dataclasses.replace(spec, unconverted=(source,)), base.strict)
        return Change(kind, f"conversion of grouped experts on {api} moved from {source} to {target}", before, after,
                      (source, target), (source, target))
    if kind == "grouped_emulate":
        after = Variant(dataclasses.replace(spec, emulate=not spec.emulate), base.strict)
        return Change(kind, f"grouped experts: emulate {spec.emulate} -> {not spec.emulate}", base, after, experts, (*experts, "emulate"))
    if kind == "grouped_api":
        other = "torch._scaled_grouped_mm" if spec.v2 else "F.scaled_grouped_mm"
        after = Variant(dataclasses.replace(spec, v2=not spec.v2), base.strict)
        return Change(kind, f"grouped experts' GEMMs moved from {api} to {other}", base, after, experts, experts)
    raise ValueError(f"unknown grouped change kind {kind!r}; known: {_GROUPED_CHANGES}")


@st.composite
def unrelated_changes(draw, kind: str, specs=None):
    """A drawn model and one change of a setting unrelated to quantization, of ``kind``."""
    spec = draw(specs if specs is not None else model_specs())
    base = Variant(spec)
    if kind == "train_eval":
        return Change(kind, "model.eval()", base, dataclasses.replace(base, tweaks=("eval",)))
    if kind == "requires_grad":
        i = draw(st.integers(0, len(spec.layers) - 1), label="frozen layer")
        return Change(kind, f"layers.{i}'s parameters stop requiring grad", base, dataclasses.replace(base, tweaks=(f"freeze:layers.{i}",)))
    if kind == "parameter_values":
        seed = draw(st.integers(1, 1000), label="other seed")
        return Change(kind, f"parameters initialised with seed {spec.seed + seed}", base, Variant(dataclasses.replace(spec, seed=spec.seed + seed)))
    if kind == "unrelated_attributes":
        return Change(kind, "unrelated attributes on the root and every quantized module", base, dataclasses.replace(base, tweaks=("attributes",)))
    if kind == "unrelated_buffers":
        return Change(kind, "unrelated buffers on the root and every quantized module", base, dataclasses.replace(base, tweaks=("buffers",)))
    if kind == "model_around":
        options = [("activation", i) for i in range(len(spec.layers))]
        options += [("bias", i) for i, layer in enumerate(spec.layers) if layer.recipe is None]
        options += [("append", len(spec.layers))]
        action, i = draw(st.sampled_from(options), label="change around the quantized modules")
        if action == "activation":
            current = spec.layers[i].activation
            activation = draw(st.sampled_from([a for a in ("none", "relu", "gelu") if a != current]), label="activation")
            return Change(kind, f"layers.{i}: activation {current!r} -> {activation!r}", base, Variant(_with_layer(spec, i, activation=activation)))
        if action == "bias":
            return Change(kind, f"plain layers.{i}: bias toggled", base, Variant(_with_layer(spec, i, bias=not spec.layers[i].bias)))
        width = spec.layers[-1].width
        extra = LayerSpec(width=width, recipe=None, activation="none")
        return Change(kind, f"a plain layers.{i} appended", base, Variant(dataclasses.replace(spec, layers=spec.layers + (extra,))))
    raise ValueError(f"unknown unrelated change kind {kind!r}; known: {UNRELATED_KINDS}")


# --- reordering --------------------------------------------------------------------------------


def reordered(model, spec: ModelSpec):
    """An equivalent model whose modules, parameters and buffers are registered in reverse order.

    Every FQN stays the same and the layers are ``model``'s own objects, whose registration
    (dict) order is reversed in place: pass a freshly built model. The result computes what
    ``model`` computes.
    """
    import torch

    class ReorderedModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.spec = spec
            self.layers = torch.nn.Module()
            for i in range(len(spec.layers)):
                self.layers.add_module(str(i), model.layers[i])

        def forward(self, x):
            for i, layer_spec in enumerate(self.spec.layers):
                x = apply_layer(layer_spec, getattr(self.layers, str(i)), x)
            return x

    new = ReorderedModel()
    for module in new.modules():
        for table in ("_modules", "_parameters", "_buffers"):
            entries = getattr(module, table)
            reversed_entries = type(entries)(reversed(list(entries.items())))
            object.__setattr__(module, table, reversed_entries)
    return new


# --- reading signatures ---------------------------------------------------------------------------


def flatten_json(value: Any, path: tuple = ()) -> dict[tuple, Any]:
    """Leaf values of parsed JSON by key path (list items by index); empty objects and arrays
    hold no field and are left out."""
    if isinstance(value, (dict, list)) and not value:
        return {}
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            out.update(flatten_json(item, path + (str(key),)))
        return out
    if isinstance(value, list):
        out = {}
        for index, item in enumerate(value):
            out.update(flatten_json(item, path + (str(index),)))
        return out
    return {path: value}


_MISSING = object()


def json_diff(a: Any, b: Any) -> list[tuple[tuple, Any, Any]]:
    """The suite's own field-by-field diff of two parsed JSON documents."""
    fa, fb = flatten_json(a), flatten_json(b)
    out = []
    for path in sorted(set(fa) | set(fb)):
        x, y = fa.get(path, _MISSING), fb.get(path, _MISSING)
        if x is _MISSING or y is _MISSING or x != y or type(x) is not type(y):
            out.append((path, None if x is _MISSING else x, None if y is _MISSING else y))
    return out


# --- FPR-002 across processes ---------------------------------------------------------------------


def backend_locator(backend) -> str:
    cls = type(backend)
    return f"{cls.__module__}:{cls.__qualname__}"


def other_hash_seed() -> str:
    """A ``PYTHONHASHSEED`` other than this process's: 0, or 1 where this process runs with 0
    (an unset or ``random`` seed is a random key, never the fixed one of seed 0)."""
    return "1" if os.environ.get("PYTHONHASHSEED") == "0" else "0"


def fingerprints_in_subprocess(backend, specs, *, hash_seed: str | None = None, timeout: float = 300) -> list[dict]:
    """Run one child process with ``PYTHONHASHSEED`` ``hash_seed`` (default: :func:`other_hash_seed`)
    that builds every spec's model in registration order and in reverse order. Returns, per
    order, ``{"seed", "reordered", "results": [{"fingerprint", "signature"}...]}``: one process
    start (seconds of imports) for both, where a process per order compared no more."""
    seed = other_hash_seed() if hash_seed is None else str(hash_seed)
    request = {"backend": backend_locator(backend), "specs": [repr(s) for s in specs]}
    env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run([sys.executable, "-m", "conformance.draw.fingerprints"], input=json.dumps(request),
                          capture_output=True, env=env, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"child with PYTHONHASHSEED={seed} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"child with PYTHONHASHSEED={seed} printed no answer:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    answer = json.loads(lines[-1])
    return [{"seed": seed, "reordered": reordered, "results": answer[key]}
            for reordered, key in ((False, "results"), (True, "reordered_results"))]


def _child() -> int:
    import warnings

    warnings.simplefilter("ignore")
    request = json.loads(sys.stdin.read())
    module_name, _, qualname = request["backend"].partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    backend = obj()
    namespace = {"ModelSpec": ModelSpec, "LayerSpec": LayerSpec}
    answer = {"hash_seed": os.environ.get("PYTHONHASHSEED"), "results": [], "reordered_results": []}
    for text in request["specs"]:
        spec = eval(text, namespace)  # noqa: S307 - the parent wrote these reprs
        for key in ("results", "reordered_results"):
            model, _ = build_model(spec, float8=backend.convert_float8 if "float8_modules" in backend.capabilities else None)
            if key == "reordered_results":
                model = reordered(model, spec)
            answer[key].append({"fingerprint": backend.fingerprint(model, strict=True),
                                "signature": backend.quantization_signature(model, strict=True)})
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(_child())
