"""The make_fx trainer's quantization signature and its whole-step artifact key.

The trainer's jobs name a recipe per quantized module, as torchtitan's ``float8.recipe_name``
does, and build each ``Float8LinearConfig`` with ``Float8LinearConfig.from_recipe_name``: a
module whose config is none of the named recipes (a field changed by hand) is one no job of it
can express, and it refuses to describe it (:class:`UnnamedConfigError`).

* Signature (:func:`train_step_signature`): per quantized module, its kind, recipe name and
  ``emulate`` flag, as canonical JSON. It describes the modules, nothing global.
* Artifact key (:func:`step_key`): the digest of everything the traced step depends on: the
  modules' description, the ``strict`` flag, the torch and torchao versions as their installed
  package metadata states them (``importlib.metadata``, as packaging tools read them), the
  whole job configuration, and the names and shapes of the parameters and buffers in
  registration order, since the traced step takes them by position. Another structure or
  registration order is another key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import itertools
import json

import torch

from conformance.backends.makefx_trainer import TrainerConfig, quantized_modules

__all__ = ["UnnamedConfigError", "module_recipes", "train_step_signature", "step_key", "installed_versions"]

#: The packages whose versions key an artifact.
KEYED_PACKAGES = ("torch", "torchao")


class UnnamedConfigError(ValueError):
    """A quantized module's ``Float8LinearConfig`` is none of the named recipes, so no job of the
    trainer can express it."""


def _canonical(document) -> str:
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def module_recipes(model: torch.nn.Module) -> dict[str, dict]:
    """Per quantized module FQN: ``{"kind", "recipe", "emulate"}``, the recipe being the named
    recipe whose config (with the module's ``emulate``) equals the module's own."""
    from torchao.float8.config import Float8LinearConfig, Float8LinearRecipeName

    named = [recipe.value for recipe in Float8LinearRecipeName]
    found = {}
    for fqn, info in quantized_modules(model).items():
        module = model.get_submodule(fqn)
        if not hasattr(module, "config"):  # the trainer's own linears: built from a recipe name
            found[fqn] = {"kind": info.kind, "recipe": module.recipe, "emulate": info.emulate}
            continue
        config = module.config
        recipe = next(
            (name for name in named if dataclasses.replace(Float8LinearConfig.from_recipe_name(name), emulate=config.emulate) == config),
            None,
        )
        if recipe is None:
            raise UnnamedConfigError(
                f"module {fqn!r}: its Float8LinearConfig is none of the recipes {named} (emulate={config.emulate}); "
                f"a job names a recipe per module and cannot express it"
            )
        found[fqn] = {"kind": info.kind, "recipe": recipe, "emulate": info.emulate}
    return found


def train_step_signature(model: torch.nn.Module) -> str:
    """Canonical JSON ``{"modules": {fqn: {"kind", "recipe", "emulate"}}}``."""
    return _canonical({"modules": module_recipes(model)})


def installed_versions() -> dict[str, str]:
    """The versions of :data:`KEYED_PACKAGES` that their installed metadata states."""
    return {name: importlib.metadata.version(name) for name in KEYED_PACKAGES}


def step_key(model: torch.nn.Module, *, strict: bool = True, config: TrainerConfig = TrainerConfig()) -> str:
    """The artifact key of ``model``'s training step traced under ``strict`` and ``config``: a
    sha256 hex digest."""
    state = itertools.chain(model.named_parameters(), model.named_buffers())
    document = {
        "modules": module_recipes(model),
        "strict": bool(strict),
        "versions": installed_versions(),
        "job": dataclasses.asdict(config),
        "state": [[name, list(tensor.shape)] for name, tensor in state],
    }
    return hashlib.sha256(_canonical(document).encode()).hexdigest()
