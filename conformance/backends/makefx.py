"""The ``makefx`` backend: a make_fx-based trainer's FP8 passes behind the conformance adapter.

The worked example of an adapter for a trainer that does not use AOT export
(:mod:`conformance.backends.makefx_trainer`, :mod:`conformance.backends.makefx_stages`,
:mod:`conformance.backends.makefx_fingerprint`). The adapter only translates: provenance without
a recipe (``provenance_has_recipe = False``), the trainer's plain ``RuntimeError``\\ s into the
contract's exceptions, its split into a :class:`~conformance.api.types.StageSplit` with a
runner, its job configuration into :class:`~conformance.api.types.JobConfigs` for the suite to
vary, and what its fingerprint is: the trainer's whole-step artifact key
(``fingerprint_scope = "whole_step"``), over configs its jobs build from recipe names only
(``expressible_config_fields = frozenset()``; another config is refused with
:class:`~conformance.api.errors.UnsupportedConfig`). Its float8 linears are its own
(``float8_modules``, :class:`~conformance.backends.makefx_linear.Float8TrainerLinear`), as are its
linears on ``F.scaled_mm``, its NVFP4 linears (``nvfp4``) and its MX linears on ``F.scaled_mm``
with swizzled e8m0 scales (``mx``, ``mx_recipes = {"mxfp8_swizzled"}``). Its post-trace pass
(``rewrites``, :mod:`conformance.backends.makefx_rewrite`) merges the step's repeated
subexpressions and removes dead code, as a trainer does after ``make_fx``.
"""

from __future__ import annotations

import dataclasses

from conformance.api.backend import Backend
from conformance.api.errors import SplitFailure, UnsupportedConfig, ValidationFailure
from conformance.api.types import Finding, JobConfigs, Provenance, Region, StageSplit, ValidationReport

__all__ = ["MakeFxBackend"]

#: What each kind of the trainer's findings is, in the spec.
_PROPERTY_OF = {"missing": "VAL-002", "count": "VAL-007", "unattributed": "VAL-003"}


def _has_scaled_mm() -> bool:
    import torch

    return hasattr(torch.nn.functional, "scaled_mm")


def _has_nvfp4() -> bool:
    import torch

    return _has_scaled_mm() and hasattr(torch, "float4_e2m1fn_x2")


class MakeFxBackend(Backend):
    name = "makefx"
    version = "0.1"
    #: ``scaled_mm_v2`` and ``float8_modules``: the trainer's own linears on F.scaled_mm (torch
    #: 2.12 and newer), its float8 linears among them. ``rewrites``: its post-trace pass,
    #: common-subexpression and dead-code elimination.
    capabilities = frozenset({"provenance", "validation", "emulation", "regions", "graphpp", "fingerprint", "rewrites"}) | (
        {"scaled_mm_v2", "float8_modules"} if _has_scaled_mm() else set()
    ) | ({"nvfp4"} if _has_nvfp4() else set()) | ({"mx"} if _has_scaled_mm() else set())
    float8_recipes = frozenset({"tensorwise", "rowwise", "rowwise_with_gw_hp"})
    #: Its own MX linears run on F.scaled_mm with swizzled e8m0 scales only.
    mx_recipes = frozenset({"mxfp8_swizzled"})
    float8_emulation = True
    provenance_has_recipe = False
    #: The fingerprint is the trainer's artifact key: it covers the parameters' and buffers'
    #: names, shapes and registration order and the whole job configuration, and the signature
    #: describes the quantized modules only.
    fingerprint_scope = "whole_step"
    #: Jobs name a recipe per module: no Float8LinearConfig field can be set on its own.
    expressible_config_fields = frozenset()

    def __init__(self, config=None):
        from conformance.backends.makefx_trainer import TrainerConfig

        self.config = config or TrainerConfig()

    def trace_joint(self, model, args):
        from conformance.backends.makefx_trainer import trace_train_step

        return trace_train_step(model, args, self.config)

    def run_joint(self, gm, model, args, grad_outputs, *, fn=None):
        from conformance.backends.makefx_trainer import run_train_step

        return run_train_step(gm, model, args, grad_outputs, fn=fn)

    def rewrite(self, gm):
        from conformance.backends.makefx_rewrite import eliminate_common_subexpressions

        return eliminate_common_subexpressions(gm)

    def provenance(self, node):
        from conformance.backends.makefx_trainer import module_provenance

        found = module_provenance(node)
        return None if found is None else Provenance(found[0], found[1], None, found[2])

    def is_backward(self, node):
        from conformance.backends.makefx_trainer import phase_of

        return phase_of(node) == "backward"

    def validate(self, gm, *, strict):
        from conformance.backends.makefx_trainer import check_fp8_graph

        try:
            report = check_fp8_graph(gm, strict=strict)
        except RuntimeError as exc:
            # The trainer names module, kind and pass in its message; the contract accepts that.
            raise ValidationFailure(str(exc)) from exc
        return ValidationReport(
            findings=tuple(Finding(_PROPERTY_OF[what], message, fqn, phase, node) for what, fqn, phase, node, message in report.problems),
            compute_counts=dict(report.counts),
            summary=report.summary,
        )

    def regions(self, gm):
        from conformance.backends.makefx_stages import fp8_regions

        return [Region(r.id, r.nodes, r.complete, r.complete) for r in fp8_regions(gm)]

    def split_stage(self, gm, *, strict=True):
        from conformance.backends.makefx_stages import split_train_step

        try:
            runner = split_train_step(gm, strict=strict)
        except RuntimeError as exc:
            if str(exc).startswith("FP8 check failed"):
                raise ValidationFailure(str(exc)) from exc
            raise SplitFailure(str(exc)) from exc
        return StageSplit(runner.forward, runner.backward_input, runner.backward_weight, run=runner.run)

    def quantization_signature(self, model, *, strict=True, config=None):
        # Per module only: strict, the versions and the job are the key's business.
        from conformance.backends.makefx_fingerprint import UnnamedConfigError, train_step_signature

        try:
            return train_step_signature(model)
        except UnnamedConfigError as exc:
            raise UnsupportedConfig(str(exc)) from exc

    def fingerprint(self, model, *, strict=True, config=None):
        from conformance.backends.makefx_fingerprint import UnnamedConfigError, step_key

        try:
            return step_key(model, strict=strict, config=config or self.config)
        except UnnamedConfigError as exc:
            raise UnsupportedConfig(str(exc)) from exc

    def convert_scaled_mm(self, model, *, module_filter_fn, recipe):
        from conformance.backends.makefx_linear import convert_linears

        convert_linears(model, module_filter_fn=module_filter_fn, recipe=recipe)

    def convert_nvfp4(self, model, *, module_filter_fn, recipe):
        from conformance.backends.makefx_linear import convert_nvfp4

        convert_nvfp4(model, module_filter_fn=module_filter_fn, recipe=recipe)

    def convert_mx(self, model, *, module_filter_fn, recipe):
        from conformance.backends.makefx_linear import convert_mx

        convert_mx(model, module_filter_fn=module_filter_fn, recipe=recipe)

    def convert_float8(self, model, *, module_filter_fn, recipe, emulate):
        from conformance.backends.makefx_linear import convert_float8

        convert_float8(model, module_filter_fn=module_filter_fn, recipe=recipe, emulate=emulate)

    def job_configs(self):
        base = self.config
        return JobConfigs(
            base=base,
            relevant={"autocast_dtype=bfloat16": dataclasses.replace(base, autocast_dtype="bfloat16")},
            unrelated={
                "job_name=other": dataclasses.replace(base, job_name="other"),
                "dump_folder=/tmp/makefx-dump": dataclasses.replace(base, dump_folder="/tmp/makefx-dump"),
            },
        )
