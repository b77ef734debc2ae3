"""Mutant backends for the contract points peers implement: empty region reports, split
runners that compute on their own, fingerprints blind to the backend's job configuration, and
whole-step fingerprints (``fingerprint_scope = "whole_step"``) that miss a quantization input,
depend on the hash seed, or cover what no scope may.

``MUTANTS`` are the reference with one defect; ``MAKEFX_MUTANTS`` the ``makefx`` backend with
one (their properties are checked on ``makefx`` itself, which implements them differently)."""

from __future__ import annotations

import dataclasses
import hashlib
import json

from conformance.api.types import StageSplit
from conformance.backends import makefx_fingerprint, makefx_trainer
from conformance.backends.makefx import MakeFxBackend
from conformance.backends.reference import ReferenceBackend
from mutants.backends import _replaced


class NoRegions(ReferenceBackend):
    """Reports no region at all, as a region pass that only admits CUDA nodes does on CPU: every
    region rule would pass on nothing."""

    name = "mutant-no-regions"
    KILLED_BY = "REG-003"

    def regions(self, gm):
        return []


class RunnerRunsTheJointGraph(MakeFxBackend):
    """Its split runner runs the unsplit step instead of the three graphs it returned."""

    name = "mutant-runner-runs-the-joint-graph"
    KILLED_BY = "BND-001"

    def split_stage(self, gm, *, strict=True):
        split = super().split_stage(gm, strict=strict)
        return StageSplit(split.forward, split.backward_input, split.backward_weight, run=gm)


class JobConfigIgnored(MakeFxBackend):
    """Its artifact key leaves out the job configuration, so a bfloat16-autocast job would load an
    artifact built for a float32 one."""

    name = "mutant-job-config-ignored"
    KILLED_BY = "FPR-006"

    def fingerprint(self, model, *, strict=True, config=None):
        return super().fingerprint(model, strict=strict)


class WholeStepIgnoresRecipe(MakeFxBackend):
    """Its whole-step key describes each quantized module by kind and ``emulate`` only: a step
    traced for rowwise scaling loads for a tensorwise job. Whatever else a key covers, it must
    cover every quantization input."""

    name = "mutant-whole-step-ignores-recipe"
    KILLED_BY = "FPR-001"

    def fingerprint(self, model, *, strict=True, config=None):
        describe = makefx_fingerprint.module_recipes

        def without_recipe(m):
            return {fqn: {k: v for k, v in entry.items() if k != "recipe"} for fqn, entry in describe(m).items()}

        with _replaced(makefx_fingerprint, "module_recipes", without_recipe):
            return super().fingerprint(model, strict=strict, config=config)


class WholeStepUsesPythonHash(MakeFxBackend):
    """Folds its whole-step key through Python's ``hash()``: equal in one process, another in a
    process with another ``PYTHONHASHSEED``."""

    name = "mutant-whole-step-uses-python-hash"
    KILLED_BY = "FPR-002"

    def fingerprint(self, model, *, strict=True, config=None):
        return format(hash(super().fingerprint(model, strict=strict, config=config)) & (2**64 - 1), "016x")


class WholeStepKeysTrainingFlag(MakeFxBackend):
    """Its whole-step key covers the model's ``training`` flag: ``eval()`` recompiles, though a
    whole step's structure does not change with it."""

    name = "mutant-whole-step-keys-training-flag"
    KILLED_BY = "FPR-003"

    def fingerprint(self, model, *, strict=True, config=None):
        key = super().fingerprint(model, strict=strict, config=config)
        return hashlib.sha256(f"{key}:training={model.training}".encode()).hexdigest()


class WholeStepClaimedAsQuantization(MakeFxBackend):
    """Declares its whole-step key a digest of the quantization signature alone
    (``fingerprint_scope = "quantization"``), while the key covers the whole job configuration
    and the signature none of it."""

    name = "mutant-whole-step-claimed-as-quantization"
    KILLED_BY = "FPR-006"
    fingerprint_scope = "quantization"


class WholeStepStrictInEveryModule(MakeFxBackend):
    """Writes the ``strict`` flag into every module's signature entry: a global change reads as
    a change of every module."""

    name = "mutant-whole-step-strict-in-every-module"
    KILLED_BY = "FPR-005"

    def quantization_signature(self, model, *, strict=True, config=None):
        document = json.loads(super().quantization_signature(model, strict=strict, config=config))
        for entry in document["modules"].values():
            entry["strict"] = strict
        return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def _leaves(value, prefix=""):
    """A config dataclass flattened to ``{dotted path: value}``."""
    if dataclasses.is_dataclass(value):
        found = {}
        for field in dataclasses.fields(value):
            found.update(_leaves(getattr(value, field.name), f"{prefix}{field.name}."))
        return found
    return {prefix.rstrip("."): value}


def _nearest_recipe(model):
    """``module_recipes`` that names each module's config after the named recipe it differs from
    in the fewest fields, instead of refusing a config that is none of them."""
    from torchao.float8.config import Float8LinearConfig, Float8LinearRecipeName

    found = {}
    for fqn, info in makefx_trainer.quantized_modules(model).items():
        own = _leaves(model.get_submodule(fqn).config)

        def distance(name, _own=own):
            named = _leaves(dataclasses.replace(Float8LinearConfig.from_recipe_name(name), emulate=_own["emulate"]))
            return sum(named[k] != v for k, v in _own.items())

        recipe = min((r.value for r in Float8LinearRecipeName), key=distance)
        found[fqn] = {"kind": info.kind, "recipe": recipe, "emulate": info.emulate}
    return found


class InexpressibleFieldsIgnored(MakeFxBackend):
    """Declares that its jobs express no config field (``expressible_config_fields =
    frozenset()``), then keys a model whose fields were set by hand as the named recipe nearest
    to it rather than refusing it: a job built from that recipe loads its artifact."""

    name = "mutant-inexpressible-fields-ignored"
    KILLED_BY = "FPR-001"

    def fingerprint(self, model, *, strict=True, config=None):
        with _replaced(makefx_fingerprint, "module_recipes", _nearest_recipe):
            return super().fingerprint(model, strict=strict, config=config)

    def quantization_signature(self, model, *, strict=True, config=None):
        with _replaced(makefx_fingerprint, "module_recipes", _nearest_recipe):
            return super().quantization_signature(model, strict=strict, config=config)


MUTANTS = [NoRegions]
MAKEFX_MUTANTS = [RunnerRunsTheJointGraph, JobConfigIgnored]
MAKEFX_MUTANTS += [
    WholeStepIgnoresRecipe,
    WholeStepUsesPythonHash,
    WholeStepKeysTrainingFlag,
    WholeStepClaimedAsQuantization,
    WholeStepStrictInEveryModule,
    InexpressibleFieldsIgnored,
]
