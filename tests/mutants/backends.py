"""Mutant backends for PROV, VAL and EMU.

Each mutant is :class:`ReferenceBackend` with exactly one defect, the kind a real graph
trainer ships by accident. ``KILLED_BY`` names the property (and so the test) that must fail
for it; ``tests/test_mutants.py`` runs the suite against every mutant and checks that.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref

import fp8conf
import fp8conf.graph.provenance
import fp8conf.graph.trace
import fp8conf.graph.validate
from conformance.backends.reference import ReferenceBackend
from conformance.api.types import Provenance

aten_scaled = ("aten._scaled_mm.default", "aten._scaled_mm_v2.default")


@contextlib.contextmanager
def _replaced(owner, name, value):
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


class NoBackwardProvenance(ReferenceBackend):
    """Relies on the torch version to carry provenance to backward nodes, so none arrives."""

    name = "mutant-no-backward-provenance"
    KILLED_BY = "PROV-001"

    def trace_joint(self, model, args):
        gm = super().trace_joint(model, args)
        for node in gm.graph.nodes:
            if self.is_backward(node):
                node.meta.pop(fp8conf.PROVENANCE_META_KEY, None)
        return gm


class RecipeAlwaysTensorwise(ReferenceBackend):
    """Reports every Float8Linear as the default tensorwise recipe."""

    name = "mutant-recipe-always-tensorwise"
    KILLED_BY = "PROV-002"

    def provenance(self, node):
        found = super().provenance(node)
        return None if found is None else Provenance(found.module_fqn, found.kind, "tensorwise", found.emulate)


class RecipeUndeclaredAndWrong(ReferenceBackend):
    """Declares that its provenance records no recipe, then names every Float8Linear's recipe
    tensorwise anyway: a recipe a reader of its provenance takes at its word."""

    name = "mutant-recipe-undeclared-and-wrong"
    KILLED_BY = "PROV-002"
    provenance_has_recipe = False

    def provenance(self, node):
        found = super().provenance(node)
        return None if found is None else Provenance(found.module_fqn, found.kind, "tensorwise", found.emulate)


class AccumulationCredited(ReferenceBackend):
    """Gives gradient-accumulation nodes the provenance of the backward node feeding them."""

    name = "mutant-accumulation-credited"
    KILLED_BY = "PROV-003"

    def trace_joint(self, model, args):
        gm = super().trace_joint(model, args)
        for node in gm.graph.nodes:
            if self.is_backward(node) and fp8conf.get_provenance(node) is None:
                inherited = [fp8conf.get_provenance(i) for i in node.all_input_nodes if fp8conf.get_provenance(i)]
                if inherited:
                    node.meta[fp8conf.PROVENANCE_META_KEY] = inherited[0]
        return gm


class BackwardStartsLate(ReferenceBackend):
    """Finds the start of the backward pass at its first FP8 matmul, as a pass split that looks
    for a quantized module's gradient would: the ops before it (the gradient of the output, the
    cast of that gradient to FP8) are called forward."""

    name = "mutant-backward-starts-late"
    KILLED_BY = "PROV-003"

    def is_backward(self, node):
        if not super().is_backward(node):
            return False
        late = self._called_forward.get(node.graph)
        if late is None:
            late = self._called_forward[node.graph] = self._before_first_backward_matmul(node.graph)
        return node not in late

    @functools.cached_property
    def _called_forward(self):
        return weakref.WeakKeyDictionary()

    def _before_first_backward_matmul(self, graph) -> set:
        before = set()
        for node in graph.nodes:
            if super().is_backward(node):
                if node.op == "call_function" and _is_fp8_matmul(node):
                    return before
                before.add(node)
        return set()  # no FP8 matmul in the backward: nothing called forward


def _is_fp8_matmul(node) -> bool:
    from conformance.observe.graphs import Fp8Ops, is_fp8_compute

    return is_fp8_compute(node, Fp8Ops())


class ProvenanceLeaksForward(ReferenceBackend):
    """Stamps a module's annotation onto the op that consumes its output (an activation, a residual add)."""

    name = "mutant-provenance-leaks-forward"
    KILLED_BY = "PROV-004"

    def trace_joint(self, model, args):
        gm = super().trace_joint(model, args)
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and not self.is_backward(node) and fp8conf.get_provenance(node) is None:
                inherited = [fp8conf.get_provenance(i) for i in node.all_input_nodes if fp8conf.get_provenance(i)]
                if inherited:
                    node.meta[fp8conf.PROVENANCE_META_KEY] = inherited[0]
        return gm


class OuterModuleCredited(ReferenceBackend):
    """Attributes nodes of a nested quantized module to the outermost quantized module."""

    name = "mutant-outer-module-credited"
    KILLED_BY = "PROV-006"

    def provenance(self, node):
        found = super().provenance(node)
        if found is None:
            return None
        modules = fp8conf.trace_info(node.graph.owning_module).modules
        outer = next((fqn for fqn in modules if found.module_fqn.startswith(fqn + ".")), found.module_fqn)
        return Provenance(outer, found.kind, found.recipe, found.emulate)


def _always_needs_input_grad(config, call):
    return {"forward": 1, "backward": int(config.fp8_grad_input) + int(config.fp8_grad_weight and call.weight_requires_grad)}


class IgnoresInputGrad(ReferenceBackend):
    """Expects a grad_input matmul even when the input needs no gradient: false alarms."""

    name = "mutant-ignores-input-grad"
    KILLED_BY = "VAL-001"

    def validate(self, gm, *, strict):
        with _replaced(fp8conf.graph.validate, "_expected", _always_needs_input_grad):
            return super().validate(gm, strict=strict)


class NoLoweringCheck(ReferenceBackend):
    """Checks provenance only, never that a non-emulated module kept its FP8 compute."""

    name = "mutant-no-lowering-check"
    KILLED_BY = "VAL-002"

    def validate(self, gm, *, strict):
        with _replaced(fp8conf.graph.validate, "_check_calls", lambda *a: []):
            return super().validate(gm, strict=strict)


class MissingProvenancePasses(ReferenceBackend):
    """Skips FP8 compute that has no provenance instead of failing: a silent fallback."""

    name = "mutant-missing-provenance-passes"
    KILLED_BY = "VAL-003"

    def validate(self, gm, *, strict):
        with _replaced(fp8conf.graph.validate, "unattributed_fp8_compute", lambda graph, passes=None, provenance_of=None: []):
            return super().validate(gm, strict=strict)


def _any_fp8_operand(node):
    if node.op != "call_function" or str(node.target) not in aten_scaled:
        return False
    return any(fp8conf.graph.roles.is_fp8_dtype(getattr(a.meta.get("val"), "dtype", None)) for a in node.all_input_nodes)


class AnyFP8OperandCounts(ReferenceBackend):
    """Counts a scaled matmul as FP8 compute when any one of its inputs is FP8."""

    name = "mutant-any-fp8-operand-counts"
    KILLED_BY = "VAL-004"

    def validate(self, gm, *, strict):
        with _replaced(fp8conf.graph.validate, "is_fp8_compute", _any_fp8_operand):
            return super().validate(gm, strict=strict)


class ValidationWritesMeta(ReferenceBackend):
    """Marks every node it checked in ``node.meta``."""

    name = "mutant-validation-writes-meta"
    KILLED_BY = "VAL-005"

    def validate(self, gm, *, strict):
        for node in gm.graph.nodes:
            node.meta["fp8_checked"] = True
        return super().validate(gm, strict=strict)


class ExistenceOnlyCounts(ReferenceBackend):
    """Checks that FP8 compute exists, not that the recipe's count is met (a duplicate passes)."""

    name = "mutant-existence-only-counts"
    KILLED_BY = "VAL-007"

    def validate(self, gm, *, strict):
        check_calls = fp8conf.graph.validate._check_calls

        def existence_only(*args):
            return [f for f in check_calls(*args) if f.property_id != "VAL-007"]

        with _replaced(fp8conf.graph.validate, "_check_calls", existence_only):
            return super().validate(gm, strict=strict)


def _what_outputs_need(gm):
    """A copy of ``gm`` without the nodes no output needs: what a trainer whose validation
    ignores dead code judges (rightly: such code computes nothing the step returns)."""
    from conformance.observe.graphs import copy_graph_module, output_dependencies

    needed_only = copy_graph_module(gm)
    needed = output_dependencies(needed_only)
    for node in reversed(list(needed_only.graph.nodes)):
        if node.op == "call_function" and node not in needed:
            needed_only.graph.erase_node(node)
    needed_only.recompile()
    return needed_only


class _LeavesDeadCopies(ReferenceBackend):
    """Its post-trace pass rebuilds FP8 matmuls (as a fusion does) and leaves each original in the
    graph, read by nothing, or only by an in-place op; its validation judges what the outputs
    need, so every count and check stays right while the graph's code runs those matmuls twice."""

    in_place = False

    def rewrite(self, gm):
        import torch

        gm = super().rewrite(gm)
        graph = gm.graph
        for node in [n for n in graph.nodes if fp8conf.graph.roles.is_fp8_compute(n)]:
            if self.in_place and not self.is_backward(node):
                continue
            with graph.inserting_after(node):
                rebuilt = graph.node_copy(node)
            node.replace_all_uses_with(rebuilt)
            if self.in_place:
                # The original's result scaled in place, as TorchAO scales a rowwise matmul's:
                # torch's dead-code elimination keeps both.
                with graph.inserting_after(rebuilt):
                    scaled = graph.call_function(torch.ops.aten.mul_.Scalar, (node, 1.0))
                scaled.meta.update(node.meta)  # the same tensor, in the same pass
        gm.recompile()
        return gm

    def validate(self, gm, *, strict):
        return super().validate(_what_outputs_need(gm), strict=strict)


class DeadCopiesLeftByRewrite(_LeavesDeadCopies):
    """Leaves a copy of every FP8 matmul that nothing reads."""

    name = "mutant-dead-copies-left-by-rewrite"
    KILLED_BY = "VAL-007"


class DeadCopiesKeptInPlace(_LeavesDeadCopies):
    """Leaves a copy of every backward FP8 matmul that only an in-place op reads: kept for a
    side effect as a grad_input nobody needs may be, but a copy of a needed matmul is never that."""

    name = "mutant-dead-copies-kept-in-place"
    KILLED_BY = "VAL-007"
    in_place = True


class ConstantSummary(ReferenceBackend):
    """Gives every report the same summary line, whatever validation found."""

    name = "mutant-constant-summary"
    KILLED_BY = "VAL-006"

    def validate(self, gm, *, strict):
        report = super().validate(gm, strict=strict)
        return dataclasses.replace(report, summary="FP8 validation finished; see the findings for details")


class EmulatedNotExempt(ReferenceBackend):
    """Requires FP8 compute from emulated modules too."""

    name = "mutant-emulated-not-exempt"
    KILLED_BY = "EMU-001"

    def trace_joint(self, model, args):
        gm = super().trace_joint(model, args)
        info = fp8conf.trace_info(gm)
        modules = {fqn: dataclasses.replace(c, emulate=False) for fqn, c in info.modules.items()}
        gm.meta[fp8conf.graph.trace.TRACE_META_KEY] = dataclasses.replace(info, modules=modules)
        return gm


class OneEmulatedExemptsAll(ReferenceBackend):
    """Skips the FP8 compute checks of the whole graph once any module is emulated."""

    name = "mutant-one-emulated-exempts-all"
    KILLED_BY = "EMU-002"

    def validate(self, gm, *, strict):
        if any(c.emulate for c in fp8conf.trace_info(gm).modules.values()):
            with _replaced(fp8conf.graph.validate, "_check_calls", lambda *a: []):
                return super().validate(gm, strict=strict)
        return super().validate(gm, strict=strict)


def _inheriting_children(find):
    # A child linear of a quantized module is taken for part of it: it gets the parent's config,
    # whatever its own (or, a plain nn.Linear, no config at all).
    import torch

    def find_quantized_modules(model):
        found = find(model)
        for fqn, config in list(found.items()):
            for name, child in model.get_submodule(fqn).named_modules():
                if name and isinstance(child, torch.nn.Linear):
                    found[f"{fqn}.{name}"] = config
        return found

    return find_quantized_modules


class NestedInheritsParentConfig(ReferenceBackend):
    """Gives every linear nested in a quantized module its parent's config: a plain adapter
    inside a Float8Linear is expected to compute in FP8, an own-config adapter is misdescribed."""

    name = "mutant-nested-inherits-parent-config"
    KILLED_BY = "VAL-001"

    def trace_joint(self, model, args):
        with _replaced(fp8conf.graph.trace, "find_quantized_modules", _inheriting_children(fp8conf.graph.trace.find_quantized_modules)):
            return super().trace_joint(model, args)


class EmulationExemptsNested(ReferenceBackend):
    """Exempts an emulated module's nested modules too, as if emulation were inherited."""

    name = "mutant-emulation-exempts-nested"
    KILLED_BY = "EMU-002"

    def validate(self, gm, *, strict):
        info = fp8conf.trace_info(gm)
        emulated = [fqn for fqn, c in info.modules.items() if c.emulate]
        modules = {
            fqn: dataclasses.replace(c, emulate=True) if any(fqn.startswith(e + ".") for e in emulated) else c
            for fqn, c in info.modules.items()
        }
        with _replaced(fp8conf.graph.validate, "trace_info", lambda _gm: dataclasses.replace(info, modules=modules)):
            return super().validate(gm, strict=strict)


MUTANTS = [
    NoBackwardProvenance,
    RecipeAlwaysTensorwise,
    RecipeUndeclaredAndWrong,
    AccumulationCredited,
    BackwardStartsLate,
    ProvenanceLeaksForward,
    OuterModuleCredited,
    IgnoresInputGrad,
    NoLoweringCheck,
    MissingProvenancePasses,
    AnyFP8OperandCounts,
    ValidationWritesMeta,
    ExistenceOnlyCounts,
    DeadCopiesLeftByRewrite,
    DeadCopiesKeptInPlace,
    ConstantSummary,
    EmulatedNotExempt,
    OneEmulatedExemptsAll,
    NestedInheritsParentConfig,
    EmulationExemptsNested,
]


# --- FPR: fingerprint mutants --------------------------------------------------------------------


def _rewritten_signature(backend_cls, rewrite):
    """``quantization_signature`` / ``fingerprint`` methods whose JSON passes through ``rewrite``."""
    import hashlib
    import json

    def quantization_signature(self, model, *, strict=True):
        doc = json.loads(super(backend_cls, self).quantization_signature(model, strict=strict))
        rewrite(doc, model)
        return json.dumps(doc, sort_keys=True, separators=(",", ":"))

    def fingerprint(self, model, *, strict=True):
        return hashlib.sha256(self.quantization_signature(model, strict=strict).encode()).hexdigest()

    return quantization_signature, fingerprint


class FingerprintIgnoresRecipe(ReferenceBackend):
    """Fingerprints each quantized module by kind and emulate flag only, as if every recipe were one."""

    name = "mutant-fingerprint-ignores-recipe"
    KILLED_BY = "FPR-001"


def _drop_recipe(doc, model):
    doc["modules"] = {fqn: {"kind": m["kind"], "emulate": m["emulate"]} for fqn, m in doc["modules"].items()}


FingerprintIgnoresRecipe.quantization_signature, FingerprintIgnoresRecipe.fingerprint = _rewritten_signature(FingerprintIgnoresRecipe, _drop_recipe)


class FingerprintIgnoresEmulate(ReferenceBackend):
    """Leaves ``emulate`` out of the signature: an emulated artifact loads for a real FP8 model."""

    name = "mutant-fingerprint-ignores-emulate"
    KILLED_BY = "FPR-001"


def _drop_emulate(doc, model):
    for entry in doc["modules"].values():
        entry.pop("emulate", None)


FingerprintIgnoresEmulate.quantization_signature, FingerprintIgnoresEmulate.fingerprint = _rewritten_signature(FingerprintIgnoresEmulate, _drop_emulate)


class FingerprintReadsPublicVersionsOnly(ReferenceBackend):
    """Signs torch's and torchao's versions up to their public release (``2.13.0`` of
    ``2.13.0+cpu``): a local build of another commit loads the artifact of the release."""

    name = "mutant-fingerprint-reads-public-versions-only"
    KILLED_BY = "FPR-001"


def _public_versions(doc, model):
    doc["versions"] = {name: version.partition("+")[0] for name, version in doc["versions"].items()}


FingerprintReadsPublicVersionsOnly.quantization_signature, FingerprintReadsPublicVersionsOnly.fingerprint = _rewritten_signature(
    FingerprintReadsPublicVersionsOnly, _public_versions
)


class FingerprintIncludesTrainingFlag(ReferenceBackend):
    """Records each quantized module's ``training`` flag, unrelated to quantization: eval() recompiles."""

    name = "mutant-fingerprint-includes-training-flag"
    KILLED_BY = "FPR-003"


def _add_training(doc, model):
    for fqn, entry in doc["modules"].items():
        entry["training"] = model.get_submodule(fqn).training


FingerprintIncludesTrainingFlag.quantization_signature, FingerprintIncludesTrainingFlag.fingerprint = _rewritten_signature(
    FingerprintIncludesTrainingFlag, _add_training
)


class FingerprintKeyedByPosition(ReferenceBackend):
    """Keys each quantized module by its position among them, not its FQN: conversion moved to
    another layer with the same config loads the other layer's artifact."""

    name = "mutant-fingerprint-keyed-by-position"
    KILLED_BY = "FPR-001"


def _key_by_position(doc, model):
    doc["modules"] = {str(i): entry for i, (_fqn, entry) in enumerate(doc["modules"].items())}


FingerprintKeyedByPosition.quantization_signature, FingerprintKeyedByPosition.fingerprint = _rewritten_signature(
    FingerprintKeyedByPosition, _key_by_position
)


class FingerprintIgnoresForwardCasts(ReferenceBackend):
    """Records only the backward operands' cast configs: a forward target dtype or scaling
    change of a custom config goes unnoticed."""

    name = "mutant-fingerprint-ignores-forward-casts"
    KILLED_BY = "FPR-001"


def _drop_forward_casts(doc, model):
    for entry in doc["modules"].values():
        for field in ("cast_config_input", "cast_config_weight"):
            entry.get("config", {}).pop(field, None)


FingerprintIgnoresForwardCasts.quantization_signature, FingerprintIgnoresForwardCasts.fingerprint = _rewritten_signature(
    FingerprintIgnoresForwardCasts, _drop_forward_casts
)


class FingerprintIgnoresInputTargetDtype(ReferenceBackend):
    """Leaves the input operand's target dtype out of the signature (both of its casts): an
    e5m2-input config loads the e4m3 one's artifact. One field among the many a draw may flip."""

    name = "mutant-fingerprint-ignores-input-target-dtype"
    KILLED_BY = "FPR-001"


def _drop_input_target_dtype(doc, model):
    for entry in doc["modules"].values():
        for cast in ("cast_config_input", "cast_config_input_for_grad_weight"):
            entry.get("config", {}).get(cast, {}).pop("target_dtype", None)


FingerprintIgnoresInputTargetDtype.quantization_signature, FingerprintIgnoresInputTargetDtype.fingerprint = _rewritten_signature(
    FingerprintIgnoresInputTargetDtype, _drop_input_target_dtype
)


class FingerprintIgnoresMX(ReferenceBackend):
    """Fingerprints the float8 modules only, as if MX layers were not quantized."""

    name = "mutant-fingerprint-ignores-mx"
    KILLED_BY = "FPR-001"


def _drop_mx(doc, model):
    doc["modules"] = {fqn: entry for fqn, entry in doc["modules"].items() if entry.get("kind") != "mxfp8_linear"}


FingerprintIgnoresMX.quantization_signature, FingerprintIgnoresMX.fingerprint = _rewritten_signature(FingerprintIgnoresMX, _drop_mx)


class FingerprintUsesPythonHash(ReferenceBackend):
    """Digests the signature with Python's ``hash()``: stable in one process, not across PYTHONHASHSEEDs."""

    name = "mutant-fingerprint-uses-python-hash"
    KILLED_BY = "FPR-002"

    def fingerprint(self, model, *, strict=True):
        return format(hash(self.quantization_signature(model, strict=strict)) & (2**64 - 1), "016x")


class FingerprintLoadsDespiteMismatch(ReferenceBackend):
    """Warns about a fingerprint mismatch and loads the stale artifact anyway."""

    name = "mutant-fingerprint-loads-despite-mismatch"
    KILLED_BY = "FPR-004"

    def load_artifact(self, path, model, *, strict=True):
        import warnings

        try:
            return super().load_artifact(path, model, strict=strict)
        except fp8conf.FingerprintMismatchError as exc:
            warnings.warn(f"loading a stale artifact: {exc}")
            compiled = fp8conf.load_artifact(path, fp8conf.read_header(path).signature, key=self.artifact_key)
            return lambda args, grad_outputs: compiled.run(model, args, grad_outputs)


class FingerprintCoversRegistrationOrder(ReferenceBackend):
    """Declares the default scope, a digest of the quantization signature alone, yet digests the
    parameter names with it in registration order: a model registered in another order does not
    load its own artifact."""

    name = "mutant-fingerprint-covers-registration-order"
    KILLED_BY = "FPR-002"

    def fingerprint(self, model, *, strict=True):
        import hashlib
        import json

        names = [name for name, _ in model.named_parameters()]
        return hashlib.sha256((self.quantization_signature(model, strict=strict) + json.dumps(names)).encode()).hexdigest()


class FingerprintCoversBuffers(ReferenceBackend):
    """Declares the default scope yet digests the names of the model's buffers too: adding an
    unrelated buffer (a step counter, a cache) recompiles."""

    name = "mutant-fingerprint-covers-buffers"
    KILLED_BY = "FPR-003"

    def fingerprint(self, model, *, strict=True):
        import hashlib

        names = sorted(name for name, _ in model.named_buffers())
        return hashlib.sha256((self.quantization_signature(model, strict=strict) + ",".join(names)).encode()).hexdigest()


def _refuse(self, model, *args, **kwargs):
    from conformance.api.errors import UnsupportedConfig

    raise UnsupportedConfig(f"backend {self.name!r} expresses no configuration")


class RefusesEveryModel(ReferenceBackend):
    """Refuses every model as inexpressible (``UnsupportedConfig``), models converted from named
    recipes too: a refusal that would turn every FPR rule into not_supported."""

    name = "mutant-refuses-every-model"
    KILLED_BY = "FPR-001"
    fingerprint = _refuse
    quantization_signature = _refuse


class RefusesToLoad(ReferenceBackend):
    """Refuses to load any artifact as inexpressible (``UnsupportedConfig``), its own too."""

    name = "mutant-refuses-to-load"
    KILLED_BY = "FPR-004"
    load_artifact = _refuse


MUTANTS += [
    FingerprintIgnoresRecipe,
    FingerprintIgnoresEmulate,
    FingerprintKeyedByPosition,
    FingerprintIgnoresForwardCasts,
    FingerprintIgnoresMX,
    FingerprintIgnoresInputTargetDtype,
    FingerprintReadsPublicVersionsOnly,
    FingerprintIncludesTrainingFlag,
    FingerprintUsesPythonHash,
    FingerprintLoadsDespiteMismatch,
    FingerprintCoversRegistrationOrder,
    FingerprintCoversBuffers,
    RefusesEveryModel,
    RefusesToLoad,
]


def _dropping_kinds(*kinds):
    def drop(doc, model):
        doc["modules"] = {fqn: entry for fqn, entry in doc["modules"].items() if entry.get("kind") not in kinds}
    return drop


class FingerprintIgnoresScaledMM(ReferenceBackend):
    """Fingerprints TorchAO's float8 and MX modules, as if linears on ``F.scaled_mm`` and NVFP4
    linears were not quantized: a family added after the fingerprint was written."""

    name = "mutant-fingerprint-ignores-scaled-mm"
    KILLED_BY = "FPR-001"


FingerprintIgnoresScaledMM.quantization_signature, FingerprintIgnoresScaledMM.fingerprint = _rewritten_signature(
    FingerprintIgnoresScaledMM, _dropping_kinds("float8_scaled_mm_linear", "nvfp4_linear"))
MUTANTS.append(FingerprintIgnoresScaledMM)


class FingerprintIgnoresGroupedExperts(ReferenceBackend):
    """Fingerprints linears only, as if grouped experts (on either API) were not quantized: a
    fingerprint identical with and without FP8 experts, an MoE artifact loaded under any experts
    configuration."""

    name = "mutant-fingerprint-ignores-grouped-experts"
    KILLED_BY = "FPR-001"


FingerprintIgnoresGroupedExperts.quantization_signature, FingerprintIgnoresGroupedExperts.fingerprint = _rewritten_signature(
    FingerprintIgnoresGroupedExperts, _dropping_kinds("float8_grouped_experts"))
MUTANTS.append(FingerprintIgnoresGroupedExperts)
