"""Mutant backends for the contract points peers implement: empty region reports, split
runners that compute on their own, and signatures blind to the backend's job configuration.

``MUTANTS`` are the reference with one defect; ``MAKEFX_MUTANTS`` the ``makefx`` backend with
one (their properties are checked on ``makefx`` itself, which implements them differently)."""

from __future__ import annotations

from conformance.api.types import StageSplit
from conformance.backends.makefx import MakeFxBackend
from conformance.backends.reference import ReferenceBackend


class NoRegions(ReferenceBackend):
    """Reports no region at all, as a region pass that only admits CUDA nodes does on CPU: every
    region rule would pass on nothing."""

    name = "mutant-no-regions"
    KILLED_BY = "REG-003"

    def regions(self, gm):
        return []


class RunnerRunsTheJointGraph(MakeFxBackend):
    """Its split runner runs the unsplit step instead of the three graphs it returned."""

    name = "mutant-runner-runs-the-joint-graph"
    KILLED_BY = "BND-001"

    def split_stage(self, gm, *, strict=True):
        split = super().split_stage(gm, strict=strict)
        return StageSplit(split.forward, split.backward_input, split.backward_weight, run=gm)


class JobConfigIgnored(MakeFxBackend):
    """Its signature leaves out the job configuration, so a bfloat16-autocast job would load an
    artifact built for a float32 one."""

    name = "mutant-job-config-ignored"
    KILLED_BY = "FPR-006"

    def quantization_signature(self, model, *, strict=True, config=None):
        return super().quantization_signature(model, strict=strict)


MUTANTS = [NoRegions]
MAKEFX_MUTANTS = [RunnerRunsTheJointGraph, JobConfigIgnored]
