"""Compiling the distinct units of a regional compile side by side: here and in helper processes.

A regional compile hands Inductor one graph per structurally distinct unit (four or five for a
Llama model, however deep), and each compile is mostly Python: tracing, lowering, scheduling and
code generation hold the interpreter, so units compiled one after the other in one process add
up. Being independent, they can be compiled at once: the units are shared out, largest first,
between this process and ``workers`` helper processes, each unit to whichever has the fewest
nodes to compile so far, and this process compiles its own share while the helpers compile
theirs. A helper receives a unit (pickled with torch's ``GraphPickler``, its inputs described by
shape, stride, dtype and device), compiles it with ``standalone_compile`` (the form a regional
artifact stores, :func:`fp8conf.compile.region_compile.standalone_unit`), under the parent's
Inductor and functorch settings, and sends back Inductor's serialized artifact
(``AOTCompiledArtifact``), which the parent loads and calls as it would its own; the units this
process keeps are compiled as without helpers (:func:`fp8conf.compile.region_compile.compile_unit`),
the same kernels either way. Helpers are started when the compile begins, before the min-cut partition, so
that their start (importing torch and Inductor, starting their own Triton compile processes)
overlaps the cutting of the graph, and stopped when it ends; they share the parent's Inductor
cache directory.

:func:`unit_compiler` picks this process alone unless helpers are asked for
(``compile_joint(..., workers=N)``): on the machines measured, helpers have not shortened a first
step. On an H200 (6 blocks of the Llama benchmark model, a fresh process and an empty Inductor
cache each, one sample) 32.2 s in one process against 29.6 to 34.7 s with two to four helpers;
on a 2-core CPU (32 blocks, dim 64, two samples each) 31.7 / 32.6 s against 37.0 / 39.2 s with one
helper, whose import of torch and Inductor competes with the cut for the two cores (the history
of benchmarks/RESULTS.md keeps the tables). The bytes a helper returns come
from this process's own helpers, over their pipes, compiled from graphs it sent them: loading
them deserialises nothing that came from outside the process tree.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import os
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Callable

import torch

from fp8conf.compile import region_compile
from fp8conf.log import fell_back, logger

__all__ = ["InProcessCompiler", "WorkerPool", "unit_compiler"]

#: Compiles each unit here, when it is submitted (kept with the units it compiles).
InProcessCompiler = region_compile.InProcessCompiler


def _cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class WorkerPool:
    """Compiles units here and in ``workers`` helper processes side by side.

    :meth:`submit` only records a unit; the first :meth:`result` (when the first unit is bound,
    after every graph of the compile has been cut) shares them out, largest first, each to
    whichever of this process and the helpers has the fewest nodes to compile so far, sends the
    helpers theirs and compiles this process's own while the helpers work. A unit that cannot be
    pickled is compiled here. Each helper is ``python -m fp8conf.compile.workers``, a
    process of its own that imports nothing of the caller's program (unlike ``multiprocessing``'s
    spawn, which would run a script without a ``__main__`` guard again), fed pickled requests on
    its stdin."""

    def __init__(self, workers: int, *, saveable: bool = False):
        #: The units kept here (the helpers' are saveable anyway), and those compiled here again
        #: after their first compile failed (fp8conf.compile.unit_failures).
        self.saveable = saveable
        settings = (torch._inductor.config.save_config_portable(), torch._functorch.config.save_config_portable())
        # Inductor's own compile workers (Triton, C++) shared out between this process and the helpers.
        threads = max(1, min(torch._inductor.config.compile_threads, _cores()) // (workers + 1))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        # Started now: their start overlaps the graph surgery.
        self._helpers = [_Worker(env, (*settings, threads)) for _ in range(workers)]
        self._threads = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fp8conf-compile")
        self._units: list[_Unit] = []
        self._shared_out = False

    def submit(self, submodule: torch.fx.GraphModule, fake_inputs) -> _Unit:
        unit = _Unit(submodule, list(fake_inputs), torch._guards.TracingContext.try_get(), self.saveable)
        self._units.append(unit)
        return unit

    def result(self, unit: _Unit) -> Callable:
        """The compiled unit (waiting for its helper, or compiling it here); a failure of its
        compile is raised here."""
        if not self._shared_out:
            self._shared_out = True
            self._share_out()
        return InProcessCompiler.result(unit.compiled())

    def _share_out(self) -> None:
        from torch.fx._graph_pickler import GraphPickler, Options

        loads = [0] * (len(self._helpers) + 1)  # the helpers', then this process's
        here = []
        for unit in sorted(self._units, key=lambda u: u.size, reverse=True):
            place = loads.index(min(loads))  # on a tie a helper: this process also binds what returns
            if place < len(self._helpers):
                try:
                    data = GraphPickler.dumps(unit.submodule, Options(ops_filter=None))
                except Exception as exc:  # something in the graph torch cannot pickle: compiled here
                    fell_back("compile workers", f"a unit's graph cannot be sent to a helper ({type(exc).__name__}: {exc})",
                              "that unit is compiled in this process")
                    place = len(self._helpers)
                else:
                    unit.future = self._threads.submit(self._helpers[place].compile, data, [_describe(v) for v in unit.fake_inputs])
            if place == len(self._helpers):
                here.append(unit)
            loads[place] += unit.size
        for unit in here:  # while the helpers compile theirs
            try:
                unit.compiled()
            except Exception:
                break  # raised when its unit is bound; the rest are compiled then, if ever

    def close(self) -> None:
        self._threads.shutdown(wait=True, cancel_futures=True)
        for worker in self._helpers:
            worker.stop()


class _Unit:
    """A submitted unit: what to compile, the tracing context it was cut under, and where it is
    compiled (``future``: a helper's reply)."""

    def __init__(self, submodule, fake_inputs, context, saveable: bool = False):
        self.submodule, self.fake_inputs, self.context, self.saveable = submodule, fake_inputs, context, saveable
        self.size = sum(n.op == "call_function" for n in submodule.graph.nodes)
        self.future: concurrent.futures.Future | None = None
        self._outcome = None

    def compiled(self) -> Callable:
        if self._outcome is None:
            try:
                self._outcome = (True, self._compile())
            except Exception as exc:
                self._outcome = (False, exc)
        ok, value = self._outcome
        if not ok:
            raise value
        return value

    def _compile(self) -> Callable:
        if self.future is not None:
            from torch._inductor.standalone_compile import AOTCompiledArtifact

            return AOTCompiledArtifact.deserialize(self.future.result())
        with torch._guards.tracing(self.context):
            return InProcessCompiler(saveable=self.saveable).submit(self.submodule, self.fake_inputs)


class _WorkerError(RuntimeError):
    """A compile worker failed: its exception, or its exit and the end of what it printed.
    ``causes``: the type names of the worker's exception and of those it wraps, which the
    parent reads to tell a C++ compile error (:func:`fp8conf.compile.unit_failures.cpp_codegen_error`)."""

    def __init__(self, message: str, causes: tuple[str, ...] = ()):
        super().__init__(message)
        self.causes = tuple(causes)


class _Worker:
    """One worker process and the pipe to it."""

    def __init__(self, env: dict, settings: tuple):
        self._log = tempfile.TemporaryFile()
        self._proc = subprocess.Popen([sys.executable, "-m", "fp8conf.compile.workers"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._log, env=env)
        try:
            self._send(("settings", settings))
        except OSError as exc:  # it exited at once: its first compile reports how, with what it printed
            logger.debug("compile worker (pid %s) took no settings: %r", self._proc.pid, exc)

    def _send(self, message) -> None:
        pickle.dump(message, self._proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
        self._proc.stdin.flush()

    def compile(self, data: bytes, inputs: list[tuple]) -> bytes:
        try:
            self._send(("compile", data, inputs))
            ok, value = pickle.load(self._proc.stdout)
        except (EOFError, OSError, pickle.UnpicklingError) as exc:
            raise _WorkerError(f"the compile worker (pid {self._proc.pid}) exited ({self._proc.poll()}): {self._tail()}") from exc
        if not ok:
            raise _WorkerError(*value)
        return value

    def _tail(self, size: int = 2000) -> str:
        self._log.seek(0)
        text = self._log.read().decode(errors="replace").strip()
        return text[-size:] or "it printed nothing"

    def stop(self) -> None:
        try:
            self._proc.stdin.close()
            self._proc.wait(timeout=30)
        except Exception as exc:  # it did not end on its own: ended here
            logger.debug("compile worker (pid %s) did not stop (%r); killed", self._proc.pid, exc)
            self._proc.kill()
        self._log.close()


def unit_compiler(workers: int = 0, *, saveable: bool = False):
    """The compiler for a regional compile: this process and ``workers`` helpers, or (``0``) this process alone. A
    torch whose ``standalone_compile`` cannot bundle a unit into one serializable artifact
    compiles here. ``saveable``: every unit compiled as a regional artifact stores it
    (:attr:`~fp8conf.CompileConfig.saveable_units`)."""
    if workers <= 0 or not region_compile.bundles_units():
        return InProcessCompiler(saveable=saveable)
    return WorkerPool(workers, saveable=saveable)


def _describe(value) -> tuple:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"a compiled unit's input must be a tensor, not {type(value).__name__}")
    return tuple(value.shape), tuple(value.stride()), value.storage_offset(), value.dtype, str(value.device)


def _apply_settings(inductor_settings: dict, functorch_settings: dict, threads: int) -> None:
    torch._inductor.config.load_config(inductor_settings)
    torch._functorch.config.load_config(functorch_settings)
    torch._inductor.config.compile_threads = threads
    import fp8conf.quantized.ops  # noqa: F401  fp8conf's own ops, which units may call
    from torch._inductor.async_compile import maybe_warm_pool

    # This worker's own Triton compile processes, started before its first unit arrives (see
    # fp8conf.compile.plan._warm_compile_pool); nothing without Triton.
    maybe_warm_pool()
    # What Inductor would import on the first compile, imported while the parent still traces
    # and cuts: the unit arrives to a worker that only has to compile it.
    for name in _COMPILE_MODULES + (_TRITON_MODULES if torch.cuda.is_available() else ()):
        importlib.import_module(name)


_COMPILE_MODULES = ("torch._functorch.aot_autograd", "torch._inductor.compile_fx", "torch._inductor.standalone_compile",
                    "torch._inductor.lowering", "torch._inductor.scheduler", "torch._inductor.codecache")
_TRITON_MODULES = ("torch._inductor.codegen.triton", "triton.compiler.compiler")


def _strided(shape, stride, offset, dtype, device) -> torch.Tensor:
    extent = 0 if 0 in shape else 1 + sum((size - 1) * step for size, step in zip(shape, stride))
    return torch.empty(offset + extent, dtype=dtype, device=device).as_strided(shape, stride, offset)


def _compile(data: bytes, inputs: list[tuple]) -> bytes:
    from torch._subclasses import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    submodule = GraphPickler.loads(data, fake_mode)
    with fake_mode:
        fakes = [_strided(*spec) for spec in inputs]
    with torch._guards.tracing(torch._guards.TracingContext(fake_mode)):
        return region_compile.standalone_unit(submodule, fakes).serialize()


def _serve() -> None:
    """A worker's loop: requests from stdin, one reply each on what was stdout (anything the
    compile prints goes to stderr instead)."""
    import traceback
    import warnings

    warnings.simplefilter("ignore")
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    requests = sys.stdin.buffer
    while True:
        try:
            message = pickle.load(requests)
        except EOFError:
            return
        if message[0] == "settings":
            _apply_settings(*message[1])
            continue
        try:
            reply = (True, _compile(*message[1:]))
        except Exception as exc:
            from fp8conf.compile.unit_failures import error_chain

            reply = (False, (f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-3)}",
                             tuple(type(e).__name__ for e in error_chain(exc))))
        pickle.dump(reply, replies, protocol=pickle.HIGHEST_PROTOCOL)
        replies.flush()


if __name__ == "__main__":
    _serve()
