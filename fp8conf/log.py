"""The ``fp8conf`` logger: what fp8conf does not raise for, said out loud.

A non-strict pass that leaves FP8 compute it cannot attribute uncompiled, a fallback to a slower
path, a check skipped for want of something: each is a warning of the standard ``logging``
logger named ``fp8conf``, once per cause and place in a process, so that a user sees it without a
debugger and can route or silence it like any library's (``logging.getLogger("fp8conf")``).
"""

from __future__ import annotations

import logging

__all__ = ["logger", "warn_once"]

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
