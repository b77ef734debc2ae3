"""Graph modules that write their Python code when first called, not when made.

The passes make graph modules of the whole joint graph (the repeated trace, the flat copy, the
partitioner's forward and backward) that nothing calls: generating and compiling their code at
once cost seconds per 10,000 nodes. Inductor defers it the same way; a deferred module writes its
code when it is called, printed, pickled or asked for ``.code``.
"""

from __future__ import annotations

import contextlib

import torch
import torch.fx

__all__ = ["codegen_deferred", "graph_module"]


def codegen_deferred():
    """Inside, torch's own passes make deferred graph modules too (the min-cut partitioner's)."""
    try:
        from torch.fx._lazy_graph_module import _use_lazy_graph_module
    except ImportError as exc:  # a torch without deferred graph modules: code at once, as before
        _said_no_deferred_code(exc)
        return contextlib.nullcontext()
    return _use_lazy_graph_module(True)


def graph_module(root, graph: torch.fx.Graph, class_name: str = "GraphModule") -> torch.fx.GraphModule:
    """``torch.fx.GraphModule(root, graph, class_name)``, deferred under :func:`codegen_deferred`."""
    try:
        from torch.fx._lazy_graph_module import _make_graph_module
    except ImportError as exc:
        _said_no_deferred_code(exc)
        return torch.fx.GraphModule(root, graph, class_name)
    return _make_graph_module(root, graph, class_name)


def _said_no_deferred_code(exc: ImportError) -> None:
    from fp8conf.log import fell_back

    fell_back("deferred code", f"torch.fx._lazy_graph_module is missing ({exc})",
              "every graph module writes its Python code when made (more host time per compile)")
