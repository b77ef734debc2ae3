"""Importing the compile stack before any first step is timed.

torch imports Inductor, AOTAutograd and Triton's compiler lazily, on the first compilation. In a
process that times several variants one after the other, the first variant to compile would pay
for those imports in its "first step" and the others would not; a machine that does not cache
bytecode (``PYTHONDONTWRITEBYTECODE``) makes them several seconds. The benchmarks import them once
up front, so that every first step they report is compilation and running, not module loading.
"""

from __future__ import annotations

import importlib
import time

#: What a compiling variant imports on its first step, whichever it is.
MODULES = (
    "torch._functorch.aot_autograd",
    "torch._functorch.partitioners",
    "torch._inductor.compile_fx",
    "torch._inductor.codecache",
    "torch._inductor.standalone_compile",
    "torch._inductor.lowering",
    "torch._inductor.scheduler",
    "torchao.float8",
    "fp8conf.compile.joint",
    "fp8conf.artifacts.store",
)
CUDA_MODULES = ("torch._inductor.codegen.triton", "triton.compiler.compiler")


def import_compile_stack(device: str) -> float:
    """Import :data:`MODULES` (and, on CUDA, Triton's code generation); the seconds it took."""
    start = time.perf_counter()
    for name in MODULES + (CUDA_MODULES if device == "cuda" else ()):
        importlib.import_module(name)
    return time.perf_counter() - start
