"""Backend-neutral value types exchanged between the suite and a backend adapter.

They hold plain Python values only (no torch objects), so the suite can compare, print and
serialise them whatever a backend keeps in ``node.meta``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = [
    "CAPABILITIES", "PASSES", "Provenance", "Finding", "ValidationReport", "Region", "Compiled", "StageSplit",
    "JobConfigs", "AOT_SPLIT_FIELDS", "FINGERPRINT_SCOPES", "FLOAT8_RECIPES", "MX_RECIPES", "WEIGHT_GATHERS", "ComputeOp", "TORCH_COMPUTE_OPS",
]

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
        "artifacts",
        "e8m0",
        "mx",
        "moe",
        "distributed",
        "scaled_mm_v2",
        "scaled_grouped_mm_v2",
        "float8_modules",
        "rewrites",
        "nvfp4",
    }
)

#: The recipes of float8 linears (kind ``float8_linear``): what ``Backend.float8_recipes`` may
#: declare and ``Backend.convert_float8`` is asked for.
FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")

#: The recipes of MX linears (kind ``mxfp8_linear``): what ``Backend.mx_recipes`` may declare and
#: ``Backend.convert_mx`` is asked for. ``mxfp8`` computes MXFP8 through any scaled matmul (or the
#: backend's e8m0 op), ``mxfp8_emulated`` in high precision on purpose, and ``mxfp8_swizzled``
#: through ``F.scaled_mm`` with ``float8_e8m0fnu`` scales of blocks of 32 (recipe
#: ``BlockWise1x32``) in the ``SWIZZLE_32_4_4`` layout.
MX_RECIPES = ("mxfp8", "mxfp8_emulated", "mxfp8_swizzled")

#: How a data-parallel step may move a quantized module's weight (``Backend.weight_gathers``):
#: ``float8``, quantized on each rank's shard and all-gathered as FP8 bytes (TorchAO's float8
#: all-gather), or ``high_precision``, all-gathered in high precision and quantized after the
#: gather on every rank (quantize after gather).
WEIGHT_GATHERS = ("float8", "high_precision")

#: The two passes of a joint graph.
PASSES = ("forward", "backward")

#: What a backend's fingerprint covers (``Backend.fingerprint_scope``):
#:
#: * ``"quantization"``: the digest of the quantization signature and nothing else. The signature
#:   holds every input of the fingerprint, and both ignore the model's structure and its
#:   registration order.
#: * ``"whole_step"``: a key of the whole training step, as a trainer whose traced step binds
#:   parameters and buffers by position keys its artifacts: beyond the quantization inputs it may
#:   cover the model's structure (its modules, parameters and buffers, their names, shapes and
#:   registration order, the ops around the quantized modules) and the whole job configuration;
#:   the readable signature may describe the quantized modules only, leaving the global inputs
#:   (``strict``, versions, job settings) to the fingerprint.
#:
#: Every scope is sensitive to every quantization input, and equal for equal models built alike
#: in any process.
FINGERPRINT_SCOPES = ("quantization", "whole_step")


@dataclasses.dataclass(frozen=True)
class ComputeOp:
    """An op that is FP8 compute in a backend's graphs (``Backend.fp8_compute_ops``): a call of it
    is low-precision compute when its two matrix operands, the arguments at ``operands``, are
    FP8 or packed FP4 tensors; ``scales`` are the positions of its scale arguments (each a tensor
    or a list of tensors), which an FP8 region keeps with it.

    ``op`` names it: a ``torch._ops.OpOverload`` (that overload), an ``OpOverloadPacket`` (every
    overload), or its qualified name as text, ``"aten._scaled_mm"`` or ``"mylib::scaled_addmm_"``
    (every overload) or ``"mylib::scaled_addmm_.default"`` (one)."""

    op: Any
    operands: tuple[int, int] = (0, 1)
    scales: tuple[int, ...] = (2, 3)

    def __post_init__(self):
        ops = self.operands
        if not (isinstance(ops, tuple) and len(ops) == 2 and all(isinstance(i, int) and i >= 0 for i in ops) and ops[0] != ops[1]):
            raise TypeError(f"ComputeOp({self.op!r}): operands must be two distinct argument positions, got {ops!r}")
        if not (isinstance(self.scales, tuple) and all(isinstance(i, int) and i >= 0 for i in self.scales)):
            raise TypeError(f"ComputeOp({self.op!r}): scales must be a tuple of argument positions, got {self.scales!r}")

    @property
    def name(self) -> str:
        """The op as ``str(node.target)`` reads: ``"mylib.scaled_addmm_.default"``, or for every
        overload the packet's name with a trailing dot (``"aten._scaled_mm."``)."""
        if isinstance(self.op, str):
            text = self.op.replace("::", ".")
            return text if text.count(".") >= 2 or text.endswith(".") else text + "."
        if hasattr(self.op, "overloadpacket"):  # an OpOverload
            return str(self.op)
        return f"{self.op}."

    def matches(self, target) -> bool:
        name, text = self.name, str(target)
        return text.startswith(name) if name.endswith(".") else text == name


#: torch's scaled matmuls, what a backend declares unless it says otherwise: the first API
#: (``torch._scaled_mm``, its grouped form) with scales at 2 and 3, the second (``F.scaled_mm``,
#: ``F.scaled_grouped_mm``) with its scale lists at 2 and 5.
TORCH_COMPUTE_OPS = (
    ComputeOp("aten._scaled_mm", (0, 1), (2, 3)),
    ComputeOp("aten._scaled_grouped_mm", (0, 1), (2, 3)),
    ComputeOp("aten._scaled_mm_v2", (0, 1), (2, 5)),
    ComputeOp("aten._scaled_grouped_mm_v2", (0, 1), (2, 5)),
)


@dataclasses.dataclass(frozen=True)
class Provenance:
    """Which quantized module issued a node, and with which quantization config.

    ``kind`` is ``"float8_linear"``, ``"mxfp8_linear"``, ``"float8_scaled_mm_linear"``,
    ``"nvfp4_linear"`` or ``"float8_grouped_experts"``; ``recipe`` is the recipe name
    (``"tensorwise"``, ``"rowwise"``, ``"rowwise_with_gw_hp"``, ``"mxfp8"``, ...), or None for a
    backend that records no recipe (``Backend.provenance_has_recipe = False``: PROV-002 then
    checks kind and emulate only, and its report row says so).
    """

    module_fqn: str
    kind: str
    recipe: str | None
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


#: The fields of :class:`StageSplit` that describe the AOT calling convention.
AOT_SPLIT_FIELDS = ("num_outputs", "saved_for_input", "saved_for_weight", "input_grads", "param_grads", "output_layout")


@dataclasses.dataclass(frozen=True)
class StageSplit:
    """A stage's joint graph cut for zero-bubble pipelining (capability ``graphpp``): three
    ``torch.fx.GraphModule`` callables, on which the suite checks the node-level rules, and how
    they are run. A backend says how in one of two ways.

    **A runner** (``run``; any tracer): ``run`` is called exactly like the joint graph is (the
    backend's own convention, through ``Backend.run_joint(gm, ..., fn=split.run)``) and returns
    what the joint graph returns. It must call ``forward``, then ``backward_input``, then
    ``backward_weight``, each once, and compute nothing itself: the suite counts the calls,
    checks their order, and checks that every tensor ``backward_weight`` receives was returned
    by ``forward`` or ``backward_input`` or given to ``run`` (BND-001).

    **The AOT convention** (``run`` None; the convention fields set), which the suite wires
    itself (``conformance.run.stages``):

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
    num_outputs: int | None = None
    saved_for_input: tuple | None = None
    saved_for_weight: tuple | None = None
    input_grads: tuple | None = None
    param_grads: tuple | None = None
    output_layout: tuple | None = None
    run: object = None

    @property
    def parts(self) -> dict:
        return {"forward": self.forward, "backward_input": self.backward_input, "backward_weight": self.backward_weight}

    def missing_convention(self) -> tuple[str, ...]:
        """The AOT convention fields left None by a split without a runner (empty: it can run)."""
        if self.run is not None:
            return ()
        return tuple(name for name in AOT_SPLIT_FIELDS if getattr(self, name) is None)


@dataclasses.dataclass(frozen=True)
class JobConfigs:
    """Configurations of a backend's own training job, for FPR-006 (capability ``fingerprint``).

    The suite does not look inside them: it passes each to
    ``Backend.quantization_signature(model, config=...)`` and ``Backend.fingerprint(model,
    config=...)``. ``relevant`` maps a label to a configuration that differs from ``base`` in
    one setting that changes quantized numerics (the fingerprint must change, and the signature
    too where it holds every input of the fingerprint); ``unrelated`` one that differs in a
    setting that does not (the signature must not change, nor a ``"quantization"``-scope
    fingerprint). The labels are shown in failures.
    """

    base: object
    relevant: dict
    unrelated: dict
