"""What the suite needs of the machine, apart from any backend: a CUDA device for
``--fp8-device=cuda``, and for the properties that run ranks in processes of their own (DP-003,
marked ``fp8_gloo``) a gloo process group of two processes on this machine.

A missing one is the machine's problem, not the backend's, and must never read as a failure of
the backend. The plugin asks :func:`cuda_problem` and :func:`gloo_problem` before the first
property runs and makes a problem a usage error (exit status 4) naming the fix
(:mod:`conformance.plugin.probes`); one that shows only mid-run is raised as
:class:`EnvironmentProblem` (:func:`gloo_start_evidence` tells a rank that could not join its
process group from one whose backend failed) and reported ``environment_error``, outside the
MUST score.

The probes look at torch and the machine only, never at a backend's modules; torch is imported
inside them.
"""

from __future__ import annotations

import datetime
import os
import re
import threading

__all__ = [
    "GLOO_SOCKET_EVIDENCE",
    "GLOO_START_FAILED",
    "EnvironmentProblem",
    "cuda_problem",
    "gloo_fix",
    "gloo_problem",
    "gloo_start_evidence",
]

#: What a rank says, first thing in its error, when its process group did not start.
GLOO_START_FAILED = "the gloo process group did not start"
#: Words of gloo's, its store's and the sockets' own errors when ranks cannot reach each other.
GLOO_SOCKET_EVIDENCE = (
    "Unable to find address for", "Connection refused", "Connection reset by peer", "Address already in use",
    "DistNetworkError", "DistStoreError", "Socket Timeout", "connectFullMesh", "Timed out initializing process group",
)
_INTERFACE_MISSING = re.compile(r"Unable to find address for")
# An exception's line in a traceback ("RuntimeError: ...", "torch.distributed.DistNetworkError: ..."),
# not a frame or its source.
_ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)(:|$)")
# The probe's own rendezvous: long enough for a loaded machine, short for one that cannot connect.
_PROBE_TIMEOUT_S = 10.0


class EnvironmentProblem(Exception):
    """The machine, not the backend, stopped a property: its report row says
    ``environment_error`` with this message, never ``fail``, and it stays out of the MUST score.

    Attributes:
        evidence: what was seen (the failing rank's error line).
        fix: what to change on the machine.
    """

    def __init__(self, message: str, *, evidence: str, fix: str) -> None:
        super().__init__(f"{message}: {evidence}; {fix}")
        self.evidence = evidence
        self.fix = fix


def cuda_problem(device: str) -> str | None:
    """Why the drawn models cannot be built on ``device`` here, with what to do; None when a
    tensor can be made there (always for ``cpu``)."""
    if not device.startswith("cuda"):
        return None
    import torch

    try:
        place = torch.device(device)
    except RuntimeError as exc:
        return f"{device!r} is not a device torch knows ({exc}); use --fp8-device=cuda or cpu"
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return (f"torch {torch.__version__} is built without CUDA; install a CUDA build of torch, or run on the CPU "
                "with --fp8-device=cpu")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    unset = f"; CUDA_VISIBLE_DEVICES={visible!r} is set: unset it or give device indices (e.g. 0)" if visible is not None else ""
    if not torch.cuda.is_available():
        return (f"no CUDA device is usable (torch {torch.__version__}, CUDA {torch.version.cuda}){unset}; "
                "check the driver (nvidia-smi), or run on the CPU with --fp8-device=cpu")
    try:
        torch.empty(1, device=place)
    except (RuntimeError, AssertionError) as exc:
        return f"a tensor cannot be made on {device} ({type(exc).__name__}: {_first_line(exc)}){unset}"
    return None


def gloo_fix(evidence: str) -> str:
    """What to change on this machine for gloo's ranks to reach each other, from what they said."""
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    missing = _INTERFACE_MISSING.search(evidence)
    if missing and interface is not None:
        return (f"GLOO_SOCKET_IFNAME={interface!r} names no network interface of this machine: unset it, or name one "
                "that `ip link` lists (lo for ranks on one machine)")
    if interface is not None:
        return (f"check GLOO_SOCKET_IFNAME={interface!r}: unset it, or name an interface the ranks on this machine "
                "reach each other through (lo)")
    return ("gloo binds to the address this machine's host name resolves to: make `hostname` resolve to an address "
            "of this machine (/etc/hosts), or set GLOO_SOCKET_IFNAME=lo")


def gloo_problem(world: int = 2) -> str | None:
    """Why ``world`` gloo ranks cannot form a process group on this machine, with what to do;
    None when they can. The ranks are threads of this process around an in-memory store (no
    process, no port of the suite's): gloo picks its network device as every rank of a
    property does (``GLOO_SOCKET_IFNAME``, else the host name), connects the ranks and
    all-reduces one number. Milliseconds where gloo works."""
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        return f"torch {torch.__version__} is built without torch.distributed's gloo backend; install a torch that has it"
    store = dist.HashStore()
    timeout = datetime.timedelta(seconds=_PROBE_TIMEOUT_S)
    errors: list[BaseException | None] = [None] * world
    groups: list[object] = [None] * world

    def rank(index: int) -> None:
        try:
            groups[index] = dist.ProcessGroupGloo(store, index, world, timeout)
            groups[index].allreduce([torch.ones(1)]).wait()
        except Exception as exc:  # what the rank saw is the probe's answer
            errors[index] = exc

    threads = [threading.Thread(target=rank, args=(index,), daemon=True, name=f"fp8conf-gloo-probe-{index}")
               for index in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(_PROBE_TIMEOUT_S + 5.0)
    groups.clear()  # the groups close their connections as they go
    if any(thread.is_alive() for thread in threads):
        evidence = f"{world} ranks did not connect within {_PROBE_TIMEOUT_S + 5.0:g} s"
        return f"{GLOO_START_FAILED}: {evidence}; {gloo_fix(evidence)}"
    failed = next((exc for exc in errors if exc is not None), None)
    if failed is None:
        return None
    evidence = f"{type(failed).__name__}: {_first_line(failed)}"
    return f"{GLOO_START_FAILED}: {evidence}; {gloo_fix(evidence)}"


def gloo_start_evidence(failure: str) -> str | None:
    """The error line in a failed rank's traceback (``failure``, as ``torch.multiprocessing``
    reports it) that shows its process group did not start or its sockets failed; None when the
    traceback shows neither (the backend's code failed)."""
    errors = [line.strip() for line in failure.splitlines() if _ERROR_LINE.match(line.strip())]
    for line in reversed(errors):
        if GLOO_START_FAILED in line or any(words in line for words in GLOO_SOCKET_EVIDENCE):
            return line
    return None


def _first_line(exc: BaseException) -> str:
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
