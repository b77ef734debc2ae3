"""The quantized-module protocol: how any module tells fp8conf that, and how, it computes in FP8.

Every pass (provenance, validation, regions, split, fingerprint) learns what a module computes
from one place, :func:`quantization_config_of`, which asks in this order:

1. the module itself, when it has a ``fp8_quantization()`` method (the :class:`QuantizedModule`
   protocol; no base class to inherit, nothing to import);
2. a describer registered for its class or one of its bases, by class object or by dotted name
   (:func:`register_quantized_module`): for a trainer that owns its modules and cannot import
   fp8conf in them, and for the modules fp8conf does not own (TorchAO's ``Float8Linear`` is
   registered so, in :mod:`fp8conf.quantized.float8`).

Either answer is a :class:`QuantizationConfig` or a mapping of its fields (``{"kind":
"float8_linear", "recipe": "rowwise", "emulate": False}``), or ``None`` for an instance that
does not compute in FP8. A module that computes in FP8 and declares nothing is *undeclared*:
every pass names it (:func:`undeclared_fp8_message`) instead of taking it for lost FP8.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from fp8conf.arguments import require
from fp8conf.errors import FP8ConfigError

__all__ = [
    "QuantizationConfig",
    "QuantizedModule",
    "register_quantized_module",
    "quantization_config_of",
    "find_quantized_modules",
    "class_name",
    "undeclared_fp8_message",
    "OWN_MODULES_GUIDE",
]

_log = logging.getLogger("fp8conf")

#: Where a user reads how to declare a module (named in every "undeclared" message).
OWN_MODULES_GUIDE = "docs/own_modules.md"


@dataclasses.dataclass(frozen=True)
class QuantizationConfig:
    """How one quantized module computes.

    Attributes:
        kind: what the module is, in the words provenance and reports use
            (``"float8_linear"``, ``"mxfp8_linear"``, ``"float8_grouped_experts"``,
            ``"float8_scaled_mm_linear"``, or a trainer's own name).
        recipe: recipe name (``"tensorwise"``, ``"rowwise"``, ``"rowwise_with_gw_hp"``,
            ``"mxfp8"`` ...); ``"custom"`` for a TorchAO config matching no named recipe.
        emulate: True when the module deliberately computes in high precision (no FP8 matmul).
        fp8_grad_input: the backward computes grad_input with FP8 matmuls.
        fp8_grad_weight: the backward computes grad_weight with FP8 matmuls (False for
            ``rowwise_with_gw_hp``, which keeps it in high precision).
        matmuls: FP8 compute ops one call issues in the forward; each gradient the backward
            computes in FP8 issues as many (1 for a linear).
        settings: every other setting that changes the module's numerics, as ``(name, value)``
            pairs (a mapping is accepted); the quantization signature keys artifacts on them.
    """

    kind: str
    recipe: str
    emulate: bool
    fp8_grad_input: bool = True
    fp8_grad_weight: bool = True
    matmuls: int = 1
    settings: tuple = ()

    def __post_init__(self):
        for name in ("kind", "recipe"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise FP8ConfigError(f"QuantizationConfig.{name} must be a non-empty string, got {value!r}")
        for name in ("emulate", "fp8_grad_input", "fp8_grad_weight"):
            if not isinstance(getattr(self, name), bool):
                raise FP8ConfigError(f"QuantizationConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if isinstance(self.matmuls, bool) or not isinstance(self.matmuls, int) or self.matmuls < 1:
            raise FP8ConfigError(f"QuantizationConfig.matmuls must be an int >= 1, got {self.matmuls!r}")
        refused = FP8ConfigError(f"QuantizationConfig.settings must map names to values, got {self.settings!r}")
        if not isinstance(self.settings, (Mapping, tuple, list)):
            raise refused
        try:
            settings = dict(self.settings)
        except (TypeError, ValueError):  # a sequence that is not of (name, value) pairs
            raise refused from None
        if not all(isinstance(k, str) for k in settings):
            raise refused
        object.__setattr__(self, "settings", tuple(sorted((k, _hashable(v)) for k, v in settings.items())))

    @classmethod
    def of(cls, declared: QuantizationConfig | Mapping, where: str) -> QuantizationConfig:
        """``declared`` as a config: a config as it is, a mapping by its fields (unknown names
        are refused, naming ``where``)."""
        if isinstance(declared, cls):
            return declared
        if not isinstance(declared, Mapping):
            raise FP8ConfigError(
                f"{where} declared {declared!r}; declare a fp8conf.QuantizationConfig or a mapping of its fields "
                f"(kind, recipe, emulate, ...), or None for an instance that does not compute in FP8 (see {OWN_MODULES_GUIDE})"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(declared) - known)
        missing = sorted({"kind", "recipe", "emulate"} - set(declared))
        if unknown or missing:
            raise FP8ConfigError(
                f"{where} declared {dict(declared)!r}: "
                + "; ".join(p for p in (f"unknown field(s) {unknown}" if unknown else "", f"missing {missing}" if missing else "") if p)
                + f". The fields are {sorted(known)} (see {OWN_MODULES_GUIDE})"
            )
        return cls(**declared)


def _hashable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _hashable(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    return value


@runtime_checkable
class QuantizedModule(Protocol):
    """A module that computes in FP8 and says how: ``fp8_quantization()`` returns its
    :class:`QuantizationConfig` (or a mapping of its fields), or ``None`` when this instance
    does not compute in FP8. Implementing it needs no import of fp8conf."""

    def fp8_quantization(self) -> QuantizationConfig | Mapping | None: ...


Describer = Callable[[torch.nn.Module], "QuantizationConfig | Mapping | None"]
_BY_CLASS: dict[type, Describer] = {}
_BY_NAME: dict[str, Describer] = {}


def class_name(cls: type) -> str:
    """``package.module.QualName``: how a class is registered by name and named in messages."""
    return f"{cls.__module__}.{cls.__qualname__}"


def register_quantized_module(module_class: type | str, describe: Describer) -> None:
    """Declare that instances of ``module_class`` (and its subclasses) compute in FP8 as
    ``describe(module)`` says: a :class:`QuantizationConfig`, a mapping of its fields, or
    ``None`` for an instance that does not.

    ``module_class`` is a class or its dotted name (``"mytrainer.float8.Float8Linear"``), so a
    class can be registered without importing it. Registering a class again replaces its
    describer (logged). The module's own ``fp8_quantization()`` method, where it has one, comes
    first."""
    if isinstance(module_class, str):
        if "." not in module_class.strip("."):
            raise FP8ConfigError(
                f"register_quantized_module: {module_class!r} is not a dotted class name; give the class or "
                "'package.module.ClassName'"
            )
        table, key = _BY_NAME, module_class
    elif isinstance(module_class, type) and issubclass(module_class, torch.nn.Module):
        table, key = _BY_CLASS, module_class
    else:
        raise FP8ConfigError(
            f"register_quantized_module: expected a torch.nn.Module subclass or its dotted name, got {module_class!r}"
        )
    if not callable(describe):
        raise FP8ConfigError(f"register_quantized_module: describe must be callable (module -> QuantizationConfig), got {describe!r}")
    if key in table and table[key] is not describe:
        _log.info("fp8conf: the describer of quantized module class %s was replaced", key if isinstance(key, str) else class_name(key))
    table[key] = describe


def _describer(module: torch.nn.Module) -> tuple[Describer | None, str]:
    method = getattr(module, "fp8_quantization", None)
    if callable(method):
        return (lambda _m: method()), f"{class_name(type(module))}.fp8_quantization()"
    for cls in type(module).__mro__:
        found = _BY_CLASS.get(cls) or _BY_NAME.get(class_name(cls))
        if found is not None:
            return found, f"the describer registered for {class_name(cls)}"
    return None, ""


def _torchao_float8_linear(module):
    from fp8conf.quantized.float8 import torchao_float8_linear_config

    return torchao_float8_linear_config(module)


# TorchAO's Float8Linear, by name: nothing of TorchAO is imported until such a module is met.
_BY_NAME["torchao.float8.float8_linear.Float8Linear"] = _torchao_float8_linear


def quantization_config_of(module: torch.nn.Module) -> QuantizationConfig | None:
    """The quantization config ``module`` declares, or ``None`` when it declares none."""
    describe, where = _describer(module)
    if describe is None:
        return None
    declared = describe(module)
    return None if declared is None else QuantizationConfig.of(declared, where)


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


def undeclared_fp8_message(module_fqn: str, module_class: str, seen: str) -> str:
    """What every pass says of FP8 compute inside a module that declares no quantization."""
    return (
        f"module '{module_fqn or '<root>'}' ({module_class}) computes FP8 ({seen}) but is not a quantized module "
        "fp8conf knows: declare it with a fp8_quantization() method or fp8conf.register_quantized_module("
        f"{module_class!r}, describe) (see {OWN_MODULES_GUIDE})"
    )
