"""Strict validation of FP8 in a joint graph.

Rules checked (conformance IDs in brackets):

* every FP8 compute node carries provenance [VAL-003] - a rewrite that dropped it would
  otherwise make the node invisible to region compilation;
* every call of a non-emulated quantized module has FP8 compute in each pass that needs it
  [VAL-002], as many as its declared config issues [VAL-007]: forward ``matmuls`` (1 for a
  linear); backward as many for grad_input when the call's input needs a gradient and the module
  computes it in FP8, as many for grad_weight unless the module keeps it in high precision
  (``fp8_grad_weight=False``: ``rowwise_with_gw_hp``);
* emulated modules are exempt, one module at a time [EMU-001, EMU-002];
* a graph that is one part of a larger one (a GraphPP callable, :mod:`fp8conf.graph.split`) is
  checked with the FP8 compute the other parts hold counted in (``sibling_compute``, or
  ``gm.meta[SIBLING_COMPUTE_META_KEY]`` where the cutting pass recorded it), so it is never failed
  for compute that lives elsewhere [BND-006];
* every FP8 compute node's scales are of the dtype, shape and layout its scaling takes, as torch's
  Meta kernels check them when the graph compiles (:mod:`fp8conf.graph.scales`; ``VAL-SCALE``,
  a rule of fp8conf's own): a rewrite that swapped, cast or dropped a scale is named here, with
  its module and node, rather than by torch's error at compile or run time.

Validation reads the graph and never writes to it [VAL-005]. Strict mode raises the first
finding as its :class:`~fp8conf.errors.FP8ValidationError` subclass (all findings attached);
non-strict mode warns once per finding and returns the :class:`ValidationReport`.
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Mapping

import torch.fx

# The report types are the contract's own: a report fp8conf makes is what a backend returns.
from fp8contract.types import Finding, ValidationReport
from fp8conf.arguments import require
from fp8conf import errors
from fp8conf.graph.provenance import get_provenance, node_passes, unattributed_fp8_compute
from fp8conf.graph.roles import is_fp8_compute
from fp8conf.graph.scales import SCALE_PROPERTY_ID, scale_findings
from fp8conf.graph.trace import trace_info

__all__ = ["SIBLING_COMPUTE_META_KEY", "Finding", "ValidationReport", "validate_fp8_graph"]

#: Key, in ``gm.meta``, of the FP8 compute that other parts of the same step hold, per
#: ``(module_fqn, call, pass)``: a pass that cuts a graph into parts records it on each part.
SIBLING_COMPUTE_META_KEY = "fp8conf_sibling_compute"

_ERROR_BY_PROPERTY = {
    "VAL-001": errors.NoQuantizedModulesError,
    "VAL-002": errors.UnsupportedLoweringError,
    "VAL-003": errors.MissingProvenanceError,
    "VAL-007": errors.ComputeCountError,
    SCALE_PROPERTY_ID: errors.ScaleMismatchError,
}


def _error_of(finding: Finding, findings=()) -> errors.FP8ValidationError:
    """The typed error strict mode raises for ``finding``, carrying every finding of the run."""
    cls = _ERROR_BY_PROPERTY.get(finding.property_id, errors.FP8ValidationError)
    if cls is errors.MissingProvenanceError and finding.module_fqn is not None:
        cls = errors.UndeclaredFP8ModuleError  # the compute's owner is known: a module, not a rewrite
    message = finding.message
    if len(findings) > 1:
        message += f"\n({len(findings) - 1} more finding(s): " + "; ".join(f.message for f in findings[1:4]) + ")"
    return cls(
        message,
        module_fqn=finding.module_fqn,
        pass_name=finding.pass_name,
        node_name=finding.node_name,
        property_id=finding.property_id,
        findings=findings,
    )


def validate_fp8_graph(
    gm: torch.fx.GraphModule, *, strict: bool = True, sibling_compute: Mapping[tuple[str, int, str], int] | None = None
) -> ValidationReport:
    """Check the FP8 rules on a joint graph traced by :func:`fp8conf.trace_joint`.

    ``sibling_compute`` counts, per ``(module_fqn, call, pass)``, FP8 compute that lives in
    other parts of the same step when ``gm`` is one part of it; by default it is read from
    ``gm.meta[SIBLING_COMPUTE_META_KEY]`` (absent: ``gm`` is the whole step).
    """
    require(gm, "graph module", "validate_fp8_graph", "gm")
    info = trace_info(gm)
    if info is None:
        raise errors.FP8ValidationError(
            "the graph carries no fp8conf trace information (gm.meta['fp8conf_trace']); trace it with "
            "fp8conf.trace_joint, and keep gm.meta when a rewrite makes a new GraphModule",
            property_id="VAL-001",
        )
    passes = node_passes(gm.graph)
    findings: list[Finding] = []
    per_call: collections.Counter = collections.Counter()
    witnesses: dict[tuple[str, str], str] = {}
    findings.extend(unattributed_fp8_compute(gm.graph, passes))
    for node in gm.graph.nodes:
        provenance = get_provenance(node) if is_fp8_compute(node) else None
        if provenance is not None:
            per_call[(provenance.module_fqn, provenance.call, passes[node])] += 1
    if not info.modules:
        findings.append(
            Finding(
                "VAL-001",
                f"FP8 validation of {info.model_name}: the model has no quantized module; convert it first "
                "(torchao.float8.convert_to_float8_training or fp8conf.convert_to_mx_training) or disable FP8",
            )
        )
    if sibling_compute is None:
        sibling_compute = gm.meta.get(SIBLING_COMPUTE_META_KEY, {})
    per_call.update(sibling_compute)
    findings.extend(_check_calls(info, per_call, gm, passes, witnesses))
    findings.extend(scale_findings(gm.graph, passes))
    counts: collections.Counter = collections.Counter()
    for (fqn, _call, pass_name), n in per_call.items():
        counts[(fqn, pass_name)] += n
    report = ValidationReport(tuple(findings), dict(counts), _summary(info, counts, findings))
    if findings and strict:
        raise _error_of(findings[0], tuple(findings))
    for finding in findings:
        warnings.warn(f"[{finding.property_id}] {finding.message}", errors.FP8ValidationWarning, stacklevel=2)
    return report


def _expected(config, call) -> dict[str, int]:
    backward = 0
    if config.fp8_grad_input and call.input_requires_grad:
        backward += 1
    if config.fp8_grad_weight and call.weight_requires_grad:
        backward += 1
    return {"forward": config.matmuls, "backward": backward * config.matmuls}


def _check_calls(info, per_call, gm, passes, witnesses) -> list[Finding]:
    findings = []
    for call in info.calls:
        config = info.modules[call.module_fqn]
        if config.emulate:
            continue  # emulated modules compute in high precision on purpose
        for pass_name, expected in _expected(config, call).items():
            found = per_call[(call.module_fqn, call.call, pass_name)]
            if found == expected:
                continue
            where = f"module '{call.module_fqn}' ({config.kind}, recipe {config.recipe}), {pass_name} pass, call {call.call}"
            if found == 0:
                hint = _high_precision_witness(gm, passes, call, pass_name)
                findings.append(
                    Finding(
                        "VAL-002",
                        f"{where}: no FP8 compute, expected {expected} FP8 scaled matmul(s){hint}. The module is "
                        "not emulated, so its matmuls must stay FP8: find the rewrite or lowering that replaced "
                        "them, or mark the module emulate=True if high precision is intended",
                        module_fqn=call.module_fqn,
                        pass_name=pass_name,
                    )
                )
            else:
                findings.append(
                    Finding(
                        "VAL-007",
                        f"{where}: {found} FP8 compute node(s), but the recipe issues {expected} per call",
                        module_fqn=call.module_fqn,
                        pass_name=pass_name,
                    )
                )
    return findings


def _high_precision_witness(gm, passes, call, pass_name) -> str:
    for node in gm.graph.nodes:
        provenance = get_provenance(node)
        if (
            provenance is not None
            and provenance.module_fqn == call.module_fqn
            and provenance.call == call.call
            and passes[node] == pass_name
            and str(node.target) in ("aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten._scaled_mm.default")
        ):
            return f"; found high-precision '{node.name}' ({node.target}) instead"
    return ""


def _summary(info, counts, findings) -> str:
    emulated = sum(1 for c in info.modules.values() if c.emulate)
    forward = sum(n for (_, p), n in counts.items() if p == "forward")
    backward = sum(n for (_, p), n in counts.items() if p == "backward")
    by_id = collections.Counter(f.property_id for f in findings)
    modules = sorted({f.module_fqn for f in findings if f.module_fqn})
    found = "none"
    if findings:
        found = f"{len(findings)} (" + ", ".join(f"{k}: {v}" for k, v in sorted(by_id.items())) + ")"
        found += f" in {', '.join(repr(m) for m in modules)}" if modules else ""
    return (
        f"FP8 validation of {info.model_name}: {len(info.modules)} quantized module(s) ({emulated} emulated), "
        f"{len(info.calls)} call(s); FP8 compute: {forward} forward, {backward} backward; findings: {found}"
    )
