"""fp8conf's conformance suite: the FP8 region-compilation spec as property-based tests.

Importing this package does not import torch; the pytest plugin stays inert until
``--fp8-backend`` is given.
"""

from conformance.adapter import Backend
from conformance.types import CAPABILITIES, PASSES, Compiled, Finding, Provenance, Region, StageSplit, ValidationReport

__all__ = ["Backend", "CAPABILITIES", "Compiled", "PASSES", "Finding", "Provenance", "Region", "StageSplit", "ValidationReport"]
