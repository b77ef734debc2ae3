"""The models the suite draws, as plain data, and how to build them with real TorchAO.

A :class:`ModelSpec` is a frozen dataclass whose ``repr`` is valid Python, so every failing
Hypothesis example prints as code a person can paste; :meth:`ModelSpec.to_python` writes it one
layer per line, with only the fields that differ from their defaults::

    from conformance.draw.models import *

    spec = ModelSpec(
        in_features=16,
        layers=(
            LayerSpec(width=16, recipe='rowwise', adapter=True, adapter_recipe=None),
        ),
    )
    model, args = build_model(spec)

The model is a stack of linears called in order; each is either a plain ``nn.Linear`` or a
quantized one converted by ``torchao.float8.convert_to_float8_training`` with its own recipe, or
an MX layer (recipes ``mxfp8`` / ``mxfp8_emulated`` / ``mxfp8_swizzled``, in and out features
multiples of 32) that
the backend converts itself through the contract's ``Backend.convert_mx``: ``build_model(spec,
mx=backend.convert_mx)``, or a linear on torch's second scaled-matmul API (recipes
``scaled_mm_tensorwise`` / ``scaled_mm_rowwise``, kind ``float8_scaled_mm_linear``) that the
backend converts through ``Backend.convert_scaled_mm``: ``build_model(spec,
scaled_mm=backend.convert_scaled_mm)``, or an NVFP4 layer (recipes ``nvfp4`` / ``nvfp4_emulated``,
kind ``nvfp4_linear``, in and out features multiples of 32) that the backend converts through
``Backend.convert_nvfp4``: ``build_model(spec, nvfp4=backend.convert_nvfp4)``. A model with such
layers therefore prints with the backend that built it.
A layer may be called twice (module reuse), add its input (residual), apply an activation, and
carry a nested adapter inside a ``Float8Linear``: a ``Float8Linear`` with its parent's config or
its own recipe and ``emulate`` flag, or a plain ``nn.Linear`` (a LoRA-style high-precision
adapter, which is no quantized module).
"""

from __future__ import annotations

import dataclasses

__all__ = [
    "LayerSpec", "ModelSpec", "DrawnModel", "AdaptedFloat8Linear", "build_model", "MX_RECIPES", "PARENT", "kind_of",
    "spec_code", "recipe_compute_counts", "SCALED_MM_RECIPES", "NVFP4_RECIPES", "base_recipe", "adapted", "seed_for_init",
]

ACTIVATIONS = ("none", "relu", "gelu")
#: ``LayerSpec.adapter_recipe`` of an adapter converted with its parent's config.
PARENT = "parent"
#: Recipes of MX layers (kind ``mxfp8_linear``), converted by the backend (``Backend.convert_mx``):
#: ``mxfp8_swizzled`` is MXFP8 on ``F.scaled_mm`` with swizzled e8m0 scales (``Backend.mx_recipes``).
MX_RECIPES = ("mxfp8", "mxfp8_emulated", "mxfp8_swizzled")
#: Recipes of linears on the second scaled-matmul API (kind ``float8_scaled_mm_linear``), converted
#: by the backend (``Backend.convert_scaled_mm``) with the recipe named after the prefix.
SCALED_MM_RECIPES = ("scaled_mm_tensorwise", "scaled_mm_rowwise")
_SCALED_MM_PREFIX = "scaled_mm_"
#: Recipes of NVFP4 layers (kind ``nvfp4_linear``), converted by the backend (``Backend.convert_nvfp4``).
NVFP4_RECIPES = ("nvfp4", "nvfp4_emulated")
_MX_BLOCK = 32
#: NVFP4 layers' in and out features are multiples of this (16 bytes of packed float4).
_NVFP4_ALIGNMENT = 32


def kind_of(recipe: str) -> str:
    """The quantized module kind a recipe builds: ``mxfp8_linear``, ``nvfp4_linear``,
    ``float8_scaled_mm_linear`` or ``float8_linear``."""
    if recipe in MX_RECIPES:
        return "mxfp8_linear"
    if recipe in NVFP4_RECIPES:
        return "nvfp4_linear"
    return "float8_scaled_mm_linear" if recipe in SCALED_MM_RECIPES else "float8_linear"


def base_recipe(recipe: str) -> str:
    """The recipe a module's provenance names: a scaled-matmul layer's without its prefix
    (``scaled_mm_rowwise`` -> ``rowwise``, what ``Backend.convert_scaled_mm`` is given), any other
    as it is."""
    return recipe[len(_SCALED_MM_PREFIX):] if recipe in SCALED_MM_RECIPES else recipe


def recipe_compute_counts(calls, configs) -> dict[tuple[str, str], int]:
    """(fqn, pass) -> FP8 scaled matmuls the recipes issue for ``calls`` (``(fqn,
    input_requires_grad)`` in call order) of modules configured as ``configs`` (fqn -> (kind,
    recipe, emulate)): forward one per call; backward one for grad_input when the call's input
    needs a gradient and one for grad_weight unless the recipe is ``rowwise_with_gw_hp``;
    emulated modules none."""
    counts: dict[tuple[str, str], int] = {}
    for fqn, input_grad in calls:
        _kind, recipe, emulate = configs[fqn]
        if emulate:
            continue
        counts[(fqn, "forward")] = counts.get((fqn, "forward"), 0) + 1
        counts[(fqn, "backward")] = counts.get((fqn, "backward"), 0) + int(input_grad) + int(recipe != "rowwise_with_gw_hp")
    return counts


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One linear layer. ``recipe`` None means a plain high-precision ``nn.Linear``; an MX recipe
    (``mxfp8``, ``mxfp8_emulated``) the backend's MX linear, whose ``emulate`` is its recipe's; a
    scaled-matmul recipe (``scaled_mm_tensorwise``, ``scaled_mm_rowwise``) the backend's linear on
    ``F.scaled_mm``, never emulated.

    ``adapter`` nests a linear inside a float8 layer: ``adapter_recipe`` :data:`PARENT` converts
    it with the layer's own config, a float8 recipe with that recipe and ``adapter_emulate``
    (None: the layer's flag), None leaves it a plain ``nn.Linear``."""

    width: int
    recipe: str | None = "tensorwise"
    emulate: bool = False
    bias: bool = False
    activation: str = "relu"
    residual: bool = False
    calls: int = 1
    adapter: bool = False
    adapter_recipe: str | None = PARENT
    adapter_emulate: bool | None = None

    def adapter_config(self) -> tuple[str, bool] | None:
        """``(recipe, emulate)`` of the nested adapter, None when there is none or it is plain."""
        if not self.adapter or self.adapter_recipe is None:
            return None
        if self.adapter_recipe == PARENT:
            return self.recipe, self.emulate
        return self.adapter_recipe, self.emulate if self.adapter_emulate is None else self.adapter_emulate


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    in_features: int
    layers: tuple[LayerSpec, ...]
    batch: int = 16
    input_requires_grad: bool = True
    seed: int = 0

    def __post_init__(self):
        width = self.in_features
        for i, layer in enumerate(self.layers):
            if (layer.residual or layer.calls > 1) and layer.width != width:
                raise ValueError(f"layer {i}: residual or repeated calls need width {width}, got {layer.width}")
            if layer.adapter and layer.recipe is None:
                raise ValueError(f"layer {i}: a nested adapter needs a quantized layer")
            if layer.adapter_recipe in MX_RECIPES:
                raise ValueError(f"layer {i}: a nested adapter is a Float8Linear or a plain nn.Linear, not MX")
            if layer.recipe in MX_RECIPES:
                if width % _MX_BLOCK or layer.width % _MX_BLOCK:
                    raise ValueError(f"layer {i}: an MX layer needs in and out features multiples of 32, got {width} -> {layer.width}")
                if layer.adapter:
                    raise ValueError(f"layer {i}: MX layers take no nested adapter")
                if layer.emulate != (layer.recipe == "mxfp8_emulated"):
                    raise ValueError(f"layer {i}: recipe {layer.recipe!r} means emulate={layer.recipe == 'mxfp8_emulated'}")
            if layer.recipe in NVFP4_RECIPES:
                if width % _NVFP4_ALIGNMENT or layer.width % _NVFP4_ALIGNMENT:
                    raise ValueError(f"layer {i}: an NVFP4 layer needs in and out features multiples of 32, got {width} -> {layer.width}")
                if layer.adapter:
                    raise ValueError(f"layer {i}: NVFP4 layers take no nested adapter")
                if layer.emulate != (layer.recipe == "nvfp4_emulated"):
                    raise ValueError(f"layer {i}: recipe {layer.recipe!r} means emulate={layer.recipe == 'nvfp4_emulated'}")
            if layer.recipe in SCALED_MM_RECIPES and (layer.adapter or layer.emulate):
                raise ValueError(f"layer {i}: a {layer.recipe!r} layer takes no nested adapter and is never emulated")
            width = layer.width

    # -- what the suite knows about the model without asking the backend -------------------
    def quantized_modules(self) -> dict[str, tuple[str, str, bool]]:
        """FQN -> (kind, recipe, emulate) of every quantized module, the ground truth of PROV-002."""
        found = {}
        for i, layer in enumerate(self.layers):
            if layer.recipe is not None:
                found[f"layers.{i}"] = (kind_of(layer.recipe), base_recipe(layer.recipe), layer.emulate)
                if layer.adapter_config():
                    found[f"layers.{i}.adapter"] = ("float8_linear", *layer.adapter_config())
        return found

    def calls(self) -> list[tuple[str, bool]]:
        """``(fqn, input_requires_grad)`` for every call of a quantized module, in call order."""
        calls, needs_grad = [], self.input_requires_grad
        for i, layer in enumerate(self.layers):
            for _ in range(layer.calls):
                if layer.recipe is not None:
                    calls.append((f"layers.{i}", needs_grad))
                    if layer.adapter_config():
                        calls.append((f"layers.{i}.adapter", needs_grad))
                needs_grad = True  # every layer has a weight that requires grad
        return calls

    def expected_compute_counts(self) -> dict[tuple[str, str], int]:
        """(fqn, pass) -> FP8 scaled matmuls the recipe issues: the ground truth of VAL-007.

        Forward one per call; backward one for grad_input when the call's input needs a gradient
        and one for grad_weight unless the recipe is ``rowwise_with_gw_hp`` (``mxfp8`` and the
        scaled-matmul layers quantize all three); emulated modules (``emulate=True``,
        ``mxfp8_emulated``) none."""
        return recipe_compute_counts(self.calls(), self.quantized_modules())

    def has_mx(self) -> bool:
        return any(layer.recipe in MX_RECIPES for layer in self.layers)

    def has_nvfp4(self) -> bool:
        """Whether a layer is an NVFP4 linear (``Backend.convert_nvfp4``)."""
        return any(layer.recipe in NVFP4_RECIPES for layer in self.layers)

    def has_scaled_mm(self) -> bool:
        """Whether a layer is a linear on ``F.scaled_mm`` (``Backend.convert_scaled_mm``)."""
        return any(layer.recipe in SCALED_MM_RECIPES for layer in self.layers)

    def module_fqns(self) -> tuple[str, ...]:
        """FQN of every linear of the model, quantized or plain, nested adapters included: the
        modules a failure message may name."""
        found = []
        for i, layer in enumerate(self.layers):
            found.append(f"layers.{i}")
            if layer.adapter:
                found.append(f"layers.{i}.adapter")
        return tuple(found)

    def size(self) -> tuple[int, int]:
        """``(linears, parameters)``: how big the model is, for showing the smallest failing
        one. Nested adapters count as linears; a module called twice counts once."""
        linears, parameters, width = 0, 0, self.in_features
        for layer in self.layers:
            weights = width * layer.width * (2 if layer.adapter else 1)
            linears += 2 if layer.adapter else 1
            parameters += weights + (layer.width if layer.bias else 0)
            width = layer.width
        return linears, parameters

    def has_float8(self) -> bool:
        """Whether a layer or nested adapter is a float8 linear (kind ``float8_linear``)."""
        return any(kind == "float8_linear" for kind, _recipe, _emulate in self.quantized_modules().values())

    def to_python(self, backend: str | None = None, *, own_float8: bool = False) -> str:
        """The model as code that builds it, one layer per line. ``backend``
        (``"package.module:Class"``) converts its MX and scaled-matmul layers, and its float8
        layers when ``own_float8`` (it claims ``float8_modules``); a model with TorchAO's float8
        layers only needs none."""
        converters = (
            [("float8", "convert_float8")] * (own_float8 and self.has_float8())
            + [("mx", "convert_mx")] * self.has_mx() + [("scaled_mm", "convert_scaled_mm")] * self.has_scaled_mm()
            + [("nvfp4", "convert_nvfp4")] * self.has_nvfp4()
        )
        if not converters:
            return "import torch\nfrom conformance.draw.models import *\n\n" + spec_code(self) + "model, args = build_model(spec)\n"
        return reproducer("conformance.draw.models", "build_model", self, backend, *converters)


#: Fields written in every reproducer, default or not: what a reader looks for first (a
#: layer's width and recipe, an MoE model's shape).
_ALWAYS_SHOWN = ("width", "recipe", "dim", "hidden", "experts", "top_k", "layers", "groups")


def _arguments(spec) -> list[tuple[str, object]]:
    """``(name, value)`` of the fields of the dataclass ``spec`` that differ from their default,
    and of those in :data:`_ALWAYS_SHOWN`."""
    shown = []
    for field in dataclasses.fields(spec):
        value = getattr(spec, field.name)
        if field.name in _ALWAYS_SHOWN or field.default is dataclasses.MISSING or value != field.default:
            shown.append((field.name, value))
    return shown


def _value_code(value, indent: str) -> str:
    """A field's value as Python: a tuple of dataclasses (the layers) one per line, the rest as
    their ``repr`` (one line each)."""
    if isinstance(value, tuple) and value and all(dataclasses.is_dataclass(item) for item in value):
        inner = indent + "    "
        lines = [f"{inner}{_inline(item)},\n" for item in value]
        return "(\n" + "".join(lines) + f"{indent})"
    return _inline(value) if dataclasses.is_dataclass(value) else repr(value)


def _inline(spec) -> str:
    if not dataclasses.is_dataclass(spec):
        return repr(spec)
    return f"{type(spec).__name__}(" + ", ".join(f"{name}={_inline(v)}" for name, v in _arguments(spec)) + ")"


def spec_code(spec, name: str = "spec") -> str:
    """``name = Spec(...)`` for the frozen dataclass ``spec``: one field per line, the fields
    left at their default left out, a tuple of layers one layer per line. It evaluates to a
    spec equal to ``spec``; the one-line ``repr`` stays the machine-readable form."""
    lines = [f"{name} = {type(spec).__name__}(\n"]
    for field, value in _arguments(spec):
        lines.append(f"    {field}={_value_code(value, '    ')},\n")
    return "".join(lines) + ")\n"


def reproducer(module_name: str, builder: str, spec, backend: str | None, *converters: tuple[str, str]) -> str:
    """Python that rebuilds ``spec``'s model with ``builder`` from ``module_name``, the quantized
    layers converted by ``backend``'s methods (``converters``: ``(keyword, method)`` pairs, each
    method passed as its keyword), to paste and run."""
    module, _, qualname = (backend or "your_backend:YourBackend").partition(":")
    if len(converters) == 1:
        keyword, method = converters[0]
        call = f"model, args = {builder}(spec, {keyword}={qualname}().{method})\n"
    else:
        passed = ", ".join(f"{keyword}=backend.{method}" for keyword, method in converters)
        call = f"backend = {qualname}()\nmodel, args = {builder}(spec, {passed})\n"
    return (
        "import torch\n"
        f"from {module_name} import *\n"
        f"from {module} import {qualname}\n\n"
        + spec_code(spec)
        + call
    )


def _float8_config(recipe: str, emulate: bool, fqn: str | None = None):
    """The ``Float8LinearConfig`` of the module at ``fqn`` (the suite's FPR changes wrap this)."""
    from torchao.float8 import Float8LinearConfig

    return dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)


def _adapted_class():
    from torchao.float8.float8_linear import Float8Linear

    class AdaptedFloat8Linear(Float8Linear):
        """A ``Float8Linear`` with a quantized low-rank-style adapter nested inside it."""

        def forward(self, input):
            return super().forward(input) + self.adapter(input)

    return AdaptedFloat8Linear


def __getattr__(name):
    # Defined lazily so that importing conformance.draw.models does not import torchao.
    if name == "AdaptedFloat8Linear":
        return _adapted_class_cached()
    if name == "DrawnModel":
        return _drawn_model_class()
    raise AttributeError(name)


_CACHE: dict[str, object] = {}


def seed_for_init(seed: int) -> None:
    """``torch.manual_seed(seed)`` before a model is built on the CPU. Where torch sees no
    accelerator (``torch.accelerator``: CUDA, XPU, MTIA, MPS or a custom backend), the CPU
    generator is seeded alone, which is all that call seeds there: it also queues a seeding per
    absent device with the caller's formatted stack (half a millisecond a model under pytest,
    thousands of models a run)."""
    import torch

    if "accelerator" not in _CACHE:
        _CACHE["accelerator"] = torch.accelerator.is_available()
    if _CACHE["accelerator"]:
        torch.manual_seed(seed)
    else:
        torch.random.default_generator.manual_seed(seed)


def _adapted_class_cached():
    if "adapted" not in _CACHE:
        _CACHE["adapted"] = _adapted_class()
    return _CACHE["adapted"]


def _drawn_model_class():
    if "drawn" in _CACHE:
        return _CACHE["drawn"]
    import torch

    class DrawnModel(torch.nn.Module):
        def __init__(self, spec: ModelSpec):
            super().__init__()
            self.spec = spec
            widths = [spec.in_features] + [layer.width for layer in spec.layers]
            self.layers = torch.nn.ModuleList(
                torch.nn.Linear(widths[i], layer.width, bias=layer.bias) for i, layer in enumerate(spec.layers)
            )

        def forward(self, x):
            for layer_spec, layer in zip(self.spec.layers, self.layers):
                x = apply_layer(layer_spec, layer, x)
            return x

    _CACHE["drawn"] = DrawnModel
    return DrawnModel


def _convert_own(model, i: int, layer: LayerSpec, float8) -> None:
    """Convert layer ``i`` (and its nested adapter) with a backend's ``convert_float8``."""
    import torch

    fqn = f"layers.{i}"
    float8(model, module_filter_fn=lambda m, name: name == fqn, recipe=layer.recipe, emulate=layer.emulate)
    if not layer.adapter:
        return
    outer = model.layers[i]
    outer.adapter = torch.nn.Linear(outer.in_features, outer.out_features, bias=False, device=outer.weight.device)
    own = layer.adapter_config()
    if own is not None:
        float8(outer, module_filter_fn=lambda m, name: name == "adapter", recipe=own[0], emulate=own[1])
    outer.__class__ = adapted(type(outer))


def adapted(cls: type) -> type:
    """The subclass of the quantized linear class ``cls`` whose forward adds its ``adapter``'s
    output: :class:`AdaptedFloat8Linear` for TorchAO's ``Float8Linear``, one made (once) for any
    other. Subclassing keeps what the class declares (its protocol method, a registration)."""
    from torchao.float8.float8_linear import Float8Linear

    if cls is Float8Linear:
        return _adapted_class_cached()
    key = f"adapted:{cls.__module__}.{cls.__qualname__}"
    if _CACHE.get(key, (None,))[0] is not cls:

        def forward(self, input):
            return super(made, self).forward(input) + self.adapter(input)

        made = type(f"Adapted{cls.__name__}", (cls,), {"forward": forward, "__module__": __name__})
        _CACHE[key] = (cls, made)
    return _CACHE[key][1]


def apply_layer(layer_spec: LayerSpec, layer, x):
    """Run one drawn layer on ``x``: its calls, residual and activation."""
    import torch

    for _ in range(layer_spec.calls):
        y = layer(x)
        if layer_spec.residual:
            y = y + x
        if layer_spec.activation == "relu":
            y = torch.relu(y)
        elif layer_spec.activation == "gelu":
            y = torch.nn.functional.gelu(y)
        x = y
    return x


def build_model(spec: ModelSpec, device: str = "cpu", *, mx=None, scaled_mm=None, float8=None, nvfp4=None,
                float8_all_gather: bool = False):
    """Build the model of ``spec``; return ``(model, args)``.

    ``float8_all_gather``: convert the float8 layers with TorchAO's
    ``enable_fsdp_float8_all_gather`` on (for a data-parallel step, capability ``distributed``).

    Float8 layers are converted with TorchAO, or by ``float8`` when given, called as
    ``float8(model, module_filter_fn=..., recipe=..., emulate=...)`` with the contract of
    ``Backend.convert_float8`` (pass ``backend.convert_float8``); a nested adapter is then
    converted by a second call on its parent, whose class becomes a subclass adding the
    adapter's output (:func:`adapted`). MX layers are converted by ``mx``, called as
    ``mx(model, module_filter_fn=..., recipe=...)`` with the contract of ``Backend.convert_mx``
    (pass ``backend.convert_mx``); a model with MX layers and no ``mx`` is a ValueError. Layers
    on the second scaled-matmul API are converted by ``scaled_mm`` alike (``Backend.convert_scaled_mm``,
    called with the recipe without its prefix: ``"tensorwise"`` or ``"rowwise"``), and NVFP4 layers
    by ``nvfp4`` (``Backend.convert_nvfp4``, called with ``"nvfp4"`` or ``"nvfp4_emulated"``).
    """
    import torch
    from torchao.float8 import convert_to_float8_training

    if mx is None and spec.has_mx():
        mx_layers = [f"layers.{i} ({layer.recipe})" for i, layer in enumerate(spec.layers) if layer.recipe in MX_RECIPES]
        raise ValueError(
            f"the model has MX layers {', '.join(mx_layers)}: pass mx=backend.convert_mx of a backend that claims "
            "capability 'mx' to build them"
        )
    if scaled_mm is None and spec.has_scaled_mm():
        found = [f"layers.{i} ({layer.recipe})" for i, layer in enumerate(spec.layers) if layer.recipe in SCALED_MM_RECIPES]
        raise ValueError(
            f"the model has scaled-matmul layers {', '.join(found)}: pass scaled_mm=backend.convert_scaled_mm of a "
            "backend that claims capability 'scaled_mm_v2' to build them"
        )
    if nvfp4 is None and spec.has_nvfp4():
        found = [f"layers.{i} ({layer.recipe})" for i, layer in enumerate(spec.layers) if layer.recipe in NVFP4_RECIPES]
        raise ValueError(
            f"the model has NVFP4 layers {', '.join(found)}: pass nvfp4=backend.convert_nvfp4 of a backend that claims "
            "capability 'nvfp4' to build them"
        )
    seed_for_init(spec.seed)
    model = _drawn_model_class()(spec)
    for i, layer in enumerate(spec.layers):
        if layer.recipe is None:
            continue
        if layer.recipe in MX_RECIPES:
            mx(model, module_filter_fn=lambda m, fqn, i=i: fqn == f"layers.{i}", recipe=layer.recipe)
            continue
        if layer.recipe in SCALED_MM_RECIPES:
            scaled_mm(model, module_filter_fn=lambda m, fqn, i=i: fqn == f"layers.{i}", recipe=base_recipe(layer.recipe))
            continue
        if layer.recipe in NVFP4_RECIPES:
            nvfp4(model, module_filter_fn=lambda m, fqn, i=i: fqn == f"layers.{i}", recipe=layer.recipe)
            continue
        if float8 is not None:
            if float8_all_gather:
                raise ValueError("float8_all_gather is TorchAO's setting: it builds no backend's own float8 linears")
            _convert_own(model, i, layer, float8)
            continue
        config = _float8_config(layer.recipe, layer.emulate, fqn=f"layers.{i}")
        if float8_all_gather:
            config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
        if layer.adapter:
            linear = model.layers[i]
            outer = _adapted_class_cached().from_float(linear, config=config)
            outer.adapter = torch.nn.Linear(linear.in_features, linear.out_features, bias=False)
            if layer.adapter_recipe == PARENT:
                convert_to_float8_training(outer, config=config, module_filter_fn=lambda m, fqn: fqn == "adapter")
            elif layer.adapter_recipe is not None:
                own = _float8_config(*layer.adapter_config(), fqn=f"layers.{i}.adapter")
                convert_to_float8_training(outer, config=own, module_filter_fn=lambda m, fqn: fqn == "adapter")
            model.layers[i] = outer
        else:
            convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn, i=i: fqn == f"layers.{i}")
    model.to(device)
    x = torch.randn(spec.batch, spec.in_features, device=device, requires_grad=spec.input_requires_grad)
    return model, (x,)
