"""fp8conf: reference passes that keep FP8 intact through graph tracing, rewriting and compilation.

The pipeline, one module per stage: :func:`trace_joint` (trace + provenance) ->
:func:`validate_fp8_graph` -> :func:`identify_fp8_regions` / :func:`tag_fp8_regions` ->
:func:`compile_joint` or :func:`split_stage` (GraphPP; :mod:`fp8conf.pipeline` runs the split
callables as pipeline stages) -> :class:`QuantizationSignature` (precompile fingerprints).
"""

import importlib
import importlib.util

# Imported on first use (PEP 562): `fp8conf --help` and tools that only name the package do
# not pay for torch's import, which takes seconds.
_EXPORTS = {
    "fp8conf.compile": ("CompiledJoint", "compile_joint"),
    "fp8conf.config": ("INDUCTOR_MODES", "FP8CompileConfig"),
    "fp8conf.errors": (
        "ComputeCountError", "FP8ConfigError", "FP8Error", "FP8TraceError", "FP8ValidationError",
        "FP8ValidationWarning", "MissingProvenanceError", "IncompleteRegionError",
        "NoQuantizedModulesError", "RegionCompileError", "UnsupportedLoweringError",
        "FP8GraphSplitError", "ArtifactError", "FingerprintMismatchError",
    ),
    "fp8conf.fingerprint": ("QuantizationSignature",),
    "fp8conf.precompile": (
        "PrecompiledJoint", "load_artifact", "load_for_model", "precompile_joint",
        "precompile_model", "read_header", "save_artifact",
    ),
    "fp8conf.graphpp": ("StageSplit", "compile_split", "split_stage"),
    "fp8conf.provenance": (
        "PROVENANCE_META_KEY", "CallRecord", "Provenance", "get_provenance", "node_passes",
    ),
    "fp8conf.quantized": ("QuantizationConfig", "find_quantized_modules"),
    "fp8conf.regions": ("Region", "identify_fp8_regions", "tag_fp8_regions"),
    "fp8conf.roles": ("OpRole", "classify_node", "is_fp8_compute", "op_roles"),
    "fp8conf.trace": ("TraceInfo", "copy_graph_module", "run_joint", "trace_info", "trace_joint"),
    "fp8conf.validate": ("Finding", "ValidationReport", "validate_fp8_graph"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


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


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    # A submodule used as an attribute (``fp8conf.trace``) without being imported first.
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
