"""fp8conf: reference passes that keep FP8 intact through graph tracing, rewriting and compilation.

The pipeline, one module per stage: :func:`trace_joint` (trace + provenance) ->
:func:`validate_fp8_graph` -> :func:`identify_fp8_regions` / :func:`tag_fp8_regions` ->
:func:`compile_joint` or :func:`split_stage` (GraphPP; :mod:`fp8conf.pipeline` runs the split
callables as pipeline stages) -> :class:`QuantizationSignature` (precompile fingerprints).
"""

from fp8conf.compile import CompiledJoint, compile_joint
from fp8conf.config import INDUCTOR_MODES, FP8CompileConfig
from fp8conf.errors import (
    ComputeCountError,
    FP8ConfigError,
    FP8Error,
    FP8TraceError,
    FP8ValidationError,
    FP8ValidationWarning,
    MissingProvenanceError,
    IncompleteRegionError,
    NoQuantizedModulesError,
    RegionCompileError,
    UnsupportedLoweringError,
)
from fp8conf.errors import FP8GraphSplitError
from fp8conf.errors import ArtifactError, FingerprintMismatchError
from fp8conf.fingerprint import QuantizationSignature
from fp8conf.precompile import (
    PrecompiledJoint,
    load_artifact,
    load_for_model,
    precompile_joint,
    precompile_model,
    read_header,
    save_artifact,
)
from fp8conf.graphpp import StageSplit, compile_split, split_stage
from fp8conf.provenance import PROVENANCE_META_KEY, CallRecord, Provenance, get_provenance, node_passes
from fp8conf.quantized import QuantizationConfig, find_quantized_modules
from fp8conf.regions import Region, identify_fp8_regions, tag_fp8_regions
from fp8conf.roles import OpRole, classify_node, is_fp8_compute, op_roles
from fp8conf.trace import TraceInfo, copy_graph_module, run_joint, trace_info, trace_joint
from fp8conf.validate import Finding, ValidationReport, validate_fp8_graph

__version__ = "0.1.0"

__all__ = [
    "FP8CompileConfig",
    "INDUCTOR_MODES",
    "FP8Error",
    "FP8ConfigError",
    "FP8TraceError",
    "FP8ValidationError",
    "FP8ValidationWarning",
    "MissingProvenanceError",
    "UnsupportedLoweringError",
    "ComputeCountError",
    "NoQuantizedModulesError",
    "IncompleteRegionError",
    "RegionCompileError",
    "FP8GraphSplitError",
    "CompiledJoint",
    "compile_joint",
    "PROVENANCE_META_KEY",
    "Provenance",
    "CallRecord",
    "get_provenance",
    "node_passes",
    "QuantizationConfig",
    "find_quantized_modules",
    "OpRole",
    "classify_node",
    "is_fp8_compute",
    "op_roles",
    "TraceInfo",
    "trace_joint",
    "trace_info",
    "run_joint",
    "copy_graph_module",
    "Region",
    "identify_fp8_regions",
    "tag_fp8_regions",
    "Finding",
    "ValidationReport",
    "validate_fp8_graph",
    "FingerprintMismatchError",
    "ArtifactError",
    "QuantizationSignature",
    "PrecompiledJoint",
    "precompile_joint",
    "save_artifact",
    "load_artifact",
    "read_header",
    "precompile_model",
    "load_for_model",
    "StageSplit",
    "split_stage",
    "compile_split",
]
