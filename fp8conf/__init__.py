"""fp8conf: reference passes that keep FP8 intact through graph tracing, rewriting and compilation.

The pipeline, one folder per layer and one module per stage (:mod:`fp8conf.graph`):
:func:`trace_joint` (joint graph, :class:`JointSignature`, provenance) -> :func:`op_roles` ->
:func:`validate_fp8_graph` -> :func:`identify_fp8_regions` / :func:`tag_fp8_regions` ->
:func:`split_stage` (GraphPP; :mod:`fp8conf.pipeline` runs the split callables as pipeline
stages); for a sharded step (:mod:`fp8conf.parallel`), :func:`validate_weight_all_gathers` over
the collectives' :class:`CollectiveRecord` s. The compile engine (:mod:`fp8conf.compile`) takes the stages' results:
:func:`compile_joint` / :func:`compile_split` under one :class:`CompileConfig`. Then :mod:`fp8conf.artifacts` (:class:`QuantizationSignature`,
signed, fingerprint-checked precompiled artifacts) and :mod:`fp8conf.quantized` (module discovery,
:class:`MXLinear` and its e8m0 op). Every error is an :class:`FP8Error` (:mod:`fp8conf.errors`).
"""

import importlib

# Errors are light and imported now; everything else on first use (PEP 562), so that
# `fp8conf --help` and tools that only name the package do not pay for torch's import.
from fp8conf import errors as _errors
from fp8conf.errors import *  # noqa: F401,F403  (the error tree, fp8conf.errors.__all__)

_EXPORTS = {
    "fp8conf.quantized.protocol": ("QuantizationConfig", "QuantizedModule", "find_quantized_modules", "register_quantized_module"),
    "fp8conf.quantized.mx": ("MXLinear", "convert_to_mx_training"),
    "fp8conf.quantized.grouped": ("Float8GroupedExperts", "convert_to_float8_grouped_experts"),
    "fp8conf.quantized.scaled_mm": ("ScaledMMLinear", "convert_to_scaled_mm_training"),
    "fp8conf.quantized.nvfp4": ("NVFP4Linear", "convert_to_nvfp4_training"),
    "fp8conf.graph.trace": ("JointSignature", "TraceInfo", "copy_graph_module", "joint_signature", "run_joint", "trace_info", "trace_joint"),
    "fp8conf.graph.provenance": ("PROVENANCE_META_KEY", "CallRecord", "Provenance", "get_provenance", "node_passes"),
    "fp8conf.graph.roles": ("OpRole", "classify_node", "is_fp8_compute", "op_roles", "register_compute_op"),
    "fp8conf.graph.validate": ("Finding", "ValidationReport", "validate_fp8_graph"),
    "fp8conf.graph.regions": ("Region", "identify_fp8_regions", "tag_fp8_regions"),
    "fp8conf.graph.split": ("StageSplit", "split_stage"),
    "fp8conf.graph.collectives": ("CollectiveRecord", "get_collective"),
    "fp8conf.graph.all_gathers": ("WeightGatherReport", "validate_weight_all_gathers"),
    "fp8conf.compile": ("CompileConfig", "CompiledJoint", "compile_joint", "compile_split"),
    "fp8conf.artifacts.signature": ("QuantizationSignature",),
    "fp8conf.artifacts.store": (
        "PrecompiledJoint", "load_artifact", "load_for_model", "precompile_joint", "precompile_model", "read_header", "save_artifact",
    ),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'fp8conf' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_MODULE_OF))


__version__ = "0.1.0"

__all__ = [
    # errors (fp8conf.errors)
    *_errors.__all__,
    # quantized modules (fp8conf.quantized): the protocol any module declares itself through
    "QuantizationConfig",
    "QuantizedModule",
    "register_quantized_module",
    "find_quantized_modules",
    "MXLinear",
    "convert_to_mx_training",
    "Float8GroupedExperts",
    "convert_to_float8_grouped_experts",
    "ScaledMMLinear",
    "convert_to_scaled_mm_training",
    "NVFP4Linear",
    "convert_to_nvfp4_training",
    # trace (fp8conf.graph.trace)
    "trace_joint",
    "run_joint",
    "JointSignature",
    "joint_signature",
    "TraceInfo",
    "trace_info",
    "copy_graph_module",
    # provenance (fp8conf.graph.provenance)
    "PROVENANCE_META_KEY",
    "Provenance",
    "CallRecord",
    "get_provenance",
    "node_passes",
    # roles (fp8conf.graph.roles)
    "OpRole",
    "classify_node",
    "is_fp8_compute",
    "op_roles",
    "register_compute_op",
    # validate (fp8conf.graph.validate)
    "validate_fp8_graph",
    "ValidationReport",
    "Finding",
    # regions (fp8conf.graph.regions)
    "Region",
    "identify_fp8_regions",
    "tag_fp8_regions",
    # a sharded step's collectives (fp8conf.graph.collectives, fp8conf.graph.all_gathers;
    # the sharding itself: fp8conf.parallel.shard_data_parallel)
    "CollectiveRecord",
    "get_collective",
    "validate_weight_all_gathers",
    "WeightGatherReport",
    # the compile engine (fp8conf.compile)
    "compile_joint",
    "CompileConfig",
    "CompiledJoint",
    "compile_split",
    # GraphPP split (fp8conf.graph.split)
    "split_stage",
    "StageSplit",
    # artifacts (fp8conf.artifacts)
    "QuantizationSignature",
    "precompile_joint",
    "PrecompiledJoint",
    "save_artifact",
    "load_artifact",
    "read_header",
    "precompile_model",
    "load_for_model",
]
