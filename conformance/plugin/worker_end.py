"""An xdist worker's heap kept out of the interpreter's last garbage collections.

When a run ends, pytest-xdist's controller asks each worker to exit and waits up to 10 s for it
(``NodeManager.EXIT_TIMEOUT``) before it kills it. A worker of the suite ends holding a million
objects or more (traced graphs, fake tensors, compiled code), and the collections of the
interpreter's shutdown walk every one of them: a whole run's workers outlasted the wait, so each
such run ended 10 s after its last test.

:func:`freeze_heap` is called by a worker once its session has ended and its reports are sent
(``pytest_unconfigure``): it collects the garbage there is (finalizers run as usual) and moves
what is left to the permanent generation (:func:`gc.freeze`), which the shutdown's collections
skip; the objects are still freed by reference count when their modules are cleared, and
``atexit`` handlers run as before. The plugin does it for the workers of a run with
``--fp8-backend`` (fp8conf's own tests do it from their ``conftest.py``); a run without one is
left as it is.
"""

from __future__ import annotations

import gc
import logging
import time

import pytest

__all__ = ["freeze_heap"]

logger = logging.getLogger("fp8conf")


def freeze_heap(config: pytest.Config) -> bool:
    """In an xdist worker (``config.workerinput``): collect once, then freeze the heap; True
    where it did. Elsewhere (the controller, a run without xdist): nothing, False."""
    if not hasattr(config, "workerinput"):
        return False
    started = time.perf_counter()
    found = gc.collect()
    gc.freeze()
    logger.debug(
        "xdist worker %s: %d objects frozen for the interpreter's shutdown (%d unreachable collected first, %.2f s)",
        config.workerinput.get("workerid", "?"), gc.get_freeze_count(), found, time.perf_counter() - started,
    )
    return True
