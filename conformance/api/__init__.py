"""The contract a backend implements, importable without torch or fp8conf.

Everything a backend author needs: :class:`Backend`, the neutral value types, the error protocol
(:mod:`conformance.api.errors`), the spec registry and :data:`CAPABILITIES`. Nothing here imports
torch, Hypothesis, pytest or fp8conf.
"""

from conformance.api.backend import Backend
from conformance.api.errors import ContractError, FingerprintMismatch, SplitFailure, UnsupportedConfig, ValidationFailure
from conformance.api.spec import PROPERTIES, SPEC_VERSION, Property, get_property
from conformance.api.types import (
    CAPABILITIES,
    TORCH_COMPUTE_OPS,
    ComputeOp,
    FINGERPRINT_SCOPES,
    FLOAT8_RECIPES,
    MX_RECIPES,
    PASSES,
    WEIGHT_GATHERS,
    Compiled,
    Finding,
    JobConfigs,
    Provenance,
    Region,
    StageSplit,
    ValidationReport,
)

__all__ = [
    "Backend",
    "CAPABILITIES",
    "ComputeOp",
    "TORCH_COMPUTE_OPS",
    "FINGERPRINT_SCOPES",
    "FLOAT8_RECIPES",
    "MX_RECIPES",
    "PASSES",
    "WEIGHT_GATHERS",
    "Provenance",
    "Finding",
    "JobConfigs",
    "ValidationReport",
    "Region",
    "Compiled",
    "StageSplit",
    "ContractError",
    "ValidationFailure",
    "SplitFailure",
    "FingerprintMismatch",
    "UnsupportedConfig",
    "SPEC_VERSION",
    "Property",
    "PROPERTIES",
    "get_property",
]
