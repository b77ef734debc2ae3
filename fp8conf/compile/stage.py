"""Compiling a GraphPP stage: each of :func:`fp8conf.split_stage`'s callables compiled by
:func:`~fp8conf.compile.joint.compile_joint` under one :class:`~fp8conf.CompileConfig`.

The split itself is a pipeline stage (:mod:`fp8conf.graph.split`) and knows nothing of the
engine; compiling its parts is the engine's work, so it lives here.
"""

from __future__ import annotations

from collections.abc import Callable

from fp8conf.arguments import require
from fp8conf.compile.config import CompileConfig
from fp8conf.compile.joint import compile_joint
from fp8conf.graph.split import StageSplit

__all__ = ["compile_split"]


def compile_split(split: StageSplit, config: CompileConfig | None = None, *, mode: str | None = None, strict: bool | None = None,
                  cudagraph: bool | None = None) -> dict[str, Callable]:
    """Compile each callable of ``split`` with :func:`fp8conf.compile_joint` (``"regional"``: its
    complete FP8 regions, re-identified in that callable, with FP8 placeholders as boundaries;
    ``"full"``: all of it), under ``config`` (a :class:`~fp8conf.CompileConfig`) or the keywords
    that make one (defaults ``mode="regional"``, ``strict=True``, ``cudagraph=False``). Returns
    the ``fns`` mapping :meth:`StageSplit.run` and the pipeline runner take."""
    require(split, StageSplit, "compile_split", "split", "a StageSplit (what fp8conf.split_stage(gm) returns)")
    config = CompileConfig.of(config, "compile_split", mode=mode, strict=strict, cudagraph=cudagraph)
    return {name: compile_joint(part, config) for name, part in split.parts.items()}
