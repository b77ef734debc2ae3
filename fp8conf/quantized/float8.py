"""Finding the quantized modules of a model and naming their quantization config.

A *quantized module* computes in FP8: torchao's ``Float8Linear`` (kind ``float8_linear``),
fp8conf's own ``MXLinear`` (kind ``mxfp8_linear``) or ``Float8GroupedExperts`` (kind
``float8_grouped_experts``, the experts of a mixture-of-experts layer). Each gets a :class:`QuantizationConfig`
that names its recipe the way people do (``tensorwise``, ``rowwise`` ...), so that provenance,
validation and error messages speak the user's language.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from fp8conf.arguments import require
from fp8conf.errors import FP8ConfigError
from fp8conf.log import library_notices_quieted

__all__ = [
    "QuantizationConfig",
    "FLOAT8_RECIPES",
    "find_quantized_modules",
    "quantization_config_of",
    "recognize_float8_recipe",
]

#: The torchao recipes recognised by name. Any other Float8LinearConfig is recipe ``custom``.
FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")

# Fields that do not change what a Float8Linear computes, so they do not decide the recipe.
_NON_RECIPE_FIELDS = frozenset({"emulate", "enable_fsdp_float8_all_gather", "force_recompute_fp8_weight_in_bwd"})


@dataclasses.dataclass(frozen=True)
class QuantizationConfig:
    """How one quantized module computes.

    Attributes:
        kind: ``"float8_linear"``, ``"mxfp8_linear"``, ``"float8_grouped_experts"`` or
            ``"float8_scaled_mm_linear"``.
        recipe: recipe name; ``"custom"`` for a Float8LinearConfig matching no named recipe.
        emulate: True when the module deliberately computes in high precision (no FP8 matmul).
        fp8_grad_input: the backward computes grad_input with an FP8 matmul.
        fp8_grad_weight: the backward computes grad_weight with an FP8 matmul (False for
            ``rowwise_with_gw_hp``, which keeps it in high precision).
    """

    kind: str
    recipe: str
    emulate: bool
    fp8_grad_input: bool = True
    fp8_grad_weight: bool = True


def _recipe_fields(config) -> dict:
    return {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(config)
        if f.name not in _NON_RECIPE_FIELDS
    }


@functools.cache
def import_torchao_quietly() -> None:
    """Import TorchAO (once) without its load-time notices (extensions built for another
    platform, enums registered with pytree): fp8conf's import of it is not the user's concern.
    Where the user imported TorchAO first, this does nothing."""
    with library_notices_quieted():
        import torchao.float8  # noqa: F401


@functools.lru_cache(maxsize=None)
def _named_recipe_fields() -> tuple[tuple[str, dict], ...]:
    import_torchao_quietly()
    from torchao.float8 import Float8LinearConfig

    return tuple((name, _recipe_fields(Float8LinearConfig.from_recipe_name(name))) for name in FLOAT8_RECIPES)


def recognize_float8_recipe(config) -> str:
    """Name the torchao recipe a ``Float8LinearConfig`` was built from, or ``"custom"``."""
    fields = _recipe_fields(config)
    for name, named in _named_recipe_fields():
        if fields == named:
            return name
    return "custom"


def _float8_linear_config(module) -> QuantizationConfig:
    import_torchao_quietly()
    from torchao.float8.config import ScalingType

    config = module.config
    return QuantizationConfig(
        kind="float8_linear",
        recipe=recognize_float8_recipe(config),
        emulate=bool(config.emulate),
        fp8_grad_input=config.cast_config_grad_output.scaling_type is not ScalingType.DISABLED,
        fp8_grad_weight=config.cast_config_input_for_grad_weight.scaling_type is not ScalingType.DISABLED,
    )


def quantization_config_of(module: torch.nn.Module) -> QuantizationConfig | None:
    """The quantization config of ``module``, or None when it does not compute in FP8."""
    import_torchao_quietly()
    from torchao.float8.float8_linear import Float8Linear

    if isinstance(module, Float8Linear):
        return _float8_linear_config(module)
    kind = getattr(module, "quant_kind", None)
    if kind in ("mxfp8_linear", "float8_grouped_experts", "float8_scaled_mm_linear"):
        return QuantizationConfig(kind=kind, recipe=module.recipe, emulate=bool(module.emulate))
    return None


def find_quantized_modules(model: torch.nn.Module) -> dict[str, QuantizationConfig]:
    """Map the FQN of every quantized module in ``model`` to its config, in registration order."""
    require(model, "model", "find_quantized_modules", "model")
    if not isinstance(model, torch.nn.Module):
        raise FP8ConfigError(f"expected a torch.nn.Module, got {type(model).__qualname__}")
    found = {}
    for fqn, module in model.named_modules(remove_duplicate=True):
        config = quantization_config_of(module)
        if config is not None:
            found[fqn] = config
    return found
