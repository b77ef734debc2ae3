"""A graph trainer's own FP8 kernel: the weight-gradient accumulation as one scaled add-matmul.

This file imports torch only, like the trainer's modules. ``trainer_example::scaled_addmm(acc, a,
b, scale_a, scale_b)`` is ``acc + (a @ b)`` for FP8 ``a`` (M, K) and ``b`` (K, N) with the
first scaled-matmul API's tensorwise or rowwise scales, in ``acc``'s dtype: the form a pass
fuses a weight gradient into when a weight is used twice in a step and its two gradients are
summed. The joint graph is functional, so the op returns the sum; a kernel writes it into the
accumulator in place.
"""

from __future__ import annotations

import torch

__all__ = ["scaled_addmm"]


@torch.library.custom_op("trainer_example::scaled_addmm", mutates_args=())
def scaled_addmm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor) -> torch.Tensor:
    return acc + torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=acc.dtype)


@scaled_addmm.register_fake
def _(acc, a, b, scale_a, scale_b):
    return torch.empty_like(acc)
