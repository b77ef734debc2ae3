"""What the suite itself reads from a backend's graph, independently of the backend.

The suite needs ground truth that does not come from the backend under test:

* :func:`is_fp8_compute`: the spec's own definition of FP8 compute (a scaled matmul whose two
  matrix operands are FP8, judged from ``node.meta["val"]``);
* :func:`trace_with_oracle`: while the backend traces, the suite annotates each quantized
  module's forward with ``torch.fx.traceback.annotate`` under a key of its own. Forward nodes
  then say which module issued them; backward nodes are paired with the forward op they
  differentiate through autograd's ``seq_nr``. The backend's provenance is compared with this.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import torch
import torch.fx
import torch.fx.traceback as fx_traceback

__all__ = ["is_fp8_compute", "Oracle", "trace_with_oracle", "copy_graph_module", "fp8_compute_nodes"]

ORACLE_KEY = "conformance.issued_by"
_SCALED_MM = ("aten._scaled_mm.", "aten._scaled_mm_v2.", "aten._scaled_grouped_mm.", "fp8conf.scaled_mm_e8m0.")


def _is_fp8(value) -> bool:
    dtype = getattr(value.meta.get("val") if isinstance(value, torch.fx.Node) else value, "dtype", None)
    return dtype is not None and "float8" in str(dtype) and "e8m0" not in str(dtype)


def is_fp8_compute(node: torch.fx.Node) -> bool:
    target = str(node.target)
    return (
        node.op == "call_function"
        and target.startswith(_SCALED_MM)
        and len(node.args) >= 2
        and _is_fp8(node.args[0])
        and _is_fp8(node.args[1])
    )


def fp8_compute_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if is_fp8_compute(n)]


@dataclasses.dataclass
class Oracle:
    """Which module issued each call_function node (``None``: no quantized module)."""

    issued_by: dict[torch.fx.Node, str | None]
    forward_seq_nrs: frozenset

    def is_accumulation(self, node: torch.fx.Node) -> bool:
        """A backward node issued by no forward op: gradient accumulation."""
        return node.meta.get("seq_nr") not in self.forward_seq_nrs


@contextlib.contextmanager
def _annotate_modules(model: torch.nn.Module, fqns):
    patched = []
    for fqn in fqns:
        module = model.get_submodule(fqn)
        original = module.__dict__.get("forward")
        inner = module.forward

        def forward(*args, _inner=inner, _fqn=fqn, **kwargs):
            with fx_traceback.annotate({ORACLE_KEY: _fqn}):
                return _inner(*args, **kwargs)

        module.forward = forward
        patched.append((module, original))
    try:
        yield
    finally:
        for module, original in patched:
            if original is None:
                del module.forward
            else:
                module.forward = original


def trace_with_oracle(backend, model, args, quantized_fqns, is_backward) -> tuple[torch.fx.GraphModule, Oracle]:
    """Let ``backend`` trace ``model`` while the suite records its own ground truth."""
    with fx_traceback.preserve_node_meta(), _annotate_modules(model, quantized_fqns):
        gm = backend.trace_joint(model, args)
    if not isinstance(gm, torch.fx.GraphModule):
        raise TypeError(f"backend {backend.name!r}: trace_joint returned {type(gm).__qualname__}, expected torch.fx.GraphModule")
    issued_by, by_seq = {}, {}
    backward_nodes = []
    for node in gm.graph.nodes:
        fqn = _take_oracle_key(node)
        if node.op != "call_function":
            continue
        if is_backward(node):
            backward_nodes.append(node)
        else:
            issued_by[node] = fqn
            by_seq.setdefault(node.meta.get("seq_nr"), set()).add(fqn)
    for node in backward_nodes:
        issuers = {f for f in by_seq.get(node.meta.get("seq_nr"), ()) if f is not None}
        issued_by[node] = next(iter(issuers)) if len(issuers) == 1 else None
    return gm, Oracle(issued_by, frozenset(k for k in by_seq if k is not None))


def _take_oracle_key(node) -> str | None:
    custom = node.meta.get("custom")
    if not custom or ORACLE_KEY not in custom:
        return None
    rest = {k: v for k, v in custom.items() if k != ORACLE_KEY}
    if rest:
        node.meta["custom"] = rest
    else:
        del node.meta["custom"]
    return custom[ORACLE_KEY]


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy whose graph and per-node meta dicts can be rewritten without touching ``gm``."""
    graph = torch.fx.Graph()
    graph._codegen = copy.deepcopy(gm.graph._codegen)  # keeps the pytree calling convention
    value, old_output = graph.graph_copy(gm.graph, {}, return_output_node=True)
    new_output = graph.output(value)
    new_output.meta = dict(old_output.meta)
    new = torch.fx.GraphModule(gm, graph)
    new.meta.update(gm.meta)
    return new
