"""What becomes of a regional unit that Inductor cannot compile: compile what it can, say what it cannot.

A unit whose CPU kernel code the C++ compiler rejects (a ``CppCompileError``, a bug of Inductor's
C++ code generation, not of the graph) is compiled once more with the one Inductor setting known
to avoid such a bug (:data:`RETRY_PATCHES`), for that unit alone; that it took the retry is said
once through the ``fp8conf`` logger and counted in ``CompiledJoint.fallbacks``. A unit that still
does not compile, or that Inductor rejected otherwise (a lowering it lacks), is refused under
``strict`` (a :class:`~fp8conf.errors.RegionCompileError` naming the region and torch's error);
without ``strict`` it runs eagerly, said and counted too.

The known case (torch 2.13, CPU): a bf16 SwiGLU block under TorchAO's rowwise ``Float8Linear``.
In its backward, ``w1`` and ``w3`` each cast the block's input column-wise for their weight
gradient: two identical ``amax(abs(x), dim=0)`` reductions, which regional compile keeps apart
because each belongs to its own region (``torch.compile``'s CSE of the whole joint graph would have
merged them). Inductor fuses the two horizontally into one kernel, its reduction CSE gives them one
accumulator, and its vectorized store of a column-wise (vertical) reduction into a bf16 buffer
declares the converted accumulator, ``auto at_BFloat16_tmp_acc0_vec = ...``, once per output
buffer in one scope: g++ refuses the second declaration (``CppVecKernel.store_reduction``).
``cpp.max_horizontal_fusion_size=1`` keeps Inductor from fusing sibling nodes on CPU, so each
reduction gets a kernel of its own; vectorization, and the fusion of each reduction with what
consumes it, stay as they were, and the values are those of Inductor's default code.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import torch.fx

from fp8conf.graph.regions import REGION_META_KEY
from fp8conf.log import fell_back

__all__ = ["RETRY_PATCHES", "CppCodegenError", "error_chain", "cpp_codegen_error", "torch_error", "unit_name", "settle"]

#: Inductor settings of the retry (``torch._inductor.config.patch`` keys), applied to the
#: failing unit's compile alone. The narrowest setting found that gets the known case compiled:
#: vectorization off (``cpp.simdlen=1``) does too, but slows every kernel of the unit and its
#: compile (20 s against 11 s for the known case's step); ``cpp.enable_tiling_heuristics=False``
#: does not avoid it.
RETRY_PATCHES = {"cpp.max_horizontal_fusion_size": 1}

#: The type names, anywhere in an error's chain, of a C++ compile error of Inductor's CPU code
#: (``CUDACompileError``, a subclass, is nvcc's, which the retry's CPU setting cannot help).
_CPP_ERRORS = ("CppCompileError",)


class CppCodegenError(RuntimeError):
    """Inductor's CPU C++ code for a unit did not compile, neither as generated first nor under
    :data:`RETRY_PATCHES`: the first line of each of torch's errors, and the compiler's first
    complaint (the whole errors are chained)."""


def error_chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and what it wraps: its cause or context, and the inner exception of torch's
    ``InductorError``."""
    seen: list[BaseException] = []
    while exc is not None and not any(exc is e for e in seen):
        seen.append(exc)
        exc = getattr(exc, "inner_exception", None) or exc.__cause__ or exc.__context__
    return seen


def cpp_codegen_error(exc: BaseException) -> bool:
    """Whether ``exc`` is, or wraps, a C++ compile error of Inductor's CPU code. An error from a
    compile worker (:mod:`fp8conf.compile.workers`) crosses the process boundary as text, with
    the type names of the worker's chain in its ``causes``."""
    for error in error_chain(exc):
        if type(error).__name__ in _CPP_ERRORS or any(name in _CPP_ERRORS for name in getattr(error, "causes", ())):
            return True
    return False


def torch_error(exc: BaseException) -> str:
    """One line for ``exc``: its type and first line, and for a C++ compile error the compiler's
    first complaint (a ``CppCompileError``'s first line says only "C++ compile error")."""
    text = str(exc).strip()
    line = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")
    complaint = re.search(r"\berror: ([^\n]+)", text)
    if complaint and cpp_codegen_error(exc):
        line += f": {complaint.group(1).strip()}"
    return line


def unit_name(nodes: Sequence[torch.fx.Node]) -> str:
    """A unit as a person finds it in the graph: the FP8 regions it holds (each id naming the
    module, pass and call), or, holding none, where it starts and ends."""
    regions = list(dict.fromkeys(
        region for n in nodes
        if (region := ((n.meta.get("custom") or {}).get("compile_with_inductor") or {}).get(REGION_META_KEY)) is not None
    ))
    span = f"a unit of {len(nodes)} nodes from '{nodes[0].name}' to '{nodes[-1].name}'"
    if not regions:
        return f"{span}, in no FP8 region"
    others = f", with region(s) {', '.join(regions[1:])}" if len(regions) > 1 else ""
    return f"FP8 region {regions[0]} ({span}{others})"


def settle(exc: Exception, retry: Callable[[], Callable], *, unit: str, strict: bool,
           error: Callable[[Exception], Exception]) -> tuple[Callable | None, str]:
    """What to run for a unit whose compile raised ``exc``: ``(compiled, fallback line)``, or
    ``(None, line)`` where the unit is to run eagerly; raises ``error(...)`` (a
    :class:`~fp8conf.errors.RegionCompileError` naming the unit's region) under ``strict``.

    ``retry()`` compiles the unit again in this process under :data:`RETRY_PATCHES` and waits for
    its kernels; it is called once, and only for a C++ compile error. ``unit`` names the unit
    (:func:`unit_name`) in the line logged."""
    setting = "Inductor's " + ", ".join(f"{k}={v!r}" for k, v in RETRY_PATCHES.items())
    failure, cause = exc, exc
    if cpp_codegen_error(exc):
        try:
            compiled = retry()
        except Exception as again:
            failure = CppCodegenError(f"Inductor's CPU C++ code for it does not compile: {torch_error(exc)}; "
                                      f"nor with {setting}: {torch_error(again)}")
            cause = again  # the first error is summed up in the message
        else:
            return compiled, fell_back(
                "CPU C++ codegen", f"Inductor's C++ code for {unit} does not compile ({torch_error(exc)}); "
                f"compiled again with {setting}", "that unit's kernels are not fused side by side (more passes over memory)")
    if strict:
        raise error(failure) from cause
    return None, fell_back("regional compile", f"Inductor could not compile {unit}: {torch_error(failure)}",
                           "that unit runs eagerly (strict=True refuses it)")
