"""Hypothesis strategies that draw the suite's models (as :class:`~conformance.draw.models.ModelSpec`).

Widths are multiples of 16 (FP8 matmuls need it); which linears are quantized, their recipe,
``emulate``, bias, activation, residuals, module reuse and nesting are all drawn. Shrinking
heads for one small quantized layer, so a failure ends as a minimal model.

MX layers (recipes ``mxfp8`` / ``mxfp8_emulated``, converted by the backend) are opt-in twice:
a property passes ``kinds=ALL_KINDS``, and the backend under test claims capability ``mx``. The
suite runs each test inside :func:`supported_kinds` with the kinds the backend converts
(``conformance.run.harness.serving``), and :func:`model_specs` draws only those: a float8-only
backend never sees an MX model, and gets as many float8 models as any other. A model is
float8-only, drawn exactly as without MX, or adds one other kind, each choice as likely: an MX
model starts at width 32 or 64, keeps widths of 32 or 64 up to its forced quantized layer, which
is MX, and may make any later quantized layer whose in features allow it MX too. MX layers take
no nested adapter.

Linears on torch's second scaled-matmul API (kind ``float8_scaled_mm_linear``, recipes
``scaled_mm_tensorwise`` / ``scaled_mm_rowwise``, converted by the backend through
``Backend.convert_scaled_mm``) are opt-in the same way, through capability ``scaled_mm_v2``. A
model adding scaled-matmul layers forces one (its widths are the float8 ones) and may make any later
quantized layer one too. They take no nested adapter and are never emulated, so a property asking
for emulated modules only, or for none of their recipes, never draws them.

NVFP4 layers (kind ``nvfp4_linear``, recipes ``nvfp4`` / ``nvfp4_emulated``, converted by the
backend through ``Backend.convert_nvfp4``) are opt-in through capability ``nvfp4`` and drawn like
MX layers (widths of 32 or 64, no nested adapter). They trace on any device; the properties that
run graphs draw them only where torch runs an NVFP4 matmul (:func:`runnable_kinds`: sm100 GPUs).
Swizzled MX layers (recipe ``mxfp8_swizzled``, kind ``mxfp8_linear``, through
``Backend.convert_mx``) are drawn the same way, as the drawing kind :data:`MX_SWIZZLED_KIND`, for
a backend that claims ``mx`` and declares the recipe (``Backend.mx_recipes``); they are never
emulated, and run only where torch runs a swizzled MX matmul (sm100 GPUs).

**One shared corpus under a derandomized profile.** Tracing a model is most of a structural
property's cost, and traced graphs are cached per model (``conformance.run.harness.traced``). Under a
derandomized profile (``fp8conf-ci``, ``fp8conf-mutants``) :func:`model_specs` therefore does not draw afresh per
property: Hypothesis draws one corpus of :data:`CORPUS_SIZE` models from the most general strategy
with a fixed seed, ordered so that its first models vary every feature drawn (recipes,
emulation, MX, reuse, nesting, input gradients, ...), and each property samples the first
``max_examples`` models of it that its constraints admit (drawing more from its own strategy only when the corpus has too few). Every
property still sees that many distinct models, and a model drawn by several properties is traced
once. Under ``dev`` and ``thorough`` each property draws its own models.

A property samples its models from a list ordered smallest first
(:meth:`~conformance.draw.models.ModelSpec.size`: fewest linears, then fewest parameters;
:func:`_smallest_first`), so a failing property shows the smallest model it was seen failing on.
Sampled in the corpus's order (varied, large models first), where Hypothesis reports the failing
example of lowest index, every property failing on one early model showed that same model,
whatever else it failed on.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import functools
from typing import Callable

import hypothesis
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from conformance.api.types import FLOAT8_RECIPES
from conformance.draw.families import variants
from conformance.draw.models import ACTIVATIONS, MX_RECIPES, NVFP4_RECIPES, PARENT, SCALED_MM_RECIPES, LayerSpec, ModelSpec, base_recipe, kind_of

__all__ = [
    "FLOAT8_RECIPES", "FLOAT8_KIND", "MX_KIND", "SCALED_MM_KIND", "NVFP4_KIND", "MX_SWIZZLED_KIND", "ALL_KINDS", "FLOAT8_AND_MX", "CORPUS_SIZE",
    "Constraints", "served", "served_spec", "float8_left_out", "float8_recipes", "float8_emulation", "corpus", "layer_specs", "model_specs", "runnable_recipes", "runnable_kinds", "kinds_not_runnable", "kinds_left_out", "smallest_of_each_kind", "supported_kinds", "moe_specs", "experts_specs", "grouped_fp8_runs", "grouped_v2_runs",
    "sharded_specs",
]

WIDTHS = (16, 32, 48)
#: Quantized module kinds a model may draw: ``kinds=ALL_KINDS`` opts into MX layers, linears on
#: ``F.scaled_mm`` and NVFP4 layers (each drawn only for a backend that converts it).
FLOAT8_KIND, MX_KIND, SCALED_MM_KIND, NVFP4_KIND = "float8_linear", "mxfp8_linear", "float8_scaled_mm_linear", "nvfp4_linear"
#: A drawing kind, not a module kind: MX layers of recipe ``mxfp8_swizzled`` (provenance kind
#: ``mxfp8_linear``), drawn apart from the other MX recipes since only sm100 GPUs run them.
MX_SWIZZLED_KIND = "mxfp8_swizzled"
ALL_KINDS = (FLOAT8_KIND, MX_KIND, SCALED_MM_KIND, NVFP4_KIND, MX_SWIZZLED_KIND)
#: Kinds whose layers quantize in blocks along both dims: in and out features multiples of 32.
_BLOCKED_KINDS = (MX_KIND, NVFP4_KIND, MX_SWIZZLED_KIND)
#: The kinds the fingerprint properties draw (they build their own model changes per kind).
FLOAT8_AND_MX = (FLOAT8_KIND, MX_KIND)
#: Widths of MX layers (MXFP8 quantizes both dims in blocks of 32).
MX_WIDTHS = (32, 64)


# What a call of torch's first scaled-matmul API raises where the device has no kernel; the second
# API also raises TypeError or ValueError for a scaling the build does not know.
_KERNEL_ERRORS = (RuntimeError, NotImplementedError)
_V2_ERRORS = (*_KERNEL_ERRORS, TypeError, ValueError)


def _runs(call, errors=_KERNEL_ERRORS) -> bool:
    """Whether ``call`` (a small FP8 matmul on a device) runs here: ``False`` when it raises one of
    ``errors``, the way torch says it has no kernel for that device or scaling."""
    try:
        call()
    except errors:
        return False
    return True


def runnable_recipes(device: str = "cpu") -> tuple[str, ...]:
    """The recipes whose real FP8 matmuls this torch can execute on ``device``.

    Tracing works everywhere, but executing differs: torch 2.11's CPU ``_scaled_mm`` supports
    tensorwise scales only, so properties that *run* graphs draw rowwise recipes only where a
    rowwise matmul actually runs.
    """
    import torch

    a = torch.zeros(16, 16, device=device).to(torch.float8_e4m3fn)
    b = torch.zeros(16, 16, device=device).to(torch.float8_e4m3fn).t()
    if _runs(lambda: torch._scaled_mm(a, b, torch.ones(16, 1, device=device), torch.ones(1, 16, device=device),
                                      out_dtype=torch.float32)):
        return FLOAT8_RECIPES
    return ("tensorwise",)


@functools.cache
def runnable_kinds(device: str = "cpu") -> tuple[str, ...]:
    """The quantized module kinds whose FP8 matmuls this torch executes on ``device``, for the
    properties that run graphs: float8 and MX layers always (MX through the backend's own op);
    linears on ``F.scaled_mm`` where ``aten._scaled_mm_v2`` has a kernel for the device (torch
    2.11 has the function, with a CUDA kernel only). :func:`kinds_left_out` says what is missing."""
    import torch
    import torch.nn.functional as F

    kinds = [FLOAT8_KIND, MX_KIND]
    if hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"):
        a = torch.zeros(16, 16, device=device).to(torch.float8_e4m3fn)
        b = torch.zeros(16, 16, device=device).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        tensorwise = F.ScalingType.TensorWise
        if _runs(lambda: F.scaled_mm(a, b, one, tensorwise, one, tensorwise, output_dtype=torch.float32), _V2_ERRORS):
            kinds.append(SCALED_MM_KIND)
        if _runs(lambda: _nvfp4_matmul(device), _V2_ERRORS):
            kinds.append(NVFP4_KIND)
        if _runs(lambda: _swizzled_mx_matmul(device), _V2_ERRORS):
            kinds.append(MX_SWIZZLED_KIND)
    return tuple(kinds)


def _nvfp4_matmul(device: str):
    """A small NVFP4 matmul on ``device`` (raises where torch has no kernel for it: every device
    but sm100 GPUs)."""
    import torch
    import torch.nn.functional as F

    if not hasattr(torch, "float4_e2m1fn_x2"):
        raise NotImplementedError("this torch has no float4_e2m1fn_x2")
    a = torch.zeros(128, 16, dtype=torch.uint8, device=device).view(torch.float4_e2m1fn_x2)
    scales = torch.ones(128 * 4, device=device).to(torch.float8_e4m3fn)
    one = torch.ones((), device=device)
    recipes = [F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise]
    swizzles = [F.SwizzleType.SWIZZLE_32_4_4, F.SwizzleType.NO_SWIZZLE]
    return F.scaled_mm(a, a.t(), [scales, one], recipes, [scales, one], recipes, swizzle_a=swizzles, swizzle_b=swizzles,
                       output_dtype=torch.bfloat16)


def _swizzled_mx_matmul(device: str):
    """A small MXFP8 matmul with swizzled e8m0 scales on ``device`` (raises where torch has no
    kernel for it: every device but sm100 GPUs)."""
    import torch
    import torch.nn.functional as F

    a = torch.zeros(128, 32, device=device).to(torch.float8_e4m3fn)
    scales = torch.full((128 * 4,), 127, dtype=torch.uint8, device=device).view(torch.float8_e8m0fnu)
    block, swizzle = F.ScalingType.BlockWise1x32, F.SwizzleType.SWIZZLE_32_4_4
    return F.scaled_mm(a, a.t(), scales, block, scales, block, swizzle_a=swizzle, swizzle_b=swizzle, output_dtype=torch.bfloat16)


def kinds_not_runnable(device: str = "cpu") -> tuple[str, ...]:
    """The kinds the suite draws whose matmuls this torch cannot run on ``device``."""
    runnable = runnable_kinds(device)
    return tuple(k for k in ALL_KINDS if k not in runnable)


def kinds_left_out(device: str = "cpu") -> str | None:
    """A note for a report row when a kind the suite draws cannot run here, else None."""
    missing = kinds_not_runnable(device)
    if not missing:
        return None
    return (f"{', '.join(missing)} layers are not drawn by the properties that run graphs: this torch has no {device} "
            "kernel for their matmuls (aten._scaled_mm_v2)"
            + ("; NVFP4 and swizzled MX matmuls run on sm100 GPUs only" if {NVFP4_KIND, MX_SWIZZLED_KIND} & set(missing) else ""))


@st.composite
def layer_specs(
    draw, in_width: int, *, recipes=FLOAT8_RECIPES, emulate: bool | None = None, quantized=None, reuse=True, nesting=True,
    kinds=(FLOAT8_KIND,), widths=WIDTHS, float8_recipes=None, float8_emulation: bool = True,
):
    """One layer taking ``in_width`` features. With the default ``kinds`` the draws are exactly those
    of a float8-only suite; a quantized layer becomes MX when ``kinds`` allows it and ``in_width``
    is a multiple of 32, a scaled-matmul layer when ``kinds`` allows it, ``recipes`` hold one of
    its recipes and ``emulate`` is not True (the kind drawn when several are possible).
    ``emulate`` None draws it. ``float8_recipes`` (default ``recipes``) and ``float8_emulation``
    narrow what float8 layers and adapters take: a backend's own float8 linears."""
    draw_emulate = st.booleans() if emulate is None else st.just(emulate)
    float8_recipes = recipes if float8_recipes is None else float8_recipes
    float8_emulate = draw_emulate if float8_emulation else st.just(False)
    quantize = quantized or (quantized is None and draw(st.booleans()))
    kind = None
    if quantize:
        possible = [k for k in kinds if _possible(k, in_width, recipes, emulate)]
        kind = possible[0] if len(possible) == 1 else draw(st.sampled_from(possible), label="kind")
    mx = kind == MX_KIND
    blocked = kind in _BLOCKED_KINDS
    if mx:
        recipe = "mxfp8_emulated" if draw(draw_emulate) else "mxfp8"
    elif kind == NVFP4_KIND:
        recipe = "nvfp4_emulated" if draw(draw_emulate) else "nvfp4"
    elif kind == MX_SWIZZLED_KIND:
        recipe = "mxfp8_swizzled"
    elif kind == SCALED_MM_KIND:
        recipe = draw(st.sampled_from(_scaled_mm_recipes(recipes)), label="scaled_mm recipe")
    else:
        recipe = draw(st.sampled_from(float8_recipes)) if quantize else None
    square = draw(st.booleans())
    width = in_width if square else draw(st.sampled_from(MX_WIDTHS if blocked else widths))
    layer = LayerSpec(
        width=width,
        recipe=recipe,
        emulate=recipe in ("mxfp8_emulated", "nvfp4_emulated") if blocked else (draw(float8_emulate) if kind == FLOAT8_KIND else False),
        bias=draw(st.booleans()),
        activation=draw(st.sampled_from(ACTIVATIONS)),
        residual=width == in_width and draw(st.booleans()),
        calls=2 if (reuse and width == in_width and draw(st.booleans())) else 1,
        adapter=kind == FLOAT8_KIND and nesting and draw(st.booleans()),
    )
    if not layer.adapter:
        return layer
    # The parent's config first (what shrinking heads for), then a config of its own, whose
    # recipe and flag may differ from the parent's, or a plain high-precision adapter.
    config = draw(st.sampled_from(("parent", "own", "plain")), label="adapter config")
    if config == "plain":
        return dataclasses.replace(layer, adapter_recipe=None)
    if config == "own":
        own_recipe = draw(st.sampled_from(float8_recipes), label="adapter recipe")
        return dataclasses.replace(layer, adapter_recipe=own_recipe, adapter_emulate=draw(float8_emulate, label="adapter emulate"))
    return layer


def _scaled_mm_recipes(recipes) -> list[str]:
    """The scaled-matmul recipes whose base recipe ``recipes`` admits."""
    return [r for r in SCALED_MM_RECIPES if base_recipe(r) in recipes]


def _possible(kind: str, in_width: int, recipes, emulate: bool | None) -> bool:
    """Whether a quantized layer of ``kind`` taking ``in_width`` features can be drawn under
    ``recipes`` and ``emulate``."""
    if kind == MX_SWIZZLED_KIND:
        return in_width % 32 == 0 and emulate is not True
    if kind in _BLOCKED_KINDS:
        return in_width % 32 == 0
    if kind == SCALED_MM_KIND:
        return emulate is not True and bool(_scaled_mm_recipes(recipes))
    return True


@dataclasses.dataclass(frozen=True)
class Constraints:
    """What a property asks of its models (the arguments of :func:`model_specs`).

    ``max_layers``: at most this many layers; ``recipes``: the float8 recipes allowed;
    ``emulate``: every quantized layer emulated (True) or real (False), None for either;
    ``reuse`` / ``nesting``: whether layers may be called twice / carry a nested adapter;
    ``require_reuse`` / ``require_nesting``: some quantized layer is called twice / nests a
    quantized adapter (one layer both, when both are required); ``kinds``: the quantized module
    kinds. ``recipes`` and ``emulate`` hold for nested adapters too. ``families``: the model
    families (``conformance.draw.families``) the property runs first, each in the variant these
    constraints admit (:func:`conformance.draw.family_examples.family_examples`), and draws now and then
    under a profile that is not derandomized. ``float8_recipes`` (None: ``recipes``) and
    ``float8_emulation`` narrow the float8 layers to what a backend's own float8 linears have
    (``Backend.float8_recipes``, ``Backend.float8_emulation``); the suite sets them, from the
    backend under test, when a property draws (:func:`supported_kinds`).
    """

    max_layers: int = 3
    recipes: tuple[str, ...] = FLOAT8_RECIPES
    emulate: bool | None = None
    reuse: bool = True
    nesting: bool = True
    require_reuse: bool = False
    require_nesting: bool = False
    kinds: tuple[str, ...] = (FLOAT8_KIND,)
    families: tuple[str, ...] = ()
    float8_recipes: tuple[str, ...] | None = None
    float8_emulation: bool = True

    @property
    def float8_choices(self) -> tuple[str, ...]:
        """The recipes a float8 layer (or nested adapter) may take."""
        return self.recipes if self.float8_recipes is None else self.float8_recipes

    def admits(self, spec: ModelSpec) -> bool:
        """Whether :func:`model_specs` under these constraints could draw ``spec``."""
        if not isinstance(spec, ModelSpec):
            return spec in variants(self)
        quantized = [layer for layer in spec.layers if layer.recipe]
        mx = [layer for layer in quantized if layer.recipe in MX_RECIPES and layer.recipe != MX_SWIZZLED_KIND]
        swizzled = [layer for layer in quantized if layer.recipe == MX_SWIZZLED_KIND]
        scaled_mm = [layer for layer in quantized if layer.recipe in SCALED_MM_RECIPES]
        nvfp4 = [layer for layer in quantized if layer.recipe in NVFP4_RECIPES]
        configs = spec.quantized_modules().values()
        float8 = [(recipe, emulate) for kind, recipe, emulate in configs if kind == FLOAT8_KIND]

        def required(layer: LayerSpec) -> bool:
            return (layer.calls > 1 or not self.require_reuse) and (layer.adapter_config() is not None or not self.require_nesting)

        return (
            bool(quantized)
            and len(spec.layers) <= self.max_layers
            and (MX_KIND in self.kinds or not mx)
            and (SCALED_MM_KIND in self.kinds or not scaled_mm)
            and (NVFP4_KIND in self.kinds or not nvfp4)
            and (MX_SWIZZLED_KIND in self.kinds or not swizzled)
            and (FLOAT8_KIND in self.kinds or not float8)
            and all(recipe in self.float8_choices for recipe, _ in float8)
            and (self.float8_emulation or not any(emulate for _, emulate in float8))
            and all(base_recipe(layer.recipe) in self.recipes for layer in scaled_mm)
            and (self.emulate is None or all(emulate == self.emulate for _kind, _recipe, emulate in configs))
            and (self.reuse or all(layer.calls == 1 for layer in spec.layers))
            and (self.nesting or not any(layer.adapter for layer in spec.layers))
            and any(required(layer) for layer in quantized)
        )


@st.composite
def _drawn_specs(draw, c: Constraints):
    """A model with at least one quantized layer (the first drawn quantized layer is forced).

    A model is float8-only or adds one other kind among those allowed, each as likely (it always
    adds one when float8 layers are not allowed): that kind's layer is the forced one, and later
    quantized layers may be of it too."""
    kinds = c.kinds
    added = [k for k in (MX_KIND, SCALED_MM_KIND, NVFP4_KIND, MX_SWIZZLED_KIND) if k in kinds and _possible(k, 0, c.recipes, c.emulate)]
    # Float8 only, or one other kind: each as likely (float8 only first, what shrinking heads for).
    choices = added if FLOAT8_KIND not in kinds else [None, *added]
    other = (choices[0] if len(choices) == 1 else draw(st.sampled_from(choices), label="added kind")) if added else None
    with_mx = other in _BLOCKED_KINDS
    in_features = draw(st.sampled_from(MX_WIDTHS if with_mx else WIDTHS))
    n = draw(st.integers(1, c.max_layers))
    forced = draw(st.integers(0, n - 1))
    layers, width = [], in_features
    for i in range(n):
        layer_kinds = tuple(k for k in (FLOAT8_KIND, other) if k in kinds) if other else (FLOAT8_KIND,)
        if other and i == forced:
            layer_kinds = (FLOAT8_KIND,) if c.require_nesting else (other,)
        widths = MX_WIDTHS if with_mx and (i < forced or FLOAT8_KIND not in kinds) else WIDTHS
        layer = draw(
            layer_specs(
                width, recipes=c.recipes, emulate=c.emulate, quantized=True if i == forced else None, reuse=c.reuse,
                nesting=c.nesting, kinds=layer_kinds, widths=widths, float8_recipes=c.float8_recipes,
                float8_emulation=c.float8_emulation,
            )
        )
        if i == forced and c.require_reuse and layer.calls == 1:
            layer = LayerSpec(**{**layer.__dict__, "width": width, "calls": 2})
        if i == forced and c.require_nesting:
            layer = LayerSpec(**{**layer.__dict__, "adapter": True})
            if layer.adapter_config() is None:
                layer = dataclasses.replace(layer, adapter_recipe=PARENT)
        layers.append(layer)
        width = layer.width
    return ModelSpec(
        in_features=in_features,
        layers=tuple(layers),
        input_requires_grad=draw(st.booleans()),
    )


#: Models Hypothesis draws, once per process, for the shared corpus of a derandomized run.
CORPUS_SIZE = 256
#: The corpus is drawn from the most general constraints: every kind, recipe and feature.
_GENERAL = Constraints(kinds=ALL_KINDS)


@functools.cache
def _collect(c: Constraints, where: Callable[[ModelSpec], bool] | None, n: int) -> tuple[ModelSpec, ...]:
    """Up to ``n`` distinct models drawn under ``c`` (and ``where``), the same ones in every process:
    Hypothesis seeds a derandomized run from the test function, which is this one."""
    strategy = _drawn_specs(c) if where is None else _drawn_specs(c).filter(where)
    found: dict[ModelSpec, None] = {}

    @hypothesis.settings(
        database=None, derandomize=True, max_examples=n, deadline=None,
        phases=(hypothesis.Phase.generate,), suppress_health_check=list(hypothesis.HealthCheck),
    )
    @hypothesis.given(strategy)
    def collect(spec):
        found.setdefault(spec, None)

    collect()
    return tuple(found)


def _features(spec: ModelSpec) -> frozenset:
    """What a model exercises, for ordering the corpus: the model's shape, every pair of
    attributes of each quantized layer (recipe, emulation, its adapter: none, plain, the parent's
    config or its own, reuse, whether its input needs a gradient, bias, activation, residual), and
    each quantized layer's backward (its recipe and emulation, and whether it computes an input
    gradient: which casts and matmuls it holds)."""
    found = {("layers", len(spec.layers)), ("plain layer", any(layer.recipe is None for layer in spec.layers))}
    found.add(("kinds", frozenset(kind_of(layer.recipe) for layer in spec.layers if layer.recipe)))
    found.add(("emulation", frozenset(emulate for _kind, _recipe, emulate in spec.quantized_modules().values())))
    for i, layer in enumerate(spec.layers):
        if layer.recipe:
            attributes = [
                ("recipe", layer.recipe), ("emulate", layer.emulate), ("adapter", _adapter_kind(layer)),
                ("calls", layer.calls), ("input grad", i > 0 or spec.input_requires_grad), ("bias", layer.bias),
                ("activation", layer.activation), ("residual", layer.residual),
            ]
            found.update((a, b) for a in attributes for b in attributes if a < b)
            found.add(("backward", *attributes[:2], attributes[4]))
    return frozenset(found)


def _kinds(spec: ModelSpec) -> set[str]:
    """The drawing kinds of ``spec``'s quantized modules (swizzled MX apart from other MX)."""
    return {MX_SWIZZLED_KIND if recipe == MX_SWIZZLED_KIND else kind for kind, recipe, _emulate in spec.quantized_modules().values()}


def _adapter_kind(layer: LayerSpec):
    """How a layer nests: no adapter, a plain one, its parent's config, or its own config (and
    whether that differs from the parent's in recipe and in emulation)."""
    if not layer.adapter:
        return "none"
    own = layer.adapter_config()
    if own is None:
        return "plain"
    if layer.adapter_recipe == PARENT:
        return "parent"
    return ("own", own[0] != layer.recipe, own[1] != layer.emulate)


#: How often the ordered corpus tries to show each feature before it stops preferring it.
_COVERAGE = 3


@functools.cache
def _ordered_corpus() -> tuple[ModelSpec, ...]:
    """The shared corpus, ordered so that every prefix shows each of the :func:`_features`, up to
    :data:`_COVERAGE` times, as often as a greedy choice can (ties and the rest in drawing order,
    which starts from the simplest models): the first models a property takes are as varied as
    the corpus allows."""
    remaining = list(_collect(_GENERAL, None, CORPUS_SIZE))
    features = {spec: _features(spec) for spec in remaining}
    seen: collections.Counter = collections.Counter()
    ordered = []
    while remaining:
        gains = [sum(1 for f in features[s] if seen[f] < _COVERAGE) for s in remaining]
        best = max(range(len(remaining)), key=gains.__getitem__)
        if gains[best] == 0:
            break
        ordered.append(remaining.pop(best))
        seen.update(features[ordered[-1]])
    return tuple(ordered + remaining)


def corpus(c: Constraints = _GENERAL, where: Callable[[ModelSpec], bool] | None = None, n: int = 25) -> tuple[ModelSpec, ...]:
    """The first ``n`` models of the shared corpus that ``c`` and ``where`` admit, topped up with
    models drawn under ``c`` itself when the corpus holds fewer. However small ``n`` (a property
    that compiles takes two), the first model holding each kind of ``c.kinds`` is among them."""
    pool = [s for s in _ordered_corpus() if c.admits(s) and (where is None or where(s))]
    firsts = [next((s for s in pool if kind in _kinds(s)), None) for kind in c.kinds]
    admitted = list(dict.fromkeys([s for s in firsts if s is not None] + pool))[:n]
    if len(admitted) < n:
        # Twice as many drawn as missing: Hypothesis's draws repeat, and some are in the corpus.
        admitted += [s for s in _collect(c, where, 2 * n) if s not in admitted][: n - len(admitted)]
    return tuple(admitted)


def smallest_of_each_kind(c: Constraints, where: Callable[[ModelSpec], bool] | None = None) -> dict[str, ModelSpec]:
    """Drawing kind of ``c.kinds`` -> the smallest model holding it of those a property asking
    ``c`` samples under a derandomized profile (its :func:`corpus` models, which hold each kind):
    a property that draws from its model as well visits only part of them, so
    ``conformance.draw.family_examples`` runs these first. Under another profile, of the first 25: a
    thorough profile's 200 would draw models afresh for a property the corpus holds too few for."""
    profile = hypothesis.settings.default
    found: dict[str, ModelSpec] = {}
    for spec in _smallest_first(c, where, profile.max_examples if profile.derandomize else min(profile.max_examples, 25)):
        for kind in _kinds(spec):
            found.setdefault(kind, spec)
    return {kind: found[kind] for kind in c.kinds if kind in found}


#: The quantized module kinds the backend under test converts; every kind outside a backend's run.
_SUPPORTED_KINDS: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("supported quantized module kinds", default=ALL_KINDS)


#: Whether the backend under test converts experts on ``F.scaled_grouped_mm`` (capability
#: ``scaled_grouped_mm_v2``); True outside a backend's run.
_GROUPED_V2: contextvars.ContextVar[bool] = contextvars.ContextVar("experts on F.scaled_grouped_mm", default=True)


#: The recipes and emulation of the float8 linears of the backend under test (its own, with
#: ``float8_modules``: ``Backend.float8_recipes``, ``Backend.float8_emulation``); TorchAO's all.
_FLOAT8: contextvars.ContextVar[tuple[tuple[str, ...], bool]] = contextvars.ContextVar(
    "float8 recipes and emulation", default=(FLOAT8_RECIPES, True)
)


@contextlib.contextmanager
def supported_kinds(kinds, *, grouped_v2: bool = True, float8_recipes=FLOAT8_RECIPES, float8_emulation: bool = True):
    """Within: :func:`model_specs` draws only quantized layers of ``kinds``, whatever a property
    allows (the kinds a backend converts: ``conformance.run.harness.supported_kinds``), float8
    layers only of ``float8_recipes`` and emulated only with ``float8_emulation``, and
    :func:`moe_specs` draws experts on ``F.scaled_grouped_mm`` only when ``grouped_v2``."""
    recipes = tuple(r for r in FLOAT8_RECIPES if r in set(float8_recipes))
    token, v2_token = _SUPPORTED_KINDS.set(tuple(kinds)), _GROUPED_V2.set(bool(grouped_v2))
    float8_token = _FLOAT8.set((recipes, bool(float8_emulation)))
    try:
        yield
    finally:
        _SUPPORTED_KINDS.reset(token)
        _GROUPED_V2.reset(v2_token)
        _FLOAT8.reset(float8_token)


def float8_left_out(c: Constraints) -> str | None:
    """Why the backend under test gets no float8 layer of a property asking ``c``, or None: none of
    the recipes ``c`` allows is one its float8 linears have, or ``c`` asks for emulated modules
    only and they have no emulated mode."""
    recipes, emulation = _FLOAT8.get()
    if FLOAT8_KIND not in c.kinds:
        return None
    if not any(r in recipes for r in c.recipes):
        return f"the property draws float8 recipes {list(c.recipes)}; the backend's float8 linears have {list(recipes)}"
    if c.emulate is True and not emulation:
        return "the property draws emulated float8 linears only; the backend's have no emulated mode"
    return None


def float8_recipes() -> tuple[str, ...]:
    """The recipes the float8 linears of the backend under test have (all of TorchAO's)."""
    return _FLOAT8.get()[0]


def float8_emulation() -> bool:
    """Whether the float8 linears of the backend under test have an emulated mode."""
    return _FLOAT8.get()[1]


def served_spec(spec: ModelSpec) -> ModelSpec:
    """A fixed model of the suite's (not drawn: an artifact's, a cross-process check's) as the
    backend under test can build it: each float8 layer or adapter of a recipe its float8 linears
    lack takes their first recipe, and is real where they have no emulated mode. ``spec`` itself
    for TorchAO's float8 linears."""
    recipes, emulation = _FLOAT8.get()

    def fit(recipe, emulate):
        if recipe is None or recipe == PARENT or kind_of(recipe) != FLOAT8_KIND:
            return recipe, emulate
        return (recipe if recipe in recipes else recipes[0]), (emulate and emulation)

    layers = []
    for layer in spec.layers:
        recipe, emulate = fit(layer.recipe, layer.emulate)
        adapter_recipe, adapter_emulate = fit(layer.adapter_recipe, layer.adapter_emulate)
        layers.append(dataclasses.replace(
            layer, recipe=recipe, emulate=emulate, adapter_recipe=adapter_recipe, adapter_emulate=adapter_emulate,
        ))
    return dataclasses.replace(spec, layers=tuple(layers))


def served(c: Constraints) -> Constraints:
    """``c`` narrowed to what the backend under test converts (:func:`supported_kinds`). A
    property left with nothing to draw is ``not_supported`` (a skip saying why): a missing recipe
    or emulated mode is what the backend declares, never a failure."""
    supported = _SUPPORTED_KINDS.get()
    recipes, emulation = _FLOAT8.get()
    left_out = float8_left_out(c)
    kinds = tuple(k for k in c.kinds if k in supported and (k != FLOAT8_KIND or left_out is None))
    if not kinds:
        mx_asked = {MX_KIND: "mxfp8 / mxfp8_emulated", MX_SWIZZLED_KIND: "mxfp8_swizzled"}
        if left_out is None and set(c.kinds) <= set(mx_asked):
            # The backend claims mx (the capability gate ran first): its mx_recipes lack these.
            left_out = (f"the property draws MX layers of recipe {' or '.join(mx_asked[k] for k in c.kinds)}, which the "
                        "backend's mx_recipes do not declare")
        if left_out is not None:
            import pytest

            from conformance.report.notes import NOT_SUPPORTED

            pytest.skip(f"{NOT_SUPPORTED} {left_out}")
        raise InvalidArgument(
            f"a property drawing only {list(c.kinds)} runs against a backend that converts only {list(supported)}"
        )
    own = tuple(r for r in c.recipes if r in recipes)
    return dataclasses.replace(
        c, kinds=kinds, float8_recipes=None if own == c.recipes else own, float8_emulation=emulation and c.float8_emulation,
    )


@functools.cache
def _fresh(c: Constraints, where: Callable[[ModelSpec], bool] | None) -> st.SearchStrategy[ModelSpec]:
    return _drawn_specs(c) if where is None else _drawn_specs(c).filter(where)


@functools.cache
def _smallest_first(c: Constraints, where: Callable[[ModelSpec], bool] | None, n: int) -> tuple[ModelSpec, ...]:
    """:func:`corpus`'s models for ``c`` ordered by size, ties in corpus order: the list a
    property samples. Hypothesis's first example takes its first model and, of the failing
    examples it ran, reports the one of lowest index (the smallest), shrunk towards the start."""
    return tuple(sorted(corpus(c, where, n), key=ModelSpec.size))


@st.composite
def _specs(draw, c: Constraints, where: Callable[[ModelSpec], bool] | None):
    # Resolved at each draw, not when the test module is imported: the backend's kinds are
    # known only once its test runs.
    c = served(c)
    profile = hypothesis.settings.default
    if profile.derandomize:
        return draw(st.sampled_from(_smallest_first(c, where, profile.max_examples)))
    shown = [spec for spec in variants(c) if where is None or where(spec)]
    if shown and draw(st.integers(0, 7), label="a model family") == 0:
        return draw(st.sampled_from(shown), label="family model")
    return draw(_fresh(c, where))


def model_specs(*, where: Callable[[ModelSpec], bool] | None = None, **constraints) -> st.SearchStrategy[ModelSpec]:
    """Models with at least one quantized layer, under :class:`Constraints` given by keyword, and
    ``where`` (a predicate on the model) when given.

    Under a derandomized Hypothesis profile the models come from the shared corpus (see the module
    docstring), as many as the profile's ``max_examples``; otherwise they are drawn afresh.
    ``kinds=ALL_KINDS`` draws MX models too where :func:`supported_kinds` allows them;
    ``require_nesting`` keeps the forced layer float8, since MX layers take no adapter.
    """
    c = Constraints(**constraints)
    strategy = _specs(c, where)
    # Read by conformance.draw.family_examples.family_examples, which runs the families first.
    strategy.constraints, strategy.where = c, where
    return strategy


# --- mixture-of-experts models (capability ``moe``) ------------------------------------------


@functools.cache
def grouped_fp8_runs(device: str = "cpu") -> bool:
    """Whether this torch executes FP8 grouped GEMMs (``torch._scaled_grouped_mm``) on ``device``:
    CPU builds trace them with fake tensors but have no kernel; sm90 GPUs run them."""
    import torch

    a = torch.zeros(16, 16, device=device).to(torch.float8_e4m3fn)
    b = torch.zeros(1, 16, 16, device=device).to(torch.float8_e4m3fn).transpose(-2, -1)
    offs = torch.tensor([16], dtype=torch.int32, device=device)
    return _runs(lambda: torch._scaled_grouped_mm(a, b, torch.ones(16, device=device), torch.ones(1, 16, device=device),
                                                  offs, out_dtype=torch.bfloat16))


@functools.cache
def grouped_v2_runs(device: str = "cpu") -> bool:
    """Whether this torch executes ``F.scaled_grouped_mm`` (``aten._scaled_grouped_mm_v2``) with
    rowwise scales on ``device``: torch 2.12 to 2.14 ship a CUDA kernel only."""
    import torch
    import torch.nn.functional as F

    if not (hasattr(F, "scaled_grouped_mm") and hasattr(F, "ScalingType")):
        return False
    a = torch.zeros(16, 16, device=device).to(torch.float8_e4m3fn)
    b = torch.zeros(1, 16, 16, device=device).to(torch.float8_e4m3fn).transpose(-2, -1)
    offs = torch.tensor([16], dtype=torch.int32, device=device)
    rowwise = F.ScalingType.RowWise
    return _runs(lambda: F.scaled_grouped_mm(a, b, torch.ones(16, device=device), rowwise, torch.ones(1, 16, device=device),
                                             rowwise, offs=offs, output_dtype=torch.bfloat16), _V2_ERRORS)


#: MoE models in the shared corpus of a derandomized run (a property's own settings, active while
#: it draws, must not change which models it gets).
MOE_CORPUS_SIZE = 4


def moe_specs(*, emulate: bool | None = False, v2: bool = False) -> st.SearchStrategy:
    """MoE models (:class:`conformance.draw.moe.MoESpec`): experts count, top-k, empty groups (experts
    masked out of routing), widths, depth and whether the input needs a gradient are drawn;
    shrinking heads for one layer of 2 experts, top-1, no empty group. ``emulate`` None: real
    and emulated experts. ``v2``: real experts may be on ``F.scaled_grouped_mm`` where
    :func:`supported_kinds` allows it (a backend that claims ``scaled_grouped_mm_v2``).

    Under a derandomized profile every property samples one shared corpus of models (as
    :func:`model_specs` does), so that a model traced for one MoE property serves the others;
    with ``emulate`` None its first model is also drawn emulated. With ``v2`` allowed, the
    corpus's real models at odd positions are on ``F.scaled_grouped_mm``, so that a property
    taking the whole corpus (every MOE property does) runs both APIs, the first model on the
    first API."""
    return _moe_specs_for(emulate, v2)


@st.composite
def _moe_specs_for(draw, emulate, v2):
    profile = hypothesis.settings.default
    v2 = v2 and _GROUPED_V2.get()
    if not profile.derandomize:
        spec = draw(_fresh_moe_specs(emulate))
        if v2 and not spec.emulate and draw(st.booleans(), label="experts on F.scaled_grouped_mm"):
            spec = dataclasses.replace(spec, v2=True)
        return spec
    shared = list(_moe_corpus(MOE_CORPUS_SIZE))
    if emulate is None:
        shared = shared[:-1] + [dataclasses.replace(shared[0], emulate=True)]
    elif emulate:
        shared = [dataclasses.replace(spec, emulate=True) for spec in shared]
    if v2:
        shared = [dataclasses.replace(spec, v2=True) if i % 2 and not spec.emulate else spec for i, spec in enumerate(shared)]
    return draw(st.sampled_from(shared))


@functools.cache
def _moe_corpus(n: int) -> tuple:
    """``n`` models of a fixed draw of MoE models, chosen greedily to show each feature (depth,
    experts, top-k, empty groups, input gradient, activation) as early as possible."""
    drawn = list(_moe_draws(8 * n))
    features = {spec: {("layers", spec.layers), ("experts", spec.experts), ("top_k", spec.top_k), ("empty", bool(spec.unused)),
                       ("input grad", spec.input_requires_grad), ("activation", spec.activation)} for spec in drawn}
    chosen, seen = [], set()
    while drawn and len(chosen) < n:
        best = max(drawn, key=lambda spec: len(features[spec] - seen))
        drawn.remove(best)
        chosen.append(best)
        seen |= features[best]
    return tuple(chosen)


@functools.cache
def _moe_draws(n: int) -> tuple:
    found: dict = {}

    @hypothesis.settings(
        database=None, derandomize=True, max_examples=n, deadline=None,
        phases=(hypothesis.Phase.generate,), suppress_health_check=list(hypothesis.HealthCheck),
    )
    @hypothesis.given(_fresh_moe_specs(False))
    def collect(spec):
        found.setdefault(spec, None)

    collect()
    return tuple(found)


@st.composite
def _fresh_moe_specs(draw, emulate: bool | None, max_layers: int = 2):
    from conformance.draw.moe import MoESpec

    experts = draw(st.integers(2, 4), label="experts")
    unused = draw(st.lists(st.integers(0, experts - 2), unique=True, max_size=experts - 2), label="unused experts")
    top_k = draw(st.integers(1, min(2, experts - len(unused))), label="top_k")
    return MoESpec(
        dim=draw(st.sampled_from((16, 32))),
        hidden=draw(st.sampled_from((16, 32, 48))),
        experts=experts,
        top_k=top_k,
        layers=draw(st.integers(1, max_layers)),
        tokens=draw(st.sampled_from((8, 16, 24))),
        unused=tuple(sorted(unused)),
        activation=draw(st.sampled_from(("relu", "gelu"))),
        emulate=draw(st.booleans()) if emulate is None else emulate,
        input_requires_grad=draw(st.booleans()),
    )


@st.composite
def experts_specs(draw, *, emulate: bool = False, padding: bool | None = None):
    """One experts module on drawn token groups (:class:`conformance.draw.moe.ExpertsSpec`): uneven
    sizes, multiples of 16, at least one empty group; with ``padding``, zero rows ending every group."""
    from conformance.draw.moe import ExpertsSpec

    groups = draw(st.lists(st.sampled_from((0, 16, 32, 48)), min_size=2, max_size=5), label="groups")
    groups[draw(st.integers(0, len(groups) - 1), label="empty group")] = 0
    if not any(groups):
        groups[-1] = 16
    pad = draw(st.booleans()) if padding is None else padding
    return ExpertsSpec(
        groups=tuple(groups),
        in_features=draw(st.sampled_from((16, 32))),
        out_features=draw(st.sampled_from((16, 32, 48))),
        padding=draw(st.sampled_from((1, 8, 16))) if pad else 0,
        emulate=emulate,
    )


# --- sharded models (capability ``distributed``) -----------------------------------------------


@st.composite
def sharded_specs(draw, *, tensor_parallel: bool = False) -> ModelSpec:
    """Models for the DP properties: real (not emulated) tensorwise float8 layers, which TorchAO's
    float8 all-gather and FP8 tensor-parallel styles assume, each called once, without residual
    or nested adapter. Data-parallel (default): one or two layers, the second sometimes a plain
    high-precision one. ``tensor_parallel``: two quantized layers, the first sharded colwise, the
    second rowwise; the hidden width is a multiple of 32, so that each rank's half of it is a
    multiple of 16, as a scaled matmul takes."""
    in_features = draw(st.sampled_from((32, 16, 48)), label="in_features")
    if tensor_parallel:
        hidden = draw(st.sampled_from((32, 64)), label="hidden width")
        widths, recipes = (hidden, draw(st.sampled_from((32, 16, 48)), label="output width")), ("tensorwise", "tensorwise")
    else:
        count = draw(st.integers(1, 2), label="layers")
        widths = tuple(draw(st.sampled_from(WIDTHS), label="width") for _ in range(count))
        recipes = ("tensorwise",) + tuple(draw(st.sampled_from(("tensorwise", None)), label="recipe") for _ in range(count - 1))
    layers = tuple(
        LayerSpec(width=w, recipe=r, bias=draw(st.booleans(), label="bias"), activation=draw(st.sampled_from(("relu", "none")), label="activation"))
        for w, r in zip(widths, recipes)
    )
    return ModelSpec(in_features, layers)
