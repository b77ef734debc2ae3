"""Backend-neutral value types exchanged between the suite and a backend adapter.

They hold plain Python values only (no torch objects), so the suite can compare, print and
serialise them whatever a backend keeps in ``node.meta``.
"""

from __future__ import annotations

import dataclasses

__all__ = ["CAPABILITIES", "PASSES", "Provenance", "Finding", "ValidationReport", "Region", "Compiled", "StageSplit"]

#: Every capability a backend may claim. A property whose capability is not claimed is reported
#: as ``not_supported``: neither a pass nor a failure.
CAPABILITIES = frozenset(
    {
        "provenance",
        "validation",
        "emulation",
        "regions",
        "compile.full",
        "compile.regional",
        "cudagraph",
        "graphpp",
        "fingerprint",
        "e8m0",
        "mx",
    }
)

#: The two passes of a joint graph.
PASSES = ("forward", "backward")


@dataclasses.dataclass(frozen=True)
class Provenance:
    """Which quantized module issued a node, and with which quantization config.

    ``kind`` is ``"float8_linear"`` or ``"mxfp8_linear"``; ``recipe`` is the recipe name
    (``"tensorwise"``, ``"rowwise"``, ``"rowwise_with_gw_hp"``, ``"mxfp8"``, ...).
    """

    module_fqn: str
    kind: str
    recipe: str
    emulate: bool


@dataclasses.dataclass(frozen=True)
class Finding:
    """One broken rule found by validation."""

    property_id: str
    message: str
    module_fqn: str | None = None
    pass_name: str | None = None
    node_name: str | None = None


@dataclasses.dataclass(frozen=True)
class ValidationReport:
    """What a validation run found.

    ``compute_counts`` maps ``(module_fqn, pass_name)`` to the number of FP8 compute nodes the
    backend attributed to that module in that pass; ``summary`` is one human-readable paragraph.
    """

    findings: tuple[Finding, ...]
    compute_counts: dict[tuple[str, str], int]
    summary: str

    @property
    def ok(self) -> bool:
        return not self.findings


@dataclasses.dataclass(frozen=True)
class Region:
    """An FP8 region as the backend identified it.

    ``nodes`` are the ``torch.fx.Node`` objects of the graph the backend was given; ``tagged``
    says whether the backend marked it for regional compilation
    (``node.meta["custom"]["compile_with_inductor"]``).
    """

    id: str
    nodes: tuple
    complete: bool
    tagged: bool


@dataclasses.dataclass(frozen=True)
class Compiled:
    """A compiled joint graph. ``fn`` is called like the joint graph was (the backend's own
    convention, run through ``Backend.run_joint(..., fn=fn)``); ``compiled_nodes`` and
    ``eager_nodes`` name the joint graph's ``call_function`` nodes Inductor runs and those left
    eager."""

    fn: object
    compiled_nodes: frozenset
    eager_nodes: frozenset


@dataclasses.dataclass(frozen=True)
class StageSplit:
    """A stage's joint graph cut for zero-bubble pipelining (capability ``graphpp``). The suite
    wires the three ``torch.fx.GraphModule`` callables itself, by this convention:

    * ``forward(*primals) -> (*outputs, *saved)``: ``primals`` are the joint graph's placeholders
      that are not tangents, in order; the first ``num_outputs`` results are the stage outputs;
    * ``backward_input(*[saved[i] for i in saved_for_input], *tangents) -> (*input_grads, *carried)``:
      ``input_grads`` in the order of the ``input_grads`` keys (``"input.<i>"``);
    * ``backward_weight(*[saved[i] for i in saved_for_weight], *carried) -> (*param_grads,)``: in
      the order of the ``param_grads`` keys (parameter FQNs).

    ``output_layout`` maps each flat output of the joint graph to ``("output" | "input_grad" |
    "param_grad", index)``, or None where the joint graph returns None.
    """

    forward: object
    backward_input: object
    backward_weight: object
    num_outputs: int
    saved_for_input: tuple
    saved_for_weight: tuple
    input_grads: tuple
    param_grads: tuple
    output_layout: tuple

    @property
    def parts(self) -> dict:
        return {"forward": self.forward, "backward_input": self.backward_input, "backward_weight": self.backward_weight}
