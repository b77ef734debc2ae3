"""Backends that are correct but test how the suite treats a backend: what it shows one that
claims less, and whether what one does to its graphs in place stays with the property."""

from __future__ import annotations

from conformance.api.errors import FingerprintMismatch, SplitFailure, ValidationFailure
from conformance.backends.reference import ReferenceBackend
from fp8conf.errors import FP8GraphSplitError


class Float8Only(ReferenceBackend):
    """A backend without MX linears or linears on ``F.scaled_mm``, claiming only provenance and
    validation: shown the graph of such a layer, its ``provenance()`` and ``validate()`` refuse
    it, so any such model the suite draws for it fails a property. It traces as the reference
    does, so that fp8conf's tests share its traces (tests/shared_traces.py)."""

    name = "float8-only"
    capabilities = frozenset({"provenance", "validation"})
    _REFUSED = ("mxfp8_linear", "float8_scaled_mm_linear")

    def provenance(self, node):
        found = super().provenance(node)
        if found is not None and found.kind in self._REFUSED:
            raise TypeError(f"the float8-only backend was shown {found.kind} compute: node '{node.name}' of {found.module_fqn!r}")
        return found

    def validate(self, gm, *, strict):
        for node in gm.graph.nodes:
            self.provenance(node)
        return super().validate(gm, strict=strict)


class TagsInPlace(ReferenceBackend):
    """Keeps its own annotations in ``node.meta["custom"]`` and edits them in place, as trainers
    do: tracing records a pipeline stage on every node, and identifying regions marks, inside
    that nested dict, the nodes it looked at. Validation refuses a graph that carries the marks of
    regions() or its tags, which no graph handed to validation is supposed to have seen."""

    name = "tags-in-place"

    def trace_joint(self, model, args):
        gm = super().trace_joint(model, args)
        for node in gm.graph.nodes:
            if node.op == "call_function":
                node.meta["custom"] = {**(node.meta.get("custom") or {}), "trainer": {"stage": 0}}
        return gm

    def regions(self, gm):
        for node in gm.graph.nodes:
            custom = node.meta.get("custom")
            if custom and "trainer" in custom:
                custom["trainer"]["seen_by_regions"] = True
                custom["regions_ran"] = True
        return super().regions(gm)

    def validate(self, gm, *, strict):
        for node in gm.graph.nodes:
            custom = node.meta.get("custom") or {}
            leaked = [k for k in ("regions_ran", "compile_with_inductor") if k in custom]
            leaked += ["trainer.seen_by_regions"] if "seen_by_regions" in custom.get("trainer", {}) else []
            if leaked:
                raise RuntimeError(f"node '{node.name}' carries {leaked} from regions() of another graph")
        return super().validate(gm, strict=strict)


class ContractErrorsOnly(ReferenceBackend):
    """Raises only the contract's own exception classes, never fp8conf's subclasses of them, as a
    backend that knows nothing of fp8conf does; a stage the reference cannot cut is a
    ``SplitFailure``."""

    name = "contract-errors-only"

    def validate(self, gm, *, strict):
        try:
            return super().validate(gm, strict=strict)
        except ValidationFailure as exc:
            raise _plain(ValidationFailure, exc) from None

    def split_stage(self, gm, *, strict=True):
        try:
            return super().split_stage(gm, strict=strict)
        except FP8GraphSplitError as exc:
            raise SplitFailure(str(exc)) from None
        except ValidationFailure as exc:
            raise _plain(ValidationFailure, exc) from None

    def load_artifact(self, path, model, *, strict=True):
        try:
            return super().load_artifact(path, model, strict=strict)
        except FingerprintMismatch as exc:
            raise _plain(FingerprintMismatch, exc, "fields") from None


def _plain(cls, exc, *attributes):
    plain = cls(str(exc))
    for name in attributes or ("module_fqn", "pass_name", "node_name", "property_id"):
        setattr(plain, name, getattr(exc, name))
    return plain


class WholeStepReference(ReferenceBackend):
    """A correct whole-step backend: its fingerprint digests the reference's signature with the
    names and shapes of the parameters and buffers in registration order, and it declares
    ``fingerprint_scope = "whole_step"``, so a reversed registration order or an added buffer
    may change it."""

    name = "whole-step-reference"
    fingerprint_scope = "whole_step"

    def fingerprint(self, model, *, strict=True):
        import hashlib
        import itertools
        import json

        state = [[name, list(t.shape)] for name, t in itertools.chain(model.named_parameters(), model.named_buffers())]
        return hashlib.sha256((self.quantization_signature(model, strict=strict) + json.dumps(state)).encode()).hexdigest()


class RefusesCustomConfigs(ReferenceBackend):
    """A backend whose jobs name recipes and that does not say so (``expressible_config_fields``
    left None): shown a ``Float8LinearConfig`` that is none of the named recipes, it refuses with
    ``UnsupportedConfig``."""

    name = "refuses-custom-configs"

    def _check_expressible(self, model):
        from conformance.api.errors import UnsupportedConfig
        from conformance.backends.makefx_fingerprint import UnnamedConfigError, module_recipes

        try:
            module_recipes(model)
        except UnnamedConfigError as exc:
            raise UnsupportedConfig(str(exc)) from exc

    def quantization_signature(self, model, *, strict=True):
        self._check_expressible(model)
        return super().quantization_signature(model, strict=strict)

    def fingerprint(self, model, *, strict=True):
        self._check_expressible(model)
        return super().fingerprint(model, strict=strict)


class ExpressesPadInnerDimOnly(ReferenceBackend):
    """A backend whose jobs name a recipe per module and may set ``pad_inner_dim`` on top of it,
    and say so (``expressible_config_fields = {"pad_inner_dim"}``): a config that differs from
    every named recipe in another field is refused with ``UnsupportedConfig``."""

    name = "expresses-pad-inner-dim-only"
    expressible_config_fields = frozenset({"pad_inner_dim"})

    def _check_expressible(self, model):
        import dataclasses

        from torchao.float8.config import Float8LinearConfig, Float8LinearRecipeName
        from torchao.float8.float8_linear import Float8Linear

        from conformance.api.errors import UnsupportedConfig

        for fqn, module in model.named_modules():
            if not isinstance(module, Float8Linear):
                continue
            config = module.config
            named = [
                dataclasses.replace(Float8LinearConfig.from_recipe_name(r.value), emulate=config.emulate, pad_inner_dim=config.pad_inner_dim)
                for r in Float8LinearRecipeName
            ]
            if config not in named:
                raise UnsupportedConfig(f"module {fqn!r}: a config that no recipe with pad_inner_dim set expresses")

    def quantization_signature(self, model, *, strict=True):
        self._check_expressible(model)
        return super().quantization_signature(model, strict=strict)

    def fingerprint(self, model, *, strict=True):
        self._check_expressible(model)
        return super().fingerprint(model, strict=strict)
