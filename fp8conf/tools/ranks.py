"""The rank processes of the check tools (``sharded_check``, ``pipeline_check``,
``tensor_parallel_check``): how they start, how they end, and what their launcher raises when one
fails.

:func:`spawn` runs a worker in ``ranks`` spawned processes and turns a failed rank into one error
in the launcher, instead of ``torch.multiprocessing``'s traceback of the rank's traceback:

* fp8conf's own error, raised on a rank (``FP8ConfigError``: a parameter that cannot be sharded
  evenly over the ranks), is raised again as itself, with a note naming the rank;
* a process group that did not start (:func:`start_process_group`: gloo finds no network
  interface, the ranks cannot connect) is a :class:`~fp8conf.errors.ProcessGroupStartError`
  naming what the rank saw and what to change on the machine;
* any other failure, or a rank that ended without one of its own (killed, crashed in native
  code), is a :class:`~fp8conf.errors.RankFailedError` naming the rank and the cause.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import tempfile

from fp8conf.errors import FP8ConfigError, FP8Error, ProcessGroupStartError, RankFailedError
from fp8conf.log import logger

__all__ = ["leave", "one_line", "rank_count", "spawn", "start_process_group"]


def leave() -> None:
    """End this rank process without the interpreter's teardown: gloo's threads sometimes abort
    it ("terminate called without an active exception", SIGABRT) after the rank's results are
    saved and its process group destroyed, and the launcher would report a failed rank."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def one_line(exc: BaseException) -> str:
    """``exc`` as a tool prints it: type, message and notes (the rank it was raised on)."""
    notes = "".join(f" ({note})" for note in getattr(exc, "__notes__", ()))
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}{notes}"


def rank_count(text: str) -> int:
    """The ``argparse`` type of a tool's ``--ranks``: a whole number of 1 or more."""
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of ranks") from None
    if count < 1:
        raise argparse.ArgumentTypeError(f"{count}: give 1 or more ranks")
    return count


def _machine_fix(backend: str) -> str:
    interface = "GLOO_SOCKET_IFNAME" if backend == "gloo" else "NCCL_SOCKET_IFNAME"
    value = os.environ.get(interface)
    if value is not None:
        return (f"{interface}={value!r} is set: unset it, or name a network interface of this machine that `ip link` "
                "lists (lo for ranks on one machine)")
    return (f"the ranks connect through the address this machine's host name resolves to: make `hostname` resolve to "
            f"an address of this machine (/etc/hosts), or set {interface}=lo")


def start_process_group(backend: str, init_file: str, rank: int, ranks: int, **options) -> None:
    """``torch.distributed.init_process_group`` for a rank of a check tool, rendezvous through
    ``init_file``; raises :class:`~fp8conf.errors.ProcessGroupStartError` when the group does not
    start (the machine's network setup, not the model)."""
    import torch.distributed as dist

    try:
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=ranks, **options)
    except Exception as exc:  # raised typed: the launcher names the cause without the traceback
        seen = one_line(exc)
        raise ProcessGroupStartError(
            f"the {backend} process group of {ranks} ranks did not start on rank {rank}: {seen}; {_machine_fix(backend)}",
            rank=rank, reason=seen,
        ) from None


def _run_rank(rank: int, worker, errors_dir: str, args: tuple) -> None:
    """Run ``worker(rank, *args)``; what it raises is kept in ``errors_dir`` for the launcher."""
    try:
        worker(rank, *args)
    except Exception as exc:
        try:
            kept = pickle.dumps(exc)
            pickle.loads(kept)  # an exception that cannot be rebuilt goes as its text
        except Exception:
            logger.debug("rank %d: %s cannot be pickled; its text is kept instead", rank, type(exc).__name__)
            kept = pickle.dumps(one_line(exc))
        with open(os.path.join(errors_dir, f"rank{rank}.error"), "wb") as file:
            file.write(kept)
        raise


def _kept_error(errors_dir: str, rank: int):
    path = os.path.join(errors_dir, f"rank{rank}.error")
    if not os.path.exists(path):
        return None
    with open(path, "rb") as file:
        return pickle.load(file)


def _one_error(failure: Exception, errors_dir: str, tool: str, ranks: int) -> Exception:
    """The error the launcher raises for ``torch.multiprocessing``'s ``failure`` of a rank."""
    rank = getattr(failure, "error_index", 0)
    kept = _kept_error(errors_dir, rank)
    if kept is None:  # the rank that failed first kept nothing: another may tell why
        rank, kept = next(((r, e) for r in range(ranks) if (e := _kept_error(errors_dir, r)) is not None), (rank, None))
    if isinstance(kept, FP8Error):
        kept.add_note(f"raised on rank {rank} of {ranks} of {tool}")
        return kept
    if isinstance(kept, BaseException):
        cause = one_line(kept)
    elif isinstance(kept, str):
        cause = kept
    else:
        cause = (f"it ended without an error of its own ({' '.join(str(failure).split())}): killed (out of memory?) or "
                 "crashed in native code")
    return RankFailedError(f"{tool}: rank {rank} of {ranks} failed: {cause}", rank=rank, reason=cause)


def spawn(worker, args: tuple, *, ranks: int, tool: str) -> None:
    """Run ``worker(rank, *args)`` in ``ranks`` processes (forked from a server that imported torch
    and fp8conf once: :func:`fp8contract.rank_processes.start_ranks`) and wait for them; a failed
    rank is raised as one error (see the module's docstring)."""
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise FP8ConfigError(f"{tool}: ranks must be a whole number of 1 or more, got {ranks!r}")
    import torch.multiprocessing as mp

    from fp8contract.rank_processes import start_ranks

    with tempfile.TemporaryDirectory(prefix=f"fp8conf-{tool}-") as errors_dir:
        try:
            start_ranks(_run_rank, (worker, errors_dir, args), nprocs=ranks, preload=("fp8conf", __name__, worker.__module__))
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as failure:
            logger.debug("%s: a rank failed:\n%s", tool, failure)
            raise _one_error(failure, errors_dir, tool, ranks) from None
