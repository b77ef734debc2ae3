"""How the suite runs a GraphPP split: its own wiring of a split by the AOT calling convention
of :class:`conformance.StageSplit`, or the backend's runner, watched (:func:`split_step`).

A runner is the backend's code, so the suite does not take its word: it counts the calls of
the three callables, checks their order, and checks that the backward-weight callable receives
only what the forward and backward-input callables returned or the step was given.
"""

from __future__ import annotations

from conformance.api.types import StageSplit

__all__ = ["run_split", "split_step", "SplitConventionError"]

_PART_ORDER = ("forward", "backward_input", "backward_weight")


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


def split_step(split: StageSplit):
    """``(fn, check)``: ``fn`` runs ``split`` in place of the joint graph (give it to
    ``Backend.run_joint(..., fn=fn)``); ``check()`` then returns why the run broke the runner's
    rules, or None. A split by the AOT convention is wired by the suite and always checks."""
    if split.run is None:
        return (lambda primals, tangents: run_split(split, primals, tangents)), (lambda: None)
    calls: list[tuple[str, tuple, object]] = []
    given: list = []

    def fn(*args, **kwargs):
        given.extend(_tensors((args, kwargs)))
        with _watched(split, calls):
            return split.run(*args, **kwargs)

    return fn, lambda: _runner_violation(calls, given)


def _tensors(value) -> list:
    import torch
    import torch.utils._pytree as pytree

    return [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]


class _watched:
    """Wraps each callable's ``forward`` while the runner runs, recording (name, args, result).

    A callable's own code may call ``self.forward`` again: a graph module whose code is written
    on first call (torch's deferred graph modules, which fp8conf's split parts are) writes it,
    then calls itself. Such a nested call runs the class's ``forward`` (the code just written)
    and is not recorded: it is the same call of the part."""

    def __init__(self, split, calls):
        self.parts, self.calls = split.parts, calls
        self.running: set[str] = set()

    def __enter__(self):
        for name, part in self.parts.items():
            inner = part.forward

            def forward(*args, _inner=inner, _name=name, _part=part, **kwargs):
                if _name in self.running:
                    return type(_part).forward(_part, *args, **kwargs)
                self.running.add(_name)
                try:
                    result = _inner(*args, **kwargs)
                finally:
                    self.running.discard(_name)
                self.calls.append((_name, args, result))
                return result

            part.forward = forward
        return self

    def __exit__(self, *exc):
        for part in self.parts.values():
            del part.forward  # the instance attribute set above; the class's forward shows again
        return False


def _runner_violation(calls, given) -> str | None:
    names = [name for name, _, _ in calls]
    if names != list(_PART_ORDER):
        return (
            f"the backend's runner called {names or 'none of its callables'}; it must call forward, "
            "backward_input and backward_weight once each, in that order"
        )
    known = {id(t) for t in given}
    for _, _, result in calls[:2]:
        known.update(id(t) for t in _tensors(result))
    foreign = [i for i, t in enumerate(_tensors(calls[2][1])) if id(t) not in known]
    if foreign:
        return (
            f"backward_weight received tensor argument(s) {foreign} that neither forward nor backward_input "
            "returned and the step was not given: the runner computed them itself"
        )
    return None
