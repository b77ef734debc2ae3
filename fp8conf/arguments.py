"""The public API's argument checks: a wrong kind of value is a typed error at the call.

Without them a module passed where a traced graph belongs, or ``None`` where a path belongs,
fails several frames down as an ``AttributeError: 'Linear' object has no attribute 'graph'``
that names neither the function nor the argument. :func:`require` turns it into an
:class:`~fp8conf.errors.FP8ConfigError` (also a ``TypeError``) saying which argument of which
function expected what, and how to get it.
"""

from __future__ import annotations

import functools
import os

from fp8conf.errors import FP8ConfigError

__all__ = ["require"]


@functools.cache
def _kinds() -> dict:
    """What each kind of argument is, and the words that tell a user what to pass. Built on first
    use: the artifact modules load without torch (the CLI's ``--help``)."""
    import torch
    import torch.fx

    return {
        "graph module": ((torch.fx.GraphModule,), "a torch.fx.GraphModule (the joint graph fp8conf.trace_joint(model, args) returns)"),
        "model": ((torch.nn.Module,), "a torch.nn.Module"),
        "node": ((torch.fx.Node,), "a torch.fx.Node of a traced graph"),
        "graph": ((torch.fx.Graph,), "a torch.fx.Graph (gm.graph of a traced GraphModule)"),
        "path": ((str, os.PathLike), "a file path (str or os.PathLike)"),
    }


def require(value, kind: str | type, function: str, argument: str, wanted: str | None = None) -> None:
    """Raise :class:`~fp8conf.errors.FP8ConfigError` unless ``value`` is of ``kind`` (a name of
    the table above, or a class, described by ``wanted``)."""
    if isinstance(kind, str):
        types, wanted = _kinds()[kind]
    else:
        types, wanted = (kind,), wanted or f"a {kind.__qualname__}"
    if isinstance(value, types):
        return
    raise FP8ConfigError(f"{function}({argument}=...): expected {wanted}, got {_describe(value)}{_hint(value, types)}")


def _describe(value) -> str:
    import torch

    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__qualname__}"


def _hint(value, types) -> str:
    import torch
    import torch.fx

    if torch.fx.GraphModule in types and isinstance(value, torch.nn.Module):
        return "; trace the model first: gm = fp8conf.trace_joint(model, args)"
    if torch.fx.Graph in types and isinstance(value, torch.fx.GraphModule):
        return "; pass its graph: gm.graph"
    if torch.fx.GraphModule in types and isinstance(value, torch.fx.Graph):
        return "; pass the GraphModule that owns this graph"
    return ""
