"""TorchAO's ``Float8Linear`` through the quantized-module protocol (:mod:`fp8conf.quantized.protocol`).

fp8conf does not own TorchAO's module, so it is described from outside: kind ``float8_linear``,
its recipe named the way people do (``tensorwise``, ``rowwise`` ...), so that provenance,
validation and error messages speak the user's language, and every field of its
``Float8LinearConfig`` but ``emulate`` as the settings the quantization signature keys on. The
protocol registers :func:`torchao_float8_linear_config` by the class's dotted name, so TorchAO is
imported only once such a module is met.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from fp8conf.log import library_notices_quieted

__all__ = [
    "FLOAT8_RECIPES",
    "recognize_float8_recipe",
    "torchao_float8_linear_config",
]

#: The torchao recipes recognised by name. Any other Float8LinearConfig is recipe ``custom``.
FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")

# Fields that do not change what a Float8Linear computes, so they do not decide the recipe.
_NON_RECIPE_FIELDS = frozenset({"emulate", "enable_fsdp_float8_all_gather", "force_recompute_fp8_weight_in_bwd"})


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


def torchao_float8_linear_config(module) -> dict:
    """What a TorchAO ``Float8Linear`` declares, as the fields of a
    :class:`~fp8conf.QuantizationConfig`: its named recipe, and every field of its
    ``Float8LinearConfig`` but ``emulate`` as settings. (A mapping, as any describer may return,
    so that this module and the protocol's do not import each other.)"""
    import_torchao_quietly()
    from torchao.float8.config import ScalingType

    config = module.config
    return {
        "kind": "float8_linear",
        "recipe": recognize_float8_recipe(config),
        "emulate": bool(config.emulate),
        "fp8_grad_input": config.cast_config_grad_output.scaling_type is not ScalingType.DISABLED,
        "fp8_grad_weight": config.cast_config_input_for_grad_weight.scaling_type is not ScalingType.DISABLED,
        "settings": {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "emulate"},
    }
