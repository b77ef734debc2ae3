"""The one home of the torch internals fp8conf uses.

fp8conf's speed rests on private torch symbols (``torch._inductor``, ``torch._functorch``,
``torch._dynamo``, private attributes). :data:`INTERNALS` names every one that a module of
``fp8conf/`` or ``conformance/`` mentions (``tests/test_torch_internals.py`` scans for those not
listed); :func:`probe` says whether one is found on the installed torch; :func:`fast_paths` lists
fp8conf's fast paths, each with whether it is taken here and why not; :func:`async_compile_wait_patched`
installs fp8conf's one patch of Inductor (``AsyncCompile.wait``) once, guarded by its probe, and
restores the original when the last user leaves, also on error. :data:`NEWER_INTERNALS` names
those that only newer torch releases have, which fp8conf uses where found (:func:`inductor_lowers_e8m0`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import threading

from fp8conf.log import logger

__all__ = ["INTERNALS", "NEWER_INTERNALS", "TESTED_TORCH", "Probe", "probe", "failed_probes", "FastPath",
           "fast_paths", "async_compile_wait_patched", "inductor_lowers_e8m0", "v_schedules_start_on_gloo"]

#: The range of torch versions this release was tested with (also ``[tool.fp8conf]`` in pyproject.toml).
TESTED_TORCH = ">=2.11,<2.15"

#: Every private torch symbol fp8conf and its conformance suite use, by dotted name.
INTERNALS: tuple[str, ...] = (
    "torch._C._dispatch_has_kernel_for_dispatch_key",
    "torch._dynamo",
    "torch._dynamo.allow_in_graph",
    "torch._dynamo.disable",
    "torch._dynamo.reset",
    "torch._dynamo.testing",
    "torch._dynamo.testing.CompileCounterWithBackend",
    "torch._functorch",
    "torch._functorch._aot_autograd",
    "torch._functorch._aot_autograd.descriptors",
    "torch._functorch.aot_autograd",
    "torch._functorch.aot_autograd.aot_export_joint_with_descriptors",
    "torch._functorch.compile_utils",
    "torch._functorch.compile_utils.fx_graph_cse",
    "torch._functorch.config",
    "torch._functorch.config.load_config",
    "torch._functorch.config.patch",
    "torch._functorch.config.save_config_portable",
    "torch._functorch.partitioners",
    "torch._functorch.partitioners.min_cut_rematerialization_partition",
    "torch._grouped_mm",
    "torch._guards",
    "torch._guards.TracingContext",
    "torch._guards.TracingContext.try_get",
    "torch._guards.detect_fake_mode",
    "torch._guards.tracing",
    "torch._inductor",
    "torch._inductor.async_compile",
    "torch._inductor.async_compile.AsyncCompile",
    "torch._inductor.async_compile.AsyncCompile.wait",
    "torch._inductor.async_compile.maybe_warm_pool",
    "torch._inductor.codecache",
    "torch._inductor.codegen.cpp_utils",
    "torch._inductor.codegen.cpp_utils.DTYPE_TO_CPP",
    "torch._inductor.codegen.triton",
    "torch._inductor.compile_fx",
    "torch._inductor.compile_fx.compile_fx_inner",
    "torch._inductor.compile_fx.partition_fn",
    "torch._inductor.config",
    "torch._inductor.config.compile_threads",
    "torch._inductor.config.cpp.max_horizontal_fusion_size",
    "torch._inductor.config.load_config",
    "torch._inductor.config.patch",
    "torch._inductor.config.save_config_portable",
    "torch._inductor.cpu_vec_isa",
    "torch._inductor.cpu_vec_isa.pick_vec_isa",
    "torch._inductor.decomposition",
    "torch._inductor.decomposition.select_decomp_table",
    "torch._inductor.fx_passes.joint_graph",
    "torch._inductor.fx_passes.joint_graph.joint_graph_passes",
    "torch._inductor.lowering",
    "torch._inductor.output_code",
    "torch._inductor.output_code.CompiledFxGraph",
    "torch._inductor.runtime.cache_dir_utils",
    "torch._inductor.runtime.cache_dir_utils.cache_dir",
    "torch._inductor.scheduler",
    "torch._inductor.standalone_compile",
    "torch._inductor.standalone_compile.AOTCompiledArtifact",
    "torch._inductor.standalone_compile.CompiledArtifact",
    "torch._inductor.utils",
    "torch._inductor.utils.BoxedBool",
    "torch._inductor.utils.run_and_get_code",
    "torch._meta_registrations",
    "torch._meta_registrations._meta_grouped_mm_common",
    "torch._ops.OpOverload",
    "torch._ops.OpOverloadPacket",
    "torch._scaled_grouped_mm",
    "torch._scaled_mm",
    "torch._subclasses",
    "torch._subclasses.FakeTensor",
    "torch._subclasses.FakeTensorMode",
    "torch._subclasses.fake_tensor",
    "torch._subclasses.fake_tensor.FakeTensorMode",
    "torch.distributed._functional_collectives",
    "torch.fx._graph_pickler",
    "torch.fx._graph_pickler.GraphPickler",
    "torch.fx._graph_pickler.Options",
    "torch.fx._lazy_graph_module",
    "torch.fx._lazy_graph_module._LazyGraphModule",
    "torch.fx._lazy_graph_module._make_graph_module",
    "torch.fx._lazy_graph_module._use_lazy_graph_module",
    "torch.fx.graph._PyTreeCodeGen",
    "torch.fx.graph._PyTreeInfo",
    "torch.ops._c10d_functional",
    "torch.ops.aten._scaled_mm_v2.default",
    "torch.testing._internal.distributed.fake_pg",
    "torch.testing._internal.distributed.fake_pg.FakeStore",
    "torch.utils._python_dispatch",
    "torch.utils._python_dispatch.TorchDispatchMode",
    "torch.utils._pytree",
    "torch.utils._pytree.tree_leaves",
)

#: Private torch symbols fp8conf uses only where the installed torch has them; older releases in
#: the tested range lack them, and fp8conf then takes the path it has for those.
NEWER_INTERNALS: tuple[str, ...] = (
    # Inductor's own lowering of e8m0 -> float (torch 2.14): MX scales may travel as float8_e8m0fnu.
    "torch._inductor.lowering._float8_e8m0fnu_to_dtype",
    # Pipelining's warm-up by a vote between stages (torch 2.13): V-shaped schedules start on gloo.
    "torch.distributed.pipelining.schedules._PipelineSchedule._warmup_p2p",
)


@dataclasses.dataclass(frozen=True)
class Probe:
    """Whether ``name`` is found on the installed torch; ``reason`` says why not."""

    name: str
    found: bool
    reason: str = ""


@functools.cache
def probe(name: str) -> Probe:
    """Import the longest importable module prefix of ``name`` and look up the rest as attributes."""
    parts = name.split(".")
    error = ""
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError as exc:  # a shorter prefix may be the module; the last error is the reason
            logger.debug("probe of torch internal %s: %s is not a module (%s)", name, ".".join(parts[:cut]), exc)
            error = str(exc)
            continue
        except Exception as exc:  # an internal module that fails while importing is as good as absent
            logger.debug("probe of torch internal %s: importing %s raised %r", name, ".".join(parts[:cut]), exc)
            return Probe(name, False, f"importing {'.'.join(parts[:cut])} failed: {type(exc).__name__}: {exc}")
        for i, attr in enumerate(parts[cut:], cut):
            if not hasattr(obj, attr):
                return Probe(name, False, f"{'.'.join(parts[:i])} has no attribute {attr!r}")
            obj = getattr(obj, attr)
        return Probe(name, True)
    return Probe(name, False, error or f"cannot import {name}")


def failed_probes() -> list[Probe]:
    """The internals of :data:`INTERNALS` not found on the installed torch."""
    return [p for p in map(probe, INTERNALS) if not p.found]


@dataclasses.dataclass(frozen=True)
class FastPath:
    """One of fp8conf's fast paths: the internals it needs, and what is lost without it."""

    name: str
    needs: tuple[str, ...]
    loss: str

    def state(self) -> tuple[bool, str]:
        """``(fast_path_taken, reason)``: taken when every internal it needs is found."""
        missing = [p for p in map(probe, self.needs) if not p.found]
        if not missing:
            return True, ""
        return False, "; ".join(f"{p.name}: {p.reason}" for p in missing)


FAST_PATHS: tuple[FastPath, ...] = (
    FastPath("fast call", ("torch._inductor.output_code.CompiledFxGraph",),
             "compiled units are called through torch's wrappers"),
    FastPath("put-off kernel waits", ("torch._inductor.async_compile.AsyncCompile.wait",),
             "each compiled unit waits for its kernels before the next compiles"),
    FastPath("compile workers", ("torch._inductor.async_compile.maybe_warm_pool",
                                 "torch._inductor.standalone_compile.AOTCompiledArtifact"),
             "units compile one after another in this process"),
    FastPath("boxed backward", ("torch._inductor.utils.BoxedBool", "torch.fx.graph._PyTreeCodeGen"),
             "the compiled backward keeps every saved value alive until it returns"),
    FastPath("CPU instruction set found beside the cut", ("torch._inductor.cpu_vec_isa.pick_vec_isa",),
             "on the CPU, Inductor's first C++ kernel waits for its instruction-set probe builds"),
)


def fast_paths() -> list[tuple[str, bool, str]]:
    """Each fast path as ``(name, fast_path_taken, reason it is off)``."""
    return [(fp.name, *fp.state()) for fp in FAST_PATHS]


_lock = threading.Lock()
_users = 0
_original = None


@contextlib.contextmanager
def async_compile_wait_patched(wait_factory):
    """While inside, ``AsyncCompile.wait`` is ``wait_factory(original)``; the patch is installed
    by the first of nested or concurrent users and the original restored by the last, also when
    the body raises. Raises :class:`fp8conf.errors.FP8Error` when
    the probe fails (callers check :func:`probe` and fall back before entering)."""
    global _users, _original
    p = probe("torch._inductor.async_compile.AsyncCompile.wait")
    if not p.found:
        from fp8conf.errors import FP8Error

        raise FP8Error(f"cannot patch AsyncCompile.wait: {p.reason}")
    from torch._inductor.async_compile import AsyncCompile

    with _lock:
        if _users == 0:
            _original = AsyncCompile.wait
            AsyncCompile.wait = wait_factory(_original)
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                AsyncCompile.wait = _original
                _original = None


@functools.cache
def inductor_lowers_e8m0() -> Probe:
    """Whether Inductor compiles ``torch.float8_e8m0fnu`` tensors: it lowers e8m0 -> float itself
    and CPU code generation has a C++ type for e8m0 (torch 2.14 and newer). Where not, an e8m0
    tensor that reaches generated code aborts the compile, and fp8conf's MX path carries its
    scales as ``uint8`` bytes instead (logged once, at info)."""
    name = "torch._inductor.lowering._float8_e8m0fnu_to_dtype"
    lowering = probe(name)
    if not lowering.found:
        return Probe("inductor lowers e8m0", False, f"{name}: {lowering.reason}")
    table = probe("torch._inductor.codegen.cpp_utils.DTYPE_TO_CPP")
    if not table.found:
        return Probe("inductor lowers e8m0", False, table.reason)
    import torch
    from torch._inductor.codegen.cpp_utils import DTYPE_TO_CPP

    if torch.float8_e8m0fnu not in DTYPE_TO_CPP:
        return Probe("inductor lowers e8m0", False, "CPU Inductor's DTYPE_TO_CPP has no float8_e8m0fnu")
    return Probe("inductor lowers e8m0", True)


def v_schedules_start_on_gloo() -> Probe:
    """Whether torch's V-shaped pipeline schedules (``ZBVZeroBubble``, ``DualPipeV``) can start
    over gloo. Older releases (torch 2.11) warm up the point-to-point links by each stage sending
    to its neighbours, so the rank that holds two adjacent stages sends to itself, which gloo
    refuses ("Pair is not connected"); newer ones warm up by a vote between the stages."""
    name = "torch.distributed.pipelining.schedules._PipelineSchedule._warmup_p2p"
    warmup = probe(name)
    if warmup.found:
        return Probe("V-shaped schedules start on gloo", True)
    return Probe("V-shaped schedules start on gloo", False,
                 f"{warmup.reason}: this torch warms up pipeline stages by point-to-point sends, and the rank holding two "
                 "adjacent stages of a V-shaped schedule would send to itself, which gloo refuses")
