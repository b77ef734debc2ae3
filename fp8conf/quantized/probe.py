"""Finding low-precision compute in modules that declare no quantization, without tracing.

The quantization signature keys an artifact on the modules that *declare* a quantization
(:mod:`fp8conf.quantized.protocol`). A module that computes in FP8 and declares nothing would
leave the signature of an FP8 model equal to the plain model's: an artifact compiled for one
would load for the other. :func:`undeclared_fp8_modules` observes instead of asking: it runs
modules on fake tensors (no real compute, no memory) under a dispatch mode that sees every op,
and names each module whose call issued low-precision compute (two FP8 or FP4 matrix operands
into a high-precision result) while no declared quantized module was on the call stack.

With example inputs the whole model runs once. Without, each module that could hold such code
(a class outside torch, declaring nothing, inside no declared module, with a 2-D floating
``weight`` of its own, as a linear has) is called alone on a fake ``(16, in_features)`` input;
a module that cannot be called so is logged and left out.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch.utils._python_dispatch import TorchDispatchMode
import torch.utils._pytree as pytree

from fp8conf.graph.roles import is_low_precision_dtype, operand_positions
from fp8conf.quantized.protocol import class_name, quantization_config_of

__all__ = ["undeclared_fp8_modules"]

_log = logging.getLogger("fp8conf")
_PROBE_TOKENS = 16


def undeclared_fp8_modules(model: torch.nn.Module, example_inputs=None) -> dict[str, tuple[str, tuple[str, ...]]]:
    """``{fqn: (class name, low-precision ops seen)}`` for every module of ``model`` that issued
    low-precision compute while declaring no quantization (nor being inside a module that does)."""
    names = {}
    for fqn, module in model.named_modules():
        names.setdefault(module, fqn)
    declared = {m for m in names if quantization_config_of(m) is not None}
    if example_inputs is not None:
        args = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
        return _observe(model, names, declared, lambda: model(*args), "the model")
    found: dict[str, tuple[str, tuple[str, ...]]] = {}
    for module in _candidates(model, names, declared):
        weight = module.weight
        found.update(_observe(
            module, names, declared,
            lambda m=module, w=weight: m(torch.empty(_PROBE_TOKENS, w.shape[1], dtype=w.dtype, device=w.device, requires_grad=True)),
            f"module '{names[module]}' ({class_name(type(module))})",
        ))
    return found


def _candidates(model, names, declared) -> list[torch.nn.Module]:
    inside_declared = {sub for m in declared for sub in m.modules()}
    out = []
    for module in names:
        weight = module._parameters.get("weight")
        if (
            module in inside_declared
            or type(module).__module__.split(".")[0] == "torch"
            or weight is None
            or weight.dim() != 2
            or not weight.is_floating_point()
        ):
            continue
        out.append(module)
    return out


class _LowPrecisionCompute(TorchDispatchMode):
    """Records, per innermost module on the stack, the ops that compute in low precision."""

    def __init__(self, stack, names, declared):
        super().__init__()
        self.stack, self.names, self.declared = stack, names, declared
        self.seen: dict[torch.nn.Module, set[str]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.stack and not any(m in self.declared for m in self.stack) and _computes_low_precision(func, args, out):
            self.seen.setdefault(self.stack[-1], set()).add(str(func))
        return out


def _computes_low_precision(func, args, out) -> bool:
    """Two low-precision matrix operands into a high-precision floating result: at the known
    scaled matmuls' operand positions, and for any other op its first two tensor arguments."""
    positions = operand_positions(str(func))
    if positions is not None:
        operands = [args[p] if len(args) > p else None for p in positions]
    else:
        operands = [a for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor)][:2]
    results = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
    return (
        len(operands) == 2
        and all(isinstance(o, torch.Tensor) and is_low_precision_dtype(o.dtype) for o in operands)
        and any(r.is_floating_point() and not is_low_precision_dtype(r.dtype) for r in results)
    )


def _observe(root, names, declared, call, what: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.modules import module as module_hooks

    stack: list[torch.nn.Module] = []
    mode = _LowPrecisionCompute(stack, names, declared)
    def enter(module, _args):
        stack.append(module)

    def leave(module, _args, _output):  # returns None: a hook's value would replace the output
        if stack and stack[-1] is module:
            stack.pop()

    handles = [module_hooks.register_module_forward_pre_hook(enter), module_hooks.register_module_forward_hook(leave, always_call=True)]
    try:
        with contextlib.ExitStack() as scope:
            scope.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            scope.enter_context(mode)
            call()
    except Exception as exc:  # the probe is a look, not a run the user asked for: say it and go on
        _log.info("fp8conf: could not look for undeclared FP8 compute in %s: %s: %s", what, type(exc).__name__, exc)
    finally:
        for handle in handles:
            handle.remove()
    return {names[m]: (class_name(type(m)), tuple(sorted(ops))) for m, ops in mode.seen.items() if m in names}
