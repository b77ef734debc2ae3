"""The ``fp8conf`` logger: what fp8conf does not raise for, said out loud.

A non-strict pass that leaves FP8 compute it cannot attribute uncompiled, a fallback to a slower
path, a check skipped for want of something: each is a warning of the standard ``logging``
logger named ``fp8conf``, once per cause and place in a process, so that a user sees it without a
debugger and can route or silence it like any library's (``logging.getLogger("fp8conf")``).
"""

from __future__ import annotations

import contextlib
import logging
import warnings

__all__ = ["logger", "warn_once", "fell_back", "library_notices_quieted"]

logger = logging.getLogger("fp8conf")

_said: set[tuple[str, str]] = set()


def warn_once(cause: str, where: str, message: str) -> bool:
    """Log ``message`` as a warning unless ``(cause, where)`` was logged before in this process;
    ``True`` when it was logged now."""
    if (cause, where) in _said:
        return False
    _said.add((cause, where))
    logger.warning("%s", message)
    return True


def fell_back(path: str, reason: str, loss: str) -> str:
    """Say (once per process for each path and reason) that ``path``, a fast path of fp8conf's,
    was not taken for ``reason``, and what that costs (``loss``); returns the line, for the
    compiled object to count (``CompiledJoint.fallbacks``)."""
    import torch

    line = f"{path}: {reason}"
    warn_once("fallback", line, f"fp8conf fell back from its {path} path: {reason}; {loss} (torch {torch.__version__})")
    return line


#: (logger, text) of the libraries' load-time notices that say nothing about the user's step:
#: TorchAO's extensions built for another platform, TorchAO's enums registered with pytree.
_NOTICES = (
    ("torchao", "Failed to load"),
    ("torchao", "Skipping import of cpp extensions"),
    ("torch.utils._pytree", "is an Enum subclass and is now natively supported"),
)


class _LibraryNotices(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(record.name == name and text in record.getMessage() for name, text in _NOTICES)


@contextlib.contextmanager
def library_notices_quieted():
    """While inside, the load-time notices of TorchAO and torch that fp8conf's own imports and
    copies trigger (see ``_NOTICES``; torch's deprecation of ``LeafSpec`` checks, met when a
    graph's pytree calling convention is copied; ``torch.jit.script_method``, met when Inductor
    is first imported) are not shown. Only what happens inside is affected: the user's own
    imports and warnings are left as they are."""
    notices = _LibraryNotices()
    loggers = [logging.getLogger(name) for name in {name for name, _ in _NOTICES}]
    for target in loggers:
        target.addFilter(notices)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)
            warnings.filterwarnings("ignore", message=r".*torch\.jit\.script_method.*", category=DeprecationWarning)
            yield
    finally:
        for target in loggers:
            target.removeFilter(notices)
