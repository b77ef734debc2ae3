"""Starting rank processes: ``torch.multiprocessing.start_processes`` from a fork server.

A spawned rank is a new interpreter that imports torch (and TorchAO, fp8conf, the backend) before
it does anything: seconds of CPU per rank and launch, paid again at every launch, while the
rank's own work on a test-sized model takes a fraction of a second. :func:`start_ranks` starts
the ranks from multiprocessing's fork server instead, where the platform has one (Linux, macOS):
the server imports ``preload`` once, in a process that has computed nothing, so no thread pool
exists to be lost in the fork, and each rank is a fork of it. What a spawned rank gets is kept:

* the launcher's environment as it is at the launch (the server's is the one it started with),
  set before the rank's function runs; variables torch reads at import are the server's, so a
  launch whose variables named ``TORCH*``, ``PYTORCH*`` or ``OMP_*`` differ from the server's
  spawns its ranks instead, and says so through the ``fp8conf`` logger;
* the launcher's ``sys.path`` and working folder (multiprocessing sends them with each rank);
* the ranks' output: each rank writes its stdout and stderr to files that the launcher copies to
  its own streams when the ranks have ended, so what a rank prints reaches whoever captures the
  launcher's output (pytest, a session's log) and not the streams the server started with.

Where the platform has no fork server the ranks are spawned, as before.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import tempfile
from collections.abc import Callable, Sequence

__all__ = ["start_ranks"]

logger = logging.getLogger("fp8conf")

#: Modules every rank of fp8conf's launchers imports; the server imports them once.
PRELOAD = ("torch", "torch.distributed", "torch.multiprocessing")
#: Prefixes of environment variables torch and its thread pools read at import or start.
_READ_AT_IMPORT = ("TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_")

#: The environment the fork server was started with (None: not started by this module).
_server_environment: dict[str, str] | None = None


def start_ranks(fn: Callable, args: tuple, *, nprocs: int, preload: Sequence[str] = ()) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` processes and wait for them, as
    ``torch.multiprocessing.start_processes(..., join=True)`` does and raising what it raises
    (``ProcessRaisedException``, ``ProcessExitedException``). ``preload`` names modules the
    ranks import besides torch (fp8conf, the suite, the backend's module): the fork server
    imports them once, when it starts."""
    import torch.multiprocessing as mp

    method = _start_method(preload)
    with tempfile.TemporaryDirectory(prefix="fp8conf-ranks-") as outputs:
        try:
            mp.start_processes(_rank, args=(fn, dict(os.environ), outputs, args), nprocs=nprocs, join=True,
                               start_method=method)
        finally:
            _replay(outputs, nprocs)


def _start_method(preload: Sequence[str]) -> str:
    global _server_environment

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    here = _import_time_variables(os.environ)
    if _server_environment is None:
        from multiprocessing import forkserver

        # The server starts at the first launch; what it preloads is fixed then.
        forkserver.set_forkserver_preload(list(dict.fromkeys((*PRELOAD, *preload))))
        _server_environment = here
        logger.debug("rank processes start from a fork server that imports %s once", ", ".join(dict.fromkeys((*PRELOAD, *preload))))
        return "forkserver"
    if here != _server_environment:
        changed = sorted(k for k in set(here) | set(_server_environment) if here.get(k) != _server_environment.get(k))
        logger.info("rank processes spawned, not forked: %s changed since the fork server started, and torch reads "
                    "them at import", ", ".join(changed))
        return "spawn"
    return "forkserver"


def _import_time_variables(environ) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k.startswith(_READ_AT_IMPORT)}


def _rank(rank: int, fn: Callable, environ: dict[str, str], outputs: str, args: tuple) -> None:
    """In the rank: the launcher's environment and output files, then ``fn(rank, *args)``."""
    os.environ.clear()
    os.environ.update(environ)
    saved = []
    for fd, stream, name in ((1, sys.stdout, "stdout"), (2, sys.stderr, "stderr")):
        stream.flush()
        saved.append((fd, os.dup(fd)))
        with open(os.path.join(outputs, f"rank{rank}.{name}"), "wb") as file:
            os.dup2(file.fileno(), fd)
    try:
        fn(rank, *args)
    finally:  # a rank run in the launcher's own process (a test's stand-in) gets its streams back
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in saved:
            os.dup2(copy, fd)
            os.close(copy)


def _replay(outputs: str, nprocs: int) -> None:
    """Copy what each rank printed to this process's streams, rank by rank."""
    for rank in range(nprocs):
        for name, stream in (("stdout", sys.stdout), ("stderr", sys.stderr)):
            path = os.path.join(outputs, f"rank{rank}.{name}")
            if os.path.exists(path):
                with open(path, errors="replace") as file:
                    text = file.read()
                if text:
                    stream.write(text if text.endswith("\n") else text + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
