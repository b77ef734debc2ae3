"""How a gloo rank spawned by the check tools ends once its results are saved."""

from __future__ import annotations

import os
import sys

__all__ = ["leave"]


def leave() -> None:
    """End this rank process without the interpreter's teardown: gloo's threads sometimes abort
    it ("terminate called without an active exception", SIGABRT) after the rank's results are
    saved and its process group destroyed, and the launcher would report a failed rank."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
