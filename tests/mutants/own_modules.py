"""Mutant backends that own their float8 linears (capability ``float8_modules``).

Each is the worked example backend (``docs/examples/trainer_backend.py``: the trainer's own
rowwise-only float8 linear behind fp8conf's passes) with one defect in its own module, the kind
a trainer's quantization code ships by accident. Only the suite building every float8 layer
through ``convert_float8`` shows such a defect: TorchAO's modules do not have it.
"""

from __future__ import annotations

import torch
import trainer_backend  # docs/examples, on sys.path for fp8conf's tests (tests/conftest.py, tests/suite_runs.py)
import trainer_float8

from conformance.api.types import ComputeOp, Provenance
from conformance.backends.reference import ReferenceBackend

__all__ = [
    "MUTANTS", "DeclaredKernelOnHighPrecision", "EmulatesWithoutSaying", "HighPrecisionResultKept", "InverseScaleForgotten",
    "SecondApiUndeclared", "SilentHighPrecisionLinear",
]


def _reclass(model, cls, when=lambda module: True) -> None:
    """Give the trainer's float8 linears of ``model`` that ``when`` accepts the defect of ``cls``."""
    for module in model.modules():
        if type(module) is trainer_float8.TrainerFloat8Linear and when(module):
            module.__class__ = cls


class _HighPrecisionGwHp(trainer_float8.TrainerFloat8Linear):
    """The trainer's linear whose ``rowwise_with_gw_hp`` forward takes a fast path that forgot to
    quantize: a plain high-precision matmul, while the module still declares FP8 compute."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recipe == "rowwise_with_gw_hp" and not self.emulate:
            out = x @ self.weight.t()
            return out if self.bias is None else out + self.bias.to(out.dtype)
        return super().forward(x)


class SilentHighPrecisionLinear(trainer_backend.TrainerBackend):
    """Its own float8 linear silently runs ``rowwise_with_gw_hp`` layers in high precision."""

    name = "mutant-own-linear-silently-high-precision"
    KILLED_BY = "VAL-007"

    def convert_float8(self, model, *, module_filter_fn, recipe, emulate):
        super().convert_float8(model, module_filter_fn=module_filter_fn, recipe=recipe, emulate=emulate)
        _reclass(model, _HighPrecisionGwHp, lambda m: m.recipe == "rowwise_with_gw_hp")


class _InverseScaleForgotten(trainer_float8.TrainerFloat8Linear):
    """The trainer's linear whose scaled matmuls get the quantization scale where its inverse
    belongs: every structure right, every value off by the scales' magnitude."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        original = trainer_float8.quantize_rowwise

        def wrong(t):
            data, inverse = original(t)
            return data, inverse.reciprocal()

        trainer_float8.quantize_rowwise = wrong
        try:
            return super().forward(x)
        finally:
            trainer_float8.quantize_rowwise = original


class InverseScaleForgotten(trainer_backend.TrainerBackend):
    """Its own float8 linear multiplies by the scale instead of its inverse."""

    name = "mutant-own-linear-inverse-scale-forgotten"
    KILLED_BY = "EMU-004"

    def convert_float8(self, model, *, module_filter_fn, recipe, emulate):
        super().convert_float8(model, module_filter_fn=module_filter_fn, recipe=recipe, emulate=emulate)
        _reclass(model, _InverseScaleForgotten)


class _HighPrecisionResultKept(trainer_float8.TrainerFloat8Linear):
    """The trainer's linear that issues its FP8 matmul and returns the high-precision one: the
    FP8 op stays in the graph (its result is added times zero), the numbers are high precision."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fp8 = super().forward(x)
        out = x @ self.weight.t()
        out = out if self.bias is None else out + self.bias.to(out.dtype)
        return out + 0 * fp8


class HighPrecisionResultKept(trainer_backend.TrainerBackend):
    """Its own float8 linear computes in FP8 and in high precision and returns the latter."""

    name = "mutant-own-linear-high-precision-result-kept"
    KILLED_BY = "EMU-004"

    def convert_float8(self, model, *, module_filter_fn, recipe, emulate):
        super().convert_float8(model, module_filter_fn=module_filter_fn, recipe=recipe, emulate=emulate)
        _reclass(model, _HighPrecisionResultKept, lambda m: not m.emulate)


class EmulatesWithoutSaying(ReferenceBackend):
    """Builds TorchAO's float8 linears itself and converts every one emulated, as a trainer does
    when it finds no FP8 kernel, without saying so: its provenance still reports them real."""

    name = "mutant-float8-emulated-without-saying"
    KILLED_BY = "EMU-004"
    capabilities = ReferenceBackend.capabilities | {"float8_modules"}

    def convert_float8(self, model, *, module_filter_fn, recipe, emulate):
        import dataclasses

        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
        convert_to_float8_training(model, config=config, module_filter_fn=module_filter_fn)

    def provenance(self, node):
        found = super().provenance(node)
        return None if found is None else Provenance(found.module_fqn, found.kind, found.recipe, False)


def _dequantized_mm_op():
    """``fp8conf_mutants::dequantized_mm(a, b, a_scale, b_scale)``: ``(a * a_scale) @ (b * b_scale).T``
    in float32, a trainer's own matmul kernel, defined once per process."""
    try:
        return torch.ops.fp8conf_mutants.dequantized_mm.default
    except (AttributeError, RuntimeError):
        pass

    @torch.library.custom_op("fp8conf_mutants::dequantized_mm", mutates_args=())
    def dequantized_mm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
        return (a.to(torch.float32) * a_scale) @ (b.to(torch.float32) * b_scale).t()

    @dequantized_mm.register_fake
    def _(a, b, a_scale, b_scale):
        return a.new_empty((a.shape[0], b.shape[0]), dtype=torch.float32)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def backward(ctx, grad):
        a, b, a_scale, b_scale = ctx.saved_tensors
        a_hp, b_hp = a.to(torch.float32) * a_scale, b.to(torch.float32) * b_scale
        grad_a = (grad @ b_hp * a_scale).to(a.dtype) if a.dtype.is_floating_point else None
        grad_b = (grad.t() @ a_hp * b_scale).to(b.dtype) if b.dtype.is_floating_point else None
        return grad_a, grad_b, None, None

    dequantized_mm.register_autograd(backward, setup_context=setup_context)

    return torch.ops.fp8conf_mutants.dequantized_mm.default


class _DeclaredKernelOnHighPrecision(trainer_float8.TrainerFloat8Linear):
    """The trainer's linear whose forward runs the trainer's own kernel, declared FP8 compute, on
    the dequantized operands: the declared op computes in high precision."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.emulate:
            return super().forward(x)
        flat = x.reshape(-1, x.shape[-1])
        x_data, x_inv = trainer_float8.quantize_rowwise(flat)
        w_data, w_inv = trainer_float8.quantize_rowwise(self.weight)
        ones = torch.ones((), device=x.device)
        out = _dequantized_mm_op()(x_data.to(x.dtype) * x_inv, w_data.to(x.dtype) * w_inv, ones, ones).to(x.dtype)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias.to(out.dtype)


class DeclaredKernelOnHighPrecision(trainer_backend.TrainerBackend):
    """Declares its own matmul kernel FP8 compute, and calls it on high-precision operands."""

    name = "mutant-own-kernel-declared-fp8-on-high-precision"
    KILLED_BY = "VAL-008"

    def fp8_compute_ops(self):
        return super().fp8_compute_ops() + (ComputeOp(_dequantized_mm_op(), (0, 1), (2, 3)),)

    def convert_float8(self, model, *, module_filter_fn, recipe, emulate):
        super().convert_float8(model, module_filter_fn=module_filter_fn, recipe=recipe, emulate=emulate)
        _reclass(model, _DeclaredKernelOnHighPrecision)


class SecondApiUndeclared(ReferenceBackend):
    """Declares torch's first scaled-matmul API only, while its graphs call the second: a
    trainer that moved to ``F.scaled_mm`` and kept its passes' op list."""

    name = "mutant-second-scaled-mm-api-undeclared"
    KILLED_BY = "VAL-008"

    def fp8_compute_ops(self):
        return tuple(op for op in super().fp8_compute_ops() if "_v2" not in op.name)


MUTANTS = [
    SilentHighPrecisionLinear, InverseScaleForgotten, HighPrecisionResultKept, EmulatesWithoutSaying,
    DeclaredKernelOnHighPrecision, SecondApiUndeclared,
]
