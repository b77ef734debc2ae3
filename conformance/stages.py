"""The suite's own wiring of a GraphPP split, by the calling convention of
:class:`conformance.StageSplit` (the backend's own runner is not trusted for this)."""

from __future__ import annotations

from conformance.api.types import StageSplit

__all__ = ["run_split", "SplitConventionError"]


class SplitConventionError(Exception):
    """A callable returned a number of values its split's description does not allow."""


def run_split(split: StageSplit, primals, tangents) -> list:
    """Forward, then dI, then dW, as a zero-bubble stage runs them; returns the joint graph's
    flat outputs (``split.output_layout``), so ``Backend.run_joint(..., fn=...)`` takes it."""
    forward = tuple(split.forward(*primals))
    if len(forward) < split.num_outputs:
        raise SplitConventionError(f"forward returned {len(forward)} values, fewer than its {split.num_outputs} outputs")
    outputs, saved = forward[: split.num_outputs], forward[split.num_outputs :]
    missing = [i for i in (*split.saved_for_input, *split.saved_for_weight) if i >= len(saved)]
    if missing:
        raise SplitConventionError(f"saved value(s) {missing} asked for, but forward saved {len(saved)}")
    backward_input = tuple(split.backward_input(*(saved[i] for i in split.saved_for_input), *tangents))
    n_grads = len(split.input_grads)
    if len(backward_input) < n_grads:
        raise SplitConventionError(f"backward_input returned {len(backward_input)} values, fewer than its {n_grads} input gradients")
    input_grads, carried = backward_input[:n_grads], backward_input[n_grads:]
    param_grads = tuple(split.backward_weight(*(saved[i] for i in split.saved_for_weight), *carried))
    if len(param_grads) != len(split.param_grads):
        raise SplitConventionError(f"backward_weight returned {len(param_grads)} values for {len(split.param_grads)} parameter gradients")
    values = {"output": outputs, "input_grad": input_grads, "param_grad": param_grads}
    return [None if slot is None else values[slot[0]][slot[1]] for slot in split.output_layout]
