"""The user-facing switch board of FP8 graph compilation."""

from __future__ import annotations

import dataclasses

from fp8conf.errors import FP8ConfigError

__all__ = ["FP8CompileConfig", "INDUCTOR_MODES"]

INDUCTOR_MODES = ("none", "full", "regional")


@dataclasses.dataclass(frozen=True)
class FP8CompileConfig:
    """How a graph trainer treats the FP8 modules of a traced training step.

    Attributes:
        enabled: run the FP8 passes (provenance, validation, regions) at all.
        strict: raise on the first broken FP8 rule instead of warning; a strict run never
            falls back silently to high-precision or eager execution.
        inductor_mode: ``"none"`` (run the graph eagerly), ``"full"`` (compile the whole joint
            graph with Inductor) or ``"regional"`` (compile only the complete FP8 regions).
        cudagraph: capture and replay the compiled graph with CUDA graphs (CUDA only).
    """

    enabled: bool = True
    strict: bool = True
    inductor_mode: str = "none"
    cudagraph: bool = False

    def __post_init__(self):
        if self.inductor_mode not in INDUCTOR_MODES:
            raise FP8ConfigError(
                f"FP8CompileConfig.inductor_mode={self.inductor_mode!r} is not one of {INDUCTOR_MODES}"
            )
        if self.strict and not self.enabled:
            raise FP8ConfigError(
                "FP8CompileConfig(strict=True, enabled=False) asks to enforce FP8 rules with the FP8 "
                "passes switched off; set enabled=True, or strict=False to skip FP8 handling"
            )
        if self.inductor_mode == "regional" and not self.enabled:
            raise FP8ConfigError(
                "FP8CompileConfig(inductor_mode='regional', enabled=False): regional compilation needs "
                "the FP8 regions, which are only identified when enabled=True"
            )
        if self.cudagraph and self.inductor_mode == "none":
            raise FP8ConfigError(
                "FP8CompileConfig(cudagraph=True, inductor_mode='none'): CUDA graphs replay a compiled "
                "graph; choose inductor_mode='full' or 'regional'"
            )
