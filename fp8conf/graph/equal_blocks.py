"""Whether the blocks of a container are equal up to their parameter values, the condition for
tracing four of them and copying the rest (:mod:`fp8conf.graph.repeat`), and the container cut to
the blocks that are traced."""

from __future__ import annotations

import collections
from collections.abc import Collection

import torch

from fp8conf.errors import FP8TraceError
from fp8conf.log import logger

__all__ = ["TRACED_BLOCKS", "blocks_difference", "check_equal_blocks", "equal_values", "tensor_layout", "truncated"]

#: Blocks traced when a container is repeated: first, template, reference, last.
TRACED_BLOCKS = 4


def check_equal_blocks(model: torch.nn.Module, repeat: str, per_block: Collection[str] = ()) -> list[str]:
    """The FQNs of the blocks in container ``repeat`` (``["layers.0", ...]``), after checking they
    are one class with equal attributes, parameter and buffer layouts, module by module.

    ``per_block`` names attributes that may differ between blocks because the forward does not
    read them (torchtitan's ``layer_id``, used to initialise the weights): by name (``layer_id``,
    at any depth) or by path inside the block (``attention.layer_id``)."""
    try:
        container = model.get_submodule(repeat)
    except AttributeError as exc:
        raise FP8TraceError(f"trace_joint(repeat={repeat!r}): {type(model).__qualname__} has no submodule {repeat!r}") from exc
    if not isinstance(container, (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)):
        raise FP8TraceError(
            f"trace_joint(repeat={repeat!r}): {repeat!r} is a {type(container).__qualname__}; name a ModuleList, "
            "ModuleDict or Sequential of equal blocks"
        )
    problem = blocks_difference(container, repeat, per_block)
    if problem:
        raise FP8TraceError(
            f"trace_joint(repeat={repeat!r}): {problem}; only blocks equal up to their parameter values can be traced "
            "once and repeated: trace without repeat=, or, if the forward never reads the attribute, name it in per_block="
        )
    return [f"{repeat}.{name}" for name in container._modules]


def blocks_difference(container: torch.nn.Module, fqn: str, per_block: Collection[str] = ()) -> str | None:
    """What tells the first block of ``container`` (named ``fqn``) from another
    (``"block layers.4 differs from layers.0 (attribute norm.eps: ...)"``), or ``None`` when they
    are all equal, attributes in ``per_block`` aside."""
    names = list(container._modules)
    first = container._modules[names[0]] if names else None
    for name in names[1:]:
        problem = _difference(first, container._modules[name], "", (f"{fqn}.{names[0]}", f"{fqn}.{name}"), frozenset(per_block))
        if problem:
            return f"block {fqn}.{name} differs from {fqn}.{names[0]} ({problem})"
    return None


def _difference(a: torch.nn.Module, b: torch.nn.Module, where: str, blocks: tuple[str, str], per_block: frozenset) -> str | None:
    """What differs between blocks ``a`` and ``b`` (named ``blocks``) at submodule ``where``,
    attributes in ``per_block`` aside."""
    first, other = blocks
    if type(a) is not type(b):
        return f"{where or 'the block'} is a {type(a).__qualname__} in {first}, a {type(b).__qualname__} in {other}"
    for key in sorted(set(a.__dict__) | set(b.__dict__)):
        va, vb = a.__dict__.get(key, _MISSING), b.__dict__.get(key, _MISSING)
        if key in per_block or (f"{where}.{key}" if where else key) in per_block:
            continue
        if key in ("_parameters", "_buffers"):
            problem = _tensor_difference(va, vb, where, blocks)
        elif key == "_modules":
            if list(va) != list(vb):
                return f"{where or 'the block'} holds submodules {list(va)} in {first}, {list(vb)} in {other}"
            problem = next((p for n in va if (p := _difference(va[n], vb[n], f"{where}.{n}" if where else n, blocks, per_block))), None)
        elif isinstance(va, dict) and isinstance(vb, dict) and key.endswith("hooks"):
            problem = None if len(va) == len(vb) == 0 else f"{where or 'the block'} has {key}"
        else:
            problem = None if equal_values(va, vb) else f"attribute {where + '.' if where else ''}{key}: {va!r} in {first}, {vb!r} in {other}"
        if problem:
            return problem
    return None


_MISSING = object()


def equal_values(a, b) -> bool:
    """Attribute or argument values alike: tensors by layout, the rest by ``==``."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and tensor_layout(a) == tensor_layout(b)
    try:
        return bool(a is b or a == b)
    except Exception as exc:  # values that cannot be compared are not taken for equal: the blocks stay apart
        logger.debug("equal_blocks: comparing %s with %s raised %r; taken as different", type(a).__name__, type(b).__name__, exc)
        return False


def tensor_layout(t: torch.Tensor) -> tuple:
    """What of a tensor two equal blocks share: shape, stride, dtype, device, requires_grad."""
    return (tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad)


def _tensor_difference(a: dict, b: dict, where: str, blocks: tuple[str, str]) -> str | None:
    if list(a) != list(b):
        return f"{where or 'the block'} holds tensors {list(a)} in {blocks[0]}, {list(b)} in {blocks[1]}"
    for name in a:
        if (a[name] is None) != (b[name] is None) or (a[name] is not None and tensor_layout(a[name]) != tensor_layout(b[name])):
            return f"tensor {where + '.' if where else ''}{name} has another shape, stride, dtype, device or requires_grad"
    return None


class truncated:
    """Context manager: container ``repeat`` holds only its first ``blocks`` blocks
    (:data:`TRACED_BLOCKS` unless told)."""

    def __init__(self, model: torch.nn.Module, repeat: str, blocks: int = TRACED_BLOCKS):
        self.container, self.blocks = model.get_submodule(repeat), blocks

    def __enter__(self):
        self.modules = self.container._modules
        self.container._modules = collections.OrderedDict(list(self.modules.items())[:self.blocks])
        return self

    def __exit__(self, *exc):
        self.container._modules = self.modules
