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

__all__ = ["MUTANTS", "SilentHighPrecisionLinear"]


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
        for module in model.modules():
            if type(module) is trainer_float8.TrainerFloat8Linear and module.recipe == "rowwise_with_gw_hp":
                module.__class__ = _HighPrecisionGwHp


MUTANTS = [SilentHighPrecisionLinear]
