"""The inputs a graph was traced for, checked at every call of what was compiled from it.

Compiled code is specialized to the shapes, dtypes and devices of the values the graph was
traced with, and Inductor's generated code checks them with assertions of its own, deep inside a
compiled unit and in its terms: a tangent given as a Python float fails as ``Expected tensors
only`` in ``copy_misaligned_inputs`` of whichever unit reads it first, possibly many units and
calls after the step began, with nothing to say which of the step's inputs was wrong. A fast
path that skips torch's wrappers cannot be sure of its inputs either. :func:`input_check` makes
the one check at the boundary instead: every flat input against the placeholder it feeds,
named as the joint signature names it (parameter FQN, user input, tangent of an output).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.fx

from fp8conf.errors import FP8ConfigError

__all__ = ["input_check", "describe_inputs"]


def describe_inputs(gm: torch.fx.GraphModule, signature=None) -> list[str]:
    """A readable name per placeholder of ``gm``: ``parameter 'layers.0.wq.weight'``,
    ``input 0``, ``tangent of output 0`` as ``signature`` (its
    :class:`~fp8conf.JointSignature`) describes them, or the placeholder's own name where none
    is given (a GraphPP callable)."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    if signature is None or len(signature.inputs) != len(placeholders):
        return [f"placeholder '{p.name}'" for p in placeholders]
    names = []
    for spec, node in zip(signature.inputs, placeholders):
        if spec.kind == "param":
            names.append(f"parameter '{spec.target}'")
        elif spec.kind == "buffer":
            names.append(f"buffer '{spec.target}'")
        elif spec.kind == "input":
            names.append(f"input {spec.index}")
        elif spec.kind == "tangent":
            names.append(f"tangent of output {spec.index}")
        else:
            names.append(f"placeholder '{node.name}'")
    return names


def input_check(gm: torch.fx.GraphModule, where: str, example_inputs: Sequence | None = None, signature=None) -> Callable[[Sequence], None]:
    """A function that raises :class:`~fp8conf.errors.FP8ConfigError` unless a call's flat
    inputs match ``gm``'s placeholders: their number, and for each traced tensor a tensor of the
    same shape, dtype and device (a symbolic dimension matches any size); for a traced number, a
    number. ``example_inputs`` (flat) replace the traced values where compiled code was
    specialized to them instead. ``where`` names the callable in the message, ``signature`` (the
    graph's :class:`~fp8conf.JointSignature`, if it has one) the inputs.

    The per-call cost is one comparison per input (the model's parameters included): a few
    microseconds for a model of a hundred parameters."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    values = list(example_inputs) if example_inputs is not None else [p.meta.get("val") for p in placeholders]
    if len(values) != len(placeholders):
        values = [p.meta.get("val") for p in placeholders]
    expected = [_expectation(v) for v in values]
    names = describe_inputs(gm, signature)
    count = len(expected)
    # The whole list compared in one expression, the common case; the message is built only
    # when something differs.
    fast = [e if isinstance(e, tuple) else None for e in expected]

    def check(flat: Sequence) -> None:
        if len(flat) != count:
            raise FP8ConfigError(
                f"{where}: called with {len(flat)} inputs, but the graph takes {count} "
                f"({_listing(names)}); feed it with JointSignature.feed(model, args, grad_outputs) or fp8conf.run_joint"
            )
        for value, want in zip(flat, fast):
            if want is None or not isinstance(value, torch.Tensor) or (value.shape, value.dtype, value.device) != want:
                break
        else:
            return
        for i, (value, want) in enumerate(zip(flat, expected)):
            problem = _mismatch(value, want)
            if problem:
                raise FP8ConfigError(
                    f"{where}: {names[i]} (flat input {i}) {problem}; pass the value the graph was traced for, or trace again "
                    "for the new shape"
                )

    return check


def _expectation(value):
    """``(shape, dtype, device)`` for a static tensor; ``("tensor", sizes with None for a
    symbolic dimension, dtype, device)`` for a symbolic one; ``"number"``; or ``None`` (no
    recorded value: anything goes)."""
    if isinstance(value, torch.Tensor):
        sizes = [s if isinstance(s, int) else _static(s) for s in value.shape]
        if all(s is not None for s in sizes):
            return (torch.Size(sizes), value.dtype, _device(value.device))
        return ("tensor", tuple(sizes), value.dtype, _device(value.device))
    if isinstance(value, (bool, int, float, torch.SymInt, torch.SymFloat, torch.SymBool)):
        return "number"
    return None


def _static(size) -> int | None:
    from torch.fx.experimental.symbolic_shapes import is_concrete_int

    return int(size) if is_concrete_int(size) else None


def _device(device: torch.device) -> torch.device:
    # A real CUDA tensor reports its index; a traced value may not.
    if device.type != "cpu" and device.index is None:
        return torch.device(device.type, torch.accelerator.current_device_index())
    return device


def _mismatch(value, want) -> str | None:
    if want is None:
        return None
    if want == "number":
        if isinstance(value, (bool, int, float, torch.SymInt, torch.SymFloat, torch.SymBool)):
            return None
        return f"was traced as a number, got {_kind(value)}"
    if isinstance(want, tuple) and want[0] == "tensor":
        _, sizes, dtype, device = want
    else:
        sizes, dtype, device = tuple(want[0]), want[1], want[2]
    if not isinstance(value, torch.Tensor):
        return f"must be a tensor of shape {_shape(sizes)}, {dtype}, on {device}; got {_kind(value)}"
    if len(value.shape) != len(sizes) or any(s is not None and s != v for s, v in zip(sizes, value.shape)):
        return f"has shape {_shape(value.shape)}, but the graph was traced for {_shape(sizes)}"
    if value.dtype != dtype:
        return f"has dtype {value.dtype}, but the graph was traced for {dtype}"
    if value.device != device:
        return f"is on {value.device}, but the graph was traced on {device}"
    return None


def _kind(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {_shape(value.shape)}, {value.dtype}"
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"


def _shape(sizes) -> str:
    text = ", ".join("?" if s is None else str(s) for s in sizes)
    return f"({text},)" if len(sizes) == 1 else f"({text})"


def _listing(names: list[str]) -> str:
    return ", ".join(names) if len(names) <= 6 else ", ".join(names[:3]) + f", ... {len(names) - 5} more ..., " + ", ".join(names[-2:])
