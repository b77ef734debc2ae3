"""The weight all-gathers of a sharded step against its float8 all-gather setting.

The failure users meet most with sharded FP8 training is silent: float8 all-gather is on, yet
the traced step gathers the weights in high precision (a tracer or a rewrite that bypasses
TorchAO's FSDP hooks), so every step moves two or four times the bytes and nothing says so; or
the reverse, FP8 bytes on the wire where the layout says high precision.
:func:`validate_weight_all_gathers` holds every forward all-gather of a quantized module's weight
(:class:`~fp8conf.graph.collectives.CollectiveRecord` on the node; a gather nobody annotated is
attributed through the graph, from its input back to the parameter's placeholder) to the setting:

* on: it moves FP8 bytes, one byte per element (the FP8 tensor itself, or viewed as integers),
  and the gathered bytes reach the module's FP8 matmul, whose scale operand is computed beside
  them, never gathered (an emulated module, which computes in high precision on purpose, is held
  to the bytes alone); none is gathered in high precision;
* off: none moves FP8;
* a quantized weight the layout shards is gathered at least once per call of its module.

The setting comes from the :class:`~fp8conf.parallel.layout.ParallelLayout` that tracing recorded
(``TraceInfo.layout``), per weight, or from ``float8_all_gather`` for every quantized weight.
Reads the graph only. Strict mode raises the first finding as a
:class:`~fp8conf.errors.WeightAllGatherError` naming the module, the pass and the node.
"""

from __future__ import annotations

import collections
import dataclasses
import warnings

import torch.fx

from fp8contract.types import Finding
from fp8conf import errors
from fp8conf.arguments import require
from fp8conf.graph.collectives import CollectiveRecord, get_collective, is_collective
from fp8conf.graph.provenance import node_passes
from fp8conf.graph.roles import is_fp8_compute, is_fp8_dtype
from fp8conf.graph.trace import joint_signature, trace_info

__all__ = ["PROPERTY_ID", "OFF_PROPERTY_ID", "WeightGatherReport", "validate_weight_all_gathers"]

#: The spec rule findings of this check carry (conformance/SPEC.md): DP-001 for weights that
#: float8 all-gather should gather as FP8, DP-002 for FP8 gathered with it off.
PROPERTY_ID = "DP-001"
OFF_PROPERTY_ID = "DP-002"

@dataclasses.dataclass(frozen=True)
class WeightGatherReport:
    """What :func:`validate_weight_all_gathers` found. ``gathers`` counts the forward all-gathers
    of quantized weights per ``(module_fqn, "float8" | "high_precision")``."""

    findings: tuple[Finding, ...]
    gathers: dict[tuple[str, str], int]
    summary: str

    @property
    def ok(self) -> bool:
        return not self.findings


# Ops a gathered weight passes through on its way to the matmul: waits, dtype views, layout.
_TO_MATMUL = frozenset({
    "aten.view.dtype", "aten.view.default", "aten.detach.default", "aten.t.default", "aten.clone.default",
    "aten.contiguous.default", "aten.permute.default", "aten.transpose.int", "aten.reshape.default", "aten.alias.default",
})


def validate_weight_all_gathers(
    gm: torch.fx.GraphModule, *, float8_all_gather: bool | None = None, strict: bool = True
) -> WeightGatherReport:
    """Check the forward all-gathers of quantized weights in ``gm`` against the float8
    all-gather setting (see the module docstring) and return what was found."""
    require(gm, "graph module", "validate_weight_all_gathers", "gm")
    info = trace_info(gm)
    layout = info.layout if info is not None else None
    if float8_all_gather is None and layout is None:
        raise errors.FP8ConfigError(
            "validate_weight_all_gathers: the graph records no parallel layout (TraceInfo.layout) and no "
            "float8_all_gather setting was given; trace a model sharded by fp8conf.parallel.shard_data_parallel, "
            "or pass float8_all_gather=True/False"
        )
    expected = _expected_settings(info, layout, float8_all_gather)
    passes = node_passes(gm.graph)
    owners = _parameter_of_placeholder(gm)
    gathers: dict[str, list[tuple[torch.fx.Node, CollectiveRecord | None]]] = collections.defaultdict(list)
    for node in gm.graph.nodes:
        if not is_collective(node) or passes[node] != "forward" or node.target.__name__.split(".")[0] == "wait_tensor":
            continue
        record = get_collective(node)
        if record is not None and record.op != "all_gather":
            continue
        if record is None and "all_gather" not in node.target.__name__:
            continue
        parameter = record.parameter if record is not None and record.parameter else _traced_parameter(node, owners)
        if parameter in expected:
            gathers[parameter].append((node, record))
    findings, counts = [], collections.Counter()
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    in_graph_order = sorted(expected.items(), key=lambda item: (min((order[n] for n, _ in gathers.get(item[0], [])), default=len(order)), item[0]))
    for parameter, (module_fqn, want_fp8) in in_graph_order:
        found = gathers.get(parameter, [])
        if not found:
            findings.append(Finding(
                PROPERTY_ID if want_fp8 else OFF_PROPERTY_ID,
                f"sharded weight '{parameter}' of module '{module_fqn}' is never all-gathered in the forward pass; a "
                "rewrite dropped the gather, or the module ran on its shard: keep the gathers shard_data_parallel traces",
                module_fqn=module_fqn, pass_name="forward",
            ))
        config = info.modules.get(module_fqn) if info is not None else None
        for node, record in found:
            moves_fp8, problem = _judge(node, record, want_fp8, emulated=bool(config and config.emulate))
            counts[(module_fqn, "float8" if moves_fp8 else "high_precision")] += 1
            if problem:
                findings.append(Finding(
                    PROPERTY_ID if want_fp8 else OFF_PROPERTY_ID,
                    f"module '{module_fqn}', forward pass, all-gather '{node.name}' of weight '{parameter}': {problem}",
                    module_fqn=module_fqn, pass_name="forward", node_name=node.name,
                ))
    report = WeightGatherReport(tuple(findings), dict(counts), _summary(expected, counts, findings))
    if findings and strict:
        first = findings[0]
        more = f"\n({len(findings) - 1} more finding(s): " + "; ".join(f.message for f in findings[1:4]) + ")" if len(findings) > 1 else ""
        raise errors.WeightAllGatherError(
            first.message + more, module_fqn=first.module_fqn, pass_name=first.pass_name, node_name=first.node_name,
            property_id=first.property_id, findings=tuple(findings),
        )
    for finding in findings:
        warnings.warn(f"[{finding.property_id}] {finding.message}", errors.FP8ValidationWarning, stacklevel=2)
    return report


def _expected_settings(info, layout, float8_all_gather) -> dict[str, tuple[str, bool]]:
    """Weight FQN -> (module FQN, gathered as FP8?) for every sharded quantized weight."""
    if layout is not None:
        quantized = [p for p in layout.parameters if p.quantized_weight]
        return {p.fqn: (p.module_fqn, p.float8_all_gather if float8_all_gather is None else bool(float8_all_gather)) for p in quantized}
    modules = info.modules if info is not None else {}
    return {f"{fqn}.weight" if fqn else "weight": (fqn, bool(float8_all_gather)) for fqn, c in modules.items() if c.kind == "float8_linear"}


def _judge(node, record, want_fp8, *, emulated: bool) -> tuple[bool, str | None]:
    """(moves FP8?, what is wrong or None)."""
    if record is not None:
        moves_fp8, element_size, wire = record.float8, record.element_size, record.wire_dtype
    else:
        from fp8conf.graph.collectives import bitcast_source_dtype

        value = node.args[0] if node.args else None
        dtype = getattr(getattr(value, "meta", {}).get("val"), "dtype", None)
        moves_fp8 = is_fp8_dtype(dtype) or is_fp8_dtype(bitcast_source_dtype(value) if value is not None else None)
        element_size, wire = (dtype.itemsize if dtype is not None else 0), str(dtype)
    if want_fp8 and not moves_fp8:
        return False, (
            f"moves {wire} ({element_size} bytes per element) although float8 all-gather is on: the weight is gathered in "
            "high precision and cast after the gather, so FP8 is lost on the wire. Gather through TorchAO's "
            "fsdp_pre_all_gather/fsdp_post_all_gather (shard_data_parallel does), or turn float8 all-gather off"
        )
    if not want_fp8 and moves_fp8:
        return True, (
            f"moves FP8 bytes although float8 all-gather is off for it; convert the module with "
            "Float8LinearConfig(enable_fsdp_float8_all_gather=True) so the layout says so, or gather it in high precision"
        )
    if moves_fp8 and element_size != 1:
        return True, f"moves FP8 as {wire}, {element_size} bytes per element; FP8 travels one byte per element"
    if moves_fp8 and not emulated and not _reaches_fp8_matmul(node):
        return True, (
            "moves FP8 bytes that reach no FP8 matmul (scaled matmul with the gathered bytes as an FP8 operand and "
            "the scale beside them); the gathered weight is dequantized or recast before use"
        )
    return moves_fp8, None


def _reaches_fp8_matmul(gather: torch.fx.Node) -> bool:
    seen, stack = {gather}, [gather]
    while stack:
        for user in stack.pop().users:
            if user in seen:
                continue
            seen.add(user)
            if is_fp8_compute(user):
                return True
            if (is_collective(user) and "wait_tensor" in user.target.__name__) or str(user.target) in _TO_MATMUL:
                stack.append(user)
    return False


def _parameter_of_placeholder(gm) -> dict[torch.fx.Node, str]:
    signature = joint_signature(gm)
    if signature is None:
        return {}
    placeholders = gm.graph.find_nodes(op="placeholder")
    return {p: spec.target for p, spec in zip(placeholders, signature.inputs) if spec.kind == "param"}


def _traced_parameter(gather: torch.fx.Node, owners) -> str | None:
    """The one parameter whose placeholder the gathered value comes from (None if not one)."""
    found, seen, stack = set(), {gather}, list(gather.all_input_nodes)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in owners:
            found.add(owners[node])
        stack.extend(node.all_input_nodes)
    return next(iter(found)) if len(found) == 1 else None


def _summary(expected, counts, findings) -> str:
    fp8 = sum(n for (_, kind), n in counts.items() if kind == "float8")
    high = sum(n for (_, kind), n in counts.items() if kind == "high_precision")
    on = sum(1 for _, want in expected.values() if want)
    return (
        f"weight all-gathers: {len(expected)} sharded quantized weight(s), float8 all-gather on for {on}; "
        f"{fp8} FP8 and {high} high-precision gather(s); findings: {len(findings) or 'none'}"
    )
