"""GraphPP stages for ``torch.distributed.pipelining``'s schedules.

:class:`GraphPPStage` is a :class:`torch.distributed.pipelining.PipelineStage` whose three
per-microbatch steps run a stage's split callables (:mod:`fp8conf.graph.split`), eagerly or with
their FP8 regions compiled, instead of autograd on the stage module:

``forward_one_chunk`` (the schedules' ``F``)
    runs ``forward`` and keeps what the backward needs from it (``saved``) per microbatch;
``backward_one_chunk(full_backward=False)`` (``I``)
    runs ``backward_input`` (dI) on the gradient that arrived, hands the input gradient to the
    library's send (or, for a neighbour stage on the same rank, its local hand-over) and keeps
    what dW needs from dI (``carried``): values dI computed, FP8 tensors with their scales
    among them, which dW uses as they are and never casts again;
``backward_weight_one_chunk`` (``W``)
    runs ``backward_weight`` (dW) and accumulates the parameter gradients into ``.grad``;
``backward_one_chunk(full_backward=True)`` (``B``)
    runs dI then dW at once.

Everything else is the library's: the schedule's action order, the send/recv of activations and
gradients (buffers made from the static shapes the stage declares, so no metadata inference
runs the module), the V-shaped schedules' same-rank hand-over, gradient scaling. Any schedule
of ``torch.distributed.pipelining.schedules`` therefore runs FP8 GraphPP stages unchanged;
those checked are :data:`CHECKED_SCHEDULES`.

The callables are pure graphs: they run under ``torch.no_grad()`` and build no autograd graph.
On the last stage the output is handed to the schedule's loss function as a fresh leaf, and the
gradient of the loss with respect to it is what dI receives.
"""

from __future__ import annotations

import torch
from torch.distributed.pipelining import PipelineStage

from fp8conf.errors import FP8ConfigError
from fp8conf.compile import CompileConfig, compile_split
from fp8conf.graph.split import StageSplit, split_stage
from fp8conf.graph.trace import joint_inputs, trace_joint

__all__ = ["GraphPPStage", "CHECKED_SCHEDULES"]

#: Schedules of ``torch.distributed.pipelining`` run with GraphPP stages and checked bitwise
#: against the unsplit step (``python -m fp8conf.pipeline``), by their
#: ``get_schedule_class`` names. ``B``: full backward; ``I``/``W``: backward-input and
#: backward-weight as separate actions.
CHECKED_SCHEDULES = {
    "1F1B": "one stage per rank, B",
    "GPipe": "one stage per rank, every F then every B",
    "Interleaved1F1B": "several stages per rank, looped, B",
    "InterleavedZeroBubble": "one or more stages per rank, looped, I and W deferred",
    "ZBVZeroBubble": "two stages per rank, V-shaped, I and W deferred",
    "DualPipeV": "two stages per rank, V-shaped, overlapped F and B, I and W",
}


class GraphPPStage(PipelineStage):
    """Stage ``stage_index`` of ``num_stages``: ``submodule`` traced on ``example_input`` (one
    microbatch, on ``device``), split into forward / dI / dW, and optionally compiled
    (``compile="regional"`` or ``"full"``, compiled with ``strict``, or a
    :class:`~fp8conf.CompileConfig`; see :func:`fp8conf.compile_split`).

    ``runs`` records the callables in the order the schedule ran them, as ``(part, microbatch)``
    with ``part`` one of ``"forward"``, ``"backward_input"``, ``"backward_weight"``.
    """

    def __init__(
        self,
        submodule: torch.nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device | str,
        example_input: torch.Tensor,
        *,
        compile: str | CompileConfig | None = None,
        strict: bool = True,
        group=None,
    ):
        first = stage_index == 0
        x = example_input.detach().clone().to(device).requires_grad_(not first)
        self.gm = trace_joint(submodule, (x,))
        self.split: StageSplit = split_stage(self.gm, strict=strict)
        if self.split.num_outputs != 1:
            raise FP8ConfigError(
                f"stage {stage_index} ({type(submodule).__qualname__}) returns {self.split.num_outputs} outputs: "
                "a GraphPP stage takes one activation and returns one; return a single tensor"
            )
        if compile is not None and not isinstance(compile, CompileConfig):
            compile = CompileConfig(mode=compile, strict=strict)
        self.fns = compile_split(self.split, compile) if compile is not None else {}
        # The shapes travel as static metadata: the library allocates its receive buffers from
        # them and never runs the module to infer them.
        super().__init__(
            submodule, stage_index, num_stages, torch.device(device),
            input_args=x.detach().requires_grad_(not first),
            output_args=_example_output(self.split, device),
            group=group,
        )
        self.params = dict(submodule.named_parameters())
        self.runs: list[tuple[str, int]] = []
        self._saved: dict[int, tuple] = {}
        self._carried: dict[int, tuple] = {}

    def _run(self, part: str, chunk: int, step, *args):
        self.runs.append((part, chunk))
        with torch.no_grad():
            return step(*args, self.fns.get(part))

    def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):
        if kwargs:
            raise FP8ConfigError(f"stage {self.stage_index}: a GraphPP stage takes no keyword arguments, got {sorted(kwargs)}")
        inputs = tuple(args) if self.is_first else self._retrieve_recv_activations(fwd_chunk_id)
        primals, _ = joint_inputs(self.gm, self.submod, tuple(t.detach() for t in inputs), (None,))
        outputs, saved = self._run("forward", fwd_chunk_id, self.split.run_forward, primals)
        if self.has_backward:
            self._saved[fwd_chunk_id] = saved
        output = outputs[0]
        if self.is_last and self.has_backward:
            # The loss function is the one piece of the step outside the graph: autograd runs on
            # it alone, from this leaf.
            output = output.detach().requires_grad_(True)
        if self.is_last and save_forward_output:
            self.output_chunks.append(output)
        self.fwd_cache[fwd_chunk_id] = ((output,), list(inputs))
        return output

    def clear_runtime_states(self) -> None:
        super().clear_runtime_states()
        # A step that stopped half-way must not leave its saved values to the next one.
        self._saved.clear()
        self._carried.clear()

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        if not self.has_backward:
            return
        self._check_chunk_id(bwd_chunk_id)
        (output,), _ = self.fwd_cache.pop(bwd_chunk_id)
        if self.is_last:
            (grad_output,) = torch.autograd.grad(loss, output)
            output.detach_()
        else:
            (grad_output,) = self._retrieve_recv_grads(bwd_chunk_id)
        saved = self._saved[bwd_chunk_id]
        input_grads, carried = self._run("backward_input", bwd_chunk_id, self.split.run_backward_input, saved, (grad_output,))
        self.bwd_cache[bwd_chunk_id] = (input_grads[0],) if input_grads else (None,)
        self._carried[bwd_chunk_id] = carried
        if full_backward:
            self.backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        if not self.has_backward:
            return
        if bwd_chunk_id not in self._carried:
            raise FP8ConfigError(
                f"stage {self.stage_index}: the schedule ran W for microbatch {bwd_chunk_id} before its I "
                "(backward_one_chunk); run the backward-input step first"
            )
        saved, carried = self._saved.pop(bwd_chunk_id), self._carried.pop(bwd_chunk_id)
        grads = self._run("backward_weight", bwd_chunk_id, self.split.run_backward_weight, saved, carried)
        with torch.no_grad():
            for fqn, grad in zip(self.split.param_grads, grads):
                param = self.params[fqn]
                param.grad = grad.detach().clone() if param.grad is None else param.grad.add_(grad)


def _example_output(split: StageSplit, device) -> torch.Tensor:
    (output,) = split.forward.graph.find_nodes(op="output")
    value = output.args[0][0].meta["val"]
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device).requires_grad_(True)
