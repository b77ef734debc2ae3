"""Compiling the distinct units of a regional compile side by side, in worker processes.

A regional compile hands Inductor one graph per structurally distinct unit (four or five for a
Llama model, however deep), and each compile is mostly Python: tracing, lowering, scheduling and
code generation hold the interpreter, so units compiled one after the other in one process add
up. Being independent, they can be compiled at once in processes of their own: each worker
receives a unit (pickled with torch's ``GraphPickler``, its inputs described by shape, stride,
dtype and device), compiles it with the same ``standalone_compile`` call the in-process path
makes, under the parent's Inductor and functorch settings, and sends back Inductor's serialized
artifact (``AOTCompiledArtifact``), which the parent loads and calls as it would its own. Workers
are started when the compile begins, before the min-cut partition, so that their start overlaps
the cutting of the graph, and stopped when it ends; each starts its own Triton compile processes
at once; they share the parent's Inductor cache directory.

:func:`unit_compiler` picks the in-process compiler unless workers are asked for
(``compile_joint(..., workers=N)``). A pool pays for its start (each worker imports torch and
Inductor) and for loading what the workers send back, so it is not the default: on an H200
host (16 cores) 4 workers made the first step of the Llama debug model slower at 2 and 6 blocks
(30.6 / 35.7 s against 25.7 / 32.3 s in one process) and faster at 32 (73.5 against 84.5 s),
and with the workers started before the cut, 2 to 4 of them were within the noise of one
process at 6 blocks; see benchmarks/RESULTS.md. The bytes a worker returns come from this process's own workers,
over their pipes, compiled from graphs it sent them: loading them deserialises nothing that
came from outside the process tree.
"""

from __future__ import annotations

import concurrent.futures
import os
import pickle
import queue
import subprocess
import sys
import tempfile
from collections.abc import Callable

import torch

__all__ = ["InProcessCompiler", "WorkerPool", "unit_compiler"]


def _cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class InProcessCompiler:
    """Compiles each unit here, when it is submitted."""

    def submit(self, submodule: torch.fx.GraphModule, fake_inputs) -> Callable:
        from fp8conf.graph.region_compile import compile_unit

        return compile_unit(submodule, fake_inputs)

    @staticmethod
    def result(compiled) -> Callable:
        return compiled

    def close(self) -> None:
        pass


class WorkerPool:
    """Compiles units in ``workers`` processes; :meth:`submit` returns a future of the compiled
    unit (resolved by :meth:`result`), or compiles here a unit that cannot be sent.

    Each worker is ``python -m fp8conf.graph.compile_workers``, a process of its own that imports
    nothing of the caller's program (unlike ``multiprocessing``'s spawn, which would run a script
    without a ``__main__`` guard again), fed pickled requests on its stdin."""

    def __init__(self, workers: int):
        settings = (torch._inductor.config.save_config_portable(), torch._functorch.config.save_config_portable())
        # Inductor's own compile workers (Triton, C++) shared out between the pool's processes.
        threads = max(1, min(torch._inductor.config.compile_threads, _cores()) // workers)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self._idle: queue.Queue = queue.Queue()
        self._all = []
        for _ in range(workers):  # started now: their start overlaps the graph surgery
            worker = _Worker(env, (*settings, threads))
            self._all.append(worker)
            self._idle.put(worker)
        self._threads = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fp8conf-compile")

    def submit(self, submodule: torch.fx.GraphModule, fake_inputs):
        from torch.fx._graph_pickler import GraphPickler, Options

        try:
            data = GraphPickler.dumps(submodule, Options(ops_filter=None))
        except Exception:
            # Something in the graph torch cannot pickle: compiled here instead, the same way.
            return InProcessCompiler().submit(submodule, fake_inputs)
        return self._threads.submit(self._run, data, [_describe(v) for v in fake_inputs])

    def _run(self, data: bytes, inputs: list[tuple]) -> bytes:
        worker = self._idle.get()
        try:
            return worker.compile(data, inputs)
        finally:
            self._idle.put(worker)

    @staticmethod
    def result(pending) -> Callable:
        """The compiled unit of what :meth:`submit` returned (waiting for its worker); a worker's
        failure is raised here."""
        if not isinstance(pending, concurrent.futures.Future):
            return pending
        from torch._inductor.standalone_compile import AOTCompiledArtifact

        return AOTCompiledArtifact.deserialize(pending.result())

    def close(self) -> None:
        self._threads.shutdown(wait=True, cancel_futures=True)
        for worker in self._all:
            worker.stop()


class _WorkerError(RuntimeError):
    """A compile worker failed: its exception, or its exit and the end of what it printed."""


class _Worker:
    """One worker process and the pipe to it."""

    def __init__(self, env: dict, settings: tuple):
        self._log = tempfile.TemporaryFile()
        self._proc = subprocess.Popen([sys.executable, "-m", "fp8conf.graph.compile_workers"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._log, env=env)
        try:
            self._send(("settings", settings))
        except OSError:
            pass  # it exited at once: its first compile reports how, with what it printed

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
            raise _WorkerError(value)
        return value

    def _tail(self, size: int = 2000) -> str:
        self._log.seek(0)
        text = self._log.read().decode(errors="replace").strip()
        return text[-size:] or "it printed nothing"

    def stop(self) -> None:
        try:
            self._proc.stdin.close()
            self._proc.wait(timeout=30)
        except Exception:
            self._proc.kill()
        self._log.close()


def unit_compiler(workers: int = 0):
    """The compiler for a regional compile: ``workers`` processes, or (``0``) this process. A
    torch whose ``standalone_compile`` cannot bundle a unit into one serializable artifact
    compiles here."""
    from fp8conf.graph.region_compile import bundles_units

    if workers <= 0 or not bundles_units():
        return InProcessCompiler()
    return WorkerPool(workers)


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
    # fp8conf.graph.compile._warm_compile_pool); nothing without Triton.
    maybe_warm_pool()


def _strided(shape, stride, offset, dtype, device) -> torch.Tensor:
    extent = 0 if 0 in shape else 1 + sum((size - 1) * step for size, step in zip(shape, stride))
    return torch.empty(offset + extent, dtype=dtype, device=device).as_strided(shape, stride, offset)


def _compile(data: bytes, inputs: list[tuple]) -> bytes:
    from torch._subclasses import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from fp8conf.graph.region_compile import compile_unit

    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    submodule = GraphPickler.loads(data, fake_mode)
    with fake_mode:
        fakes = [_strided(*spec) for spec in inputs]
    with torch._guards.tracing(torch._guards.TracingContext(fake_mode)):
        return compile_unit(submodule, fakes).serialize()


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
            reply = (False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-3)}")
        pickle.dump(reply, replies, protocol=pickle.HIGHEST_PROTOCOL)
        replies.flush()


if __name__ == "__main__":
    _serve()
