"""The skeleton of a mutant's quantized linear: its three matmuls through one defective function.

A mutant module family (``tests/mutants/nvfp4.py``, ``tests/mutants/mx_swizzled.py``) writes only
``matmul(lhs, rhs_t, out_dtype, defect, which)`` (``lhs @ rhs_t.T``, ``which`` one of
``"output"``, ``"grad_input"``, ``"grad_weight"``); :func:`defective_linear` makes the autograd
function and the module around it, and :func:`swap_into` turns the modules a converter built
into it.
"""

from __future__ import annotations

import torch

__all__ = ["defective_linear", "swap_into"]


def defective_linear(base: type, matmul, *, real=lambda module: True) -> type:
    """A subclass of the linear ``base`` whose forward, where ``real(module)``, runs its three
    matmuls through ``matmul`` with the class attribute ``defect`` (else ``base``'s forward)."""

    @torch._dynamo.allow_in_graph
    class _Defective(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, defect: str):
            ctx.save_for_backward(x, weight)
            ctx.defect = defect
            return matmul(x, weight, x.dtype, defect, "output")

        @staticmethod
        def backward(ctx, grad_out):
            x, weight = ctx.saved_tensors
            grad_x = matmul(grad_out, weight.t(), x.dtype, ctx.defect, "grad_input") if ctx.needs_input_grad[0] else None
            grad_w = matmul(grad_out.t(), x.t(), weight.dtype, ctx.defect, "grad_weight") if ctx.needs_input_grad[1] else None
            return grad_x, grad_w, None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not real(self):
            return base.forward(self, input)
        out = _Defective.apply(input.reshape(-1, self.in_features), self.weight, self.defect)
        out = out.reshape(*input.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    return type(f"Defective{base.__name__}", (base,), {"defect": "", "forward": forward, "__module__": base.__module__})


def swap_into(model, base: type, cls: type) -> None:
    """Make every module of ``model`` whose class is exactly ``base`` an instance of ``cls``."""
    for module in model.modules():
        if type(module) is base:
            module.__class__ = cls
