"""A trainer's own FP8 linear through every fp8conf pass, strictly.

Run it from the repository root: ``python docs/examples/own_module_walkthrough.py``. The module,
:class:`trainer_float8.TrainerFloat8Linear`, is written without fp8conf; it is declared here,
from outside, through the quantized-module protocol. ``tests/test_own_modules.py`` runs
:func:`walk` for both recipes, float32 and bfloat16, the shared projection called once and twice.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fp8conf  # noqa: E402
import trainer_float8  # noqa: E402


# 1. Declare the module: fp8conf imports nothing of the trainer; the class is named by its path.
def describe(module: trainer_float8.TrainerFloat8Linear) -> fp8conf.QuantizationConfig:
    return fp8conf.QuantizationConfig(
        kind="trainer_float8_linear",
        recipe=module.recipe,
        emulate=module.emulate,
        # rowwise_with_gw_hp computes the weight gradient in high precision.
        fp8_grad_weight=module.recipe == "rowwise",
    )


fp8conf.register_quantized_module("trainer_float8.TrainerFloat8Linear", describe)


class Block(nn.Module):
    """A SwiGLU block and a projection that ``calls`` uses per step (2: a shared projection)."""

    def __init__(self, dim: int = 32, hidden: int = 64, calls: int = 1):
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.calls = calls

    def forward(self, x):
        x = x + self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))
        for _ in range(self.calls):
            x = self.proj(x)
        return x


def build(recipe: str = "rowwise", dtype=torch.float32, calls: int = 1, emulate: bool = False, seed: int = 0):
    """The block in ``dtype`` with every linear the trainer's FP8 linear; ``(model, args)``."""
    torch.manual_seed(seed)
    model = trainer_float8.convert(Block(calls=calls).to(dtype), recipe=recipe, emulate=emulate)
    return model, (torch.randn(32, 32, dtype=dtype, requires_grad=True),)


def walk(recipe: str = "rowwise", dtype=torch.float32, calls: int = 1, compile_modes=("regional", "full")) -> dict:
    """Every pass, strict; returns what each produced."""
    model, args = build(recipe, dtype, calls)
    gm = fp8conf.trace_joint(model, args)                                  # 2. trace, with provenance
    report = fp8conf.validate_fp8_graph(gm, strict=True)                   # 3. validate
    regions = fp8conf.identify_fp8_regions(gm)                             # 4. regions
    grad_outputs = (torch.randn(32, 32, dtype=dtype),)
    eager = fp8conf.run_joint(gm, model, args, grad_outputs)
    compiled = {}
    for mode in compile_modes:                                             # 5. compile
        joint = fp8conf.compile_joint(gm, mode=mode, strict=True)
        compiled[mode] = (joint, fp8conf.run_joint(gm, model, args, grad_outputs, fn=joint.fn))
    split = fp8conf.split_stage(gm, strict=True)                           # 6. GraphPP split
    split_run = fp8conf.run_joint(gm, model, args, grad_outputs, fn=split.run)
    signature = fp8conf.QuantizationSignature.from_model(model, strict=True)  # 7. fingerprint
    return {"gm": gm, "report": report, "regions": regions, "eager": eager, "compiled": compiled,
            "split": split, "split_run": split_run, "signature": signature}


if __name__ == "__main__":
    for recipe in trainer_float8.RECIPES:
        result = walk(recipe, calls=2)
        print(result["report"].summary)
        print(f"  {len(result['regions'])} regions, all complete: {all(r.complete for r in result['regions'])}")
        print(f"  {result['signature'].summary()}")
