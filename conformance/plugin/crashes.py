"""What a crashed xdist worker was doing: the test, its replay command, the backend method.

A backend that ends its process (``os._exit``, a segfault in a kernel) leaves pytest-xdist
only "worker 'gw0' crashed while running T". Each worker therefore keeps a small note, in a
folder the controller names, of the test it runs and the adapter method in progress
(:func:`conformance.run.watchdog.on_method_change`); when a worker dies, the controller adds the
note to xdist's report of the crash, which then names the method and carries a reproducer.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

from conformance.report import replay
from conformance.run import watchdog
from conformance.plugin.handoff import WorkerFolder
from conformance.plugin.report import PROPERTY_KEY, REPRODUCER_KEY

__all__ = ["CrashNotes"]

_FOLDER_KEY = "fp8conf_crash_notes"


class CrashNotes:
    """The controller's side (:meth:`configure_node`, :meth:`annotate`) and a worker's
    (:meth:`item_started`) of the notes."""

    def __init__(self, config: pytest.Config, backend_spec: str) -> None:
        self.backend_spec = backend_spec
        self._note: dict[str, Any] | None = None
        self._handoff = WorkerFolder(config, _FOLDER_KEY, ".json")
        self._path = self._handoff.mine  # this worker's note; None in the controller
        if self._path is not None:
            watchdog.on_method_change(self._method_changed)

    def close(self) -> None:
        if self._path is not None:
            watchdog.on_method_change(None)
        self._handoff.close()

    # -- the controller ------------------------------------------------------------------
    def configure_node(self, node: Any) -> None:
        self._handoff.configure_node(node)

    def annotate(self, report: Any, property_ids: tuple[str, ...]) -> None:
        """Add the dead worker's note to xdist's crash ``report``."""
        worker = getattr(getattr(report, "node", None), "gateway", None)
        path = None if worker is None else self._handoff.of(worker.id)
        if path is None:
            return
        try:
            note = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return
        if note.get("test") != report.nodeid:
            return
        method = note.get("method")
        where = (
            f"while in backend method {method}()" if method
            else "outside any backend method (in the suite's own code)"
        )
        report.longrepr = f"{report.longrepr} {where}"
        found = {
            "test": report.nodeid, "message": str(report.longrepr), "model": None,
            "command": note["command"], "failing_case": None, "reproduce_failure": None,
            "shrink": None,
        }
        report.user_properties = [
            *((PROPERTY_KEY, pid) for pid in property_ids), (REPRODUCER_KEY, found)
        ]
        report.sections.append(("fp8conf reproducer", replay.section_text(found)))

    # -- a worker ------------------------------------------------------------------------
    def item_started(self, item: pytest.Item) -> None:
        if self._path is not None:
            self._note = {"test": item.nodeid, "command": replay.command(item, self.backend_spec)}
            self._method_changed(None)

    def _method_changed(self, method: str | None) -> None:
        if self._note is None or self._path is None:
            return
        # Never import torch here: this runs inside a test's timeout, and a backend need not
        # have loaded it; when it has not, nothing is being compiled.
        torch = sys.modules.get("torch")
        if torch is not None and torch.compiler.is_compiling():
            # A test compiling a step that calls the backend (E8M0-004): Dynamo traces this
            # function too, and must not try to trace file writes; the call runs compiled.
            return
        self._note["method"] = method
        # Written whole each time: the process may end at any point after this call.
        self._path.write_text(json.dumps(self._note), encoding="utf-8")
