"""Running GraphPP callables as pipeline stages over ``torch.distributed``.

:class:`PipelineStage` runs one stage's split (:mod:`fp8conf.graph.split`) per microbatch in three
steps, eagerly or with its FP8 regions compiled: ``forward``, ``backward_input`` (returns the
gradient the previous stage waits for) and ``backward_weight`` (accumulates parameter gradients
into ``.grad``). :func:`run_schedule` drives a stage through a zero-bubble-style order, every
forward, then each dI as soon as its gradient arrives with the dW of the microbatch before it
deferred behind it, moving activations and gradients with ``torch.distributed`` send/recv (gloo
on CPU, NCCL on GPUs).

``python -m fp8conf.pipeline`` runs them as a self-checking 2-process demo
(:mod:`fp8conf.tools.pipeline_check`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fp8conf.errors import FP8ConfigError
from fp8conf.graph.split import StageSplit, compile_split, split_stage
from fp8conf.graph.trace import joint_inputs, trace_joint

__all__ = ["PipelineStage", "zero_bubble_schedule", "run_schedule", "stage_modules"]


class _Sequential(torch.nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def stage_modules(model, num_stages: int) -> list[torch.nn.Module]:
    """Cut an :class:`fp8conf.tools.example_models.BlockStack` into ``num_stages`` stage modules of
    consecutive blocks (the head, if any, joins the last); parameters are shared, not copied."""
    blocks = list(model.blocks)
    if not 1 <= num_stages <= len(blocks):
        raise FP8ConfigError(f"cannot cut {len(blocks)} blocks into {num_stages} stages")
    bounds = [round(i * len(blocks) / num_stages) for i in range(num_stages + 1)]
    stages = [blocks[bounds[i] : bounds[i + 1]] for i in range(num_stages)]
    if model.head is not None:
        stages[-1].append(model.head)
    return [_Sequential(layers) for layers in stages]


class PipelineStage:
    """One pipeline stage: ``module`` traced on ``example_input`` (its microbatch shape), split,
    and optionally compiled (``compile="regional"`` or ``"full"``)."""

    def __init__(self, module: torch.nn.Module, example_input: torch.Tensor, *, first: bool, compile: str | None = None, strict: bool = True):
        self.module = module
        x = example_input.detach().clone().requires_grad_(not first)
        self.gm = trace_joint(module, (x,))
        self.split: StageSplit = split_stage(self.gm, strict=strict)
        self.fns = compile_split(self.split, mode=compile, strict=strict) if compile else {}
        self.params = dict(module.named_parameters())
        self._saved: dict[int, tuple] = {}
        self._carried: dict[int, tuple] = {}

    def forward(self, microbatch: int, x: torch.Tensor) -> torch.Tensor:
        primals, _ = joint_inputs(self.gm, self.module, (x,), (None,))
        outputs, saved = self.split.run_forward(primals, self.fns.get("forward"))
        self._saved[microbatch] = saved
        return outputs[0]

    def backward_input(self, microbatch: int, grad_output: torch.Tensor) -> torch.Tensor | None:
        grads, carried = self.split.run_backward_input(self._saved[microbatch], (grad_output,), self.fns.get("backward_input"))
        self._carried[microbatch] = carried
        return grads[0] if grads else None

    def backward_weight(self, microbatch: int) -> None:
        saved, carried = self._saved.pop(microbatch), self._carried.pop(microbatch)
        grads = self.split.run_backward_weight(saved, carried, self.fns.get("backward_weight"))
        with torch.no_grad():
            for fqn, grad in zip(self.split.param_grads, grads):
                param = self.params[fqn]
                param.grad = grad.detach().clone() if param.grad is None else param.grad.add_(grad)


def zero_bubble_schedule(num_microbatches: int) -> list[tuple[str, int]]:
    """Every forward ``F``, then each input-gradient step ``I`` with the weight-gradient step ``W``
    of the previous microbatch deferred behind it: F0..Fn-1, I0, I1, W0, I2, W1, ..., Wn-1."""
    order = [("F", mb) for mb in range(num_microbatches)]
    for mb in range(num_microbatches):
        order.append(("I", mb))
        if mb > 0:
            order.append(("W", mb - 1))
    return order + [("W", num_microbatches - 1)]


def run_schedule(stage: PipelineStage, rank: int, world: int, microbatches: Sequence[torch.Tensor] | int, loss_grad: Callable, shape, dtype, device) -> list:
    """Run ``stage`` (this process is ``rank`` of ``world`` stages) through
    :func:`zero_bubble_schedule`. Rank 0 feeds ``microbatches`` (a list of tensors; the other
    ranks pass their count); the last rank turns each output into its gradient with
    ``loss_grad(microbatch, output)``. Activations and gradients (all of ``shape``) travel with
    ``torch.distributed`` send/recv. Returns the last rank's outputs (empty elsewhere)."""
    import torch.distributed as dist

    count = microbatches if isinstance(microbatches, int) else len(microbatches)
    pending, outputs = [], {}
    for action, mb in zero_bubble_schedule(count):
        if action == "F":
            if rank == 0:
                x = microbatches[mb]
            else:
                x = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(x, src=rank - 1)
            y = stage.forward(mb, x)
            if rank < world - 1:
                pending.append(dist.isend(y.contiguous(), dst=rank + 1))
            else:
                outputs[mb] = y
        elif action == "I":
            if rank == world - 1:
                grad = loss_grad(mb, outputs[mb])
            else:
                grad = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(grad, src=rank + 1)
            grad_input = stage.backward_input(mb, grad)
            if rank > 0:
                pending.append(dist.isend(grad_input.contiguous(), dst=rank - 1))
        else:
            stage.backward_weight(mb)
    for work in pending:
        work.wait()
    return [outputs[mb] for mb in sorted(outputs)]
