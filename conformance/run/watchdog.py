"""Hang detection: which backend method is running, and a per-test timeout that names it.

The plugin wraps the backend's adapter methods on the instance (:func:`track`), so
:func:`current_method` names the one in progress whoever calls it: the harness, the suite's
oracle, or the backend itself. Timeouts are pytest-timeout's (marker ``timeout``, set from
``--fp8-timeout``); for the suite's tests the plugin answers pytest-timeout's
``pytest_timeout_set_timer`` hook with :func:`set_timer`, and restarts the timer with
:func:`rearm` at every Hypothesis example, so the limit applies to one example (a plain test
is one example) and a long but progressing test, or a failure Hypothesis shrinks for
minutes, never trips it:

* method ``signal`` (the default on POSIX): SIGALRM raises :class:`BackendTimeout` in the test.
  It derives from ``BaseException`` so that neither the harness (``except Exception``) nor
  Hypothesis (which would shrink, re-running the hanging call with no timer left) catches it;
  the test ends, is reported ``error`` and the session goes on;
* method ``thread``: a timer thread prints the same message, then hands over to pytest-timeout,
  which dumps the stacks and ends the process (pytest-xdist reports the crashed test).

Nothing here imports torch.
"""

from __future__ import annotations

import functools
import signal
import sys
import threading
from typing import Any, Callable

__all__ = [
    "BackendTimeout",
    "current_method",
    "on_method_change",
    "rearm",
    "set_timer",
    "timeout_message",
    "track",
]

#: Names of the adapter methods in progress, innermost last (a method may call another).
_in_progress: list[str] = []
_TRACKED = "__fp8conf_tracked__"
#: Restarts the running test's timer; None when no timer of ours runs.
_restart: Callable[[], None] | None = None
#: Told the method in progress (None: none) whenever it changes; for a process that may die
#: without a word (an xdist worker), see :mod:`conformance.plugin.crashes`.
_listener: Callable[[str | None], None] | None = None


def on_method_change(listener: Callable[[str | None], None] | None) -> None:
    """Call ``listener(method)`` each time the adapter method in progress changes."""
    global _listener
    _listener = listener


class BackendTimeout(BaseException):
    """A conformance test ran past ``--fp8-timeout``; the message names the backend method."""


def current_method() -> str | None:
    """The adapter method running now (innermost), or None outside any."""
    return _in_progress[-1] if _in_progress else None


def _api_methods() -> tuple[str, ...]:
    from conformance.api.backend import Backend

    return tuple(
        name for name, value in vars(Backend).items() if callable(value) and not name.startswith("_")
    )


def track(backend: Any) -> Any:
    """Wrap ``backend``'s adapter methods on the instance so :func:`current_method` names them."""
    for name in _api_methods():
        method = getattr(backend, name, None)
        if callable(method) and not getattr(method, _TRACKED, False):
            setattr(backend, name, _tracked(name, method))
    return backend


def _tracked(name: str, method: Callable) -> Callable:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        depth = len(_in_progress)
        _in_progress.append(name)
        if _listener is not None:
            _listener(name)
        try:
            return method(*args, **kwargs)
        finally:
            del _in_progress[depth:]
            if _listener is not None:
                _listener(current_method())

    setattr(call, _TRACKED, True)
    return call


def rearm() -> None:
    """Give the running test its full timeout again (called at each Hypothesis example)."""
    if _restart is not None:
        _restart()


def timeout_message(nodeid: str, seconds: float, backend_name: str) -> str:
    method = current_method()
    where = (
        f"while in backend method {method}() of backend {backend_name!r}"
        if method
        else "outside any backend method (in the suite's own code)"
    )
    return f"{nodeid}: an example ran longer than {seconds:g} s (--fp8-timeout) {where}"


def set_timer(
    item: Any, settings: Any, backend_name: str, on_thread_timeout: Callable[[str], None] | None = None
) -> bool:
    """Start the timeout of ``item`` (an answer to ``pytest_timeout_set_timer``).

    Under the thread method, ``on_thread_timeout(message)`` runs on the timer thread before
    pytest-timeout ends the process.
    """
    global _restart
    seconds = settings.timeout
    method = settings.method
    if method == "signal" and (
        not hasattr(signal, "SIGALRM") or threading.current_thread() is not threading.main_thread()
    ):
        method = "thread"

    if method == "signal":

        def handler(signum: int, frame: Any) -> None:
            __tracebackhide__ = True
            raise BackendTimeout(timeout_message(item.nodeid, seconds, backend_name))

        def start() -> None:
            signal.setitimer(signal.ITIMER_REAL, seconds)

        def cancel() -> None:
            global _restart
            _restart = None
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)

        signal.signal(signal.SIGALRM, handler)
    else:

        def expire() -> None:
            message = timeout_message(item.nodeid, seconds, backend_name)
            # Captured: pytest-timeout prints it with the test's captured stderr.
            sys.stderr.write(f"\nfp8conf: {message}\n")
            sys.stderr.flush()
            if on_thread_timeout is not None:
                try:
                    on_thread_timeout(message)
                except Exception:  # the process ends next whatever happens here
                    pass
            import pytest_timeout

            pytest_timeout.timeout_timer(item, settings)  # dumps stacks, then os._exit(1)

        timers: list[threading.Timer] = []

        def start() -> None:
            if timers:
                timers.pop().cancel()
            timer = threading.Timer(seconds, expire)
            timer.name = f"fp8conf timeout {item.nodeid}"
            timer.daemon = True
            timers.append(timer)
            timer.start()

        def cancel() -> None:
            global _restart
            _restart = None
            while timers:
                timer = timers.pop()
                timer.cancel()
                timer.join()

    _restart = start
    start()
    # pytest-timeout's pytest_timeout_cancel_timer calls this.
    item.cancel_timeout = cancel
    return True
