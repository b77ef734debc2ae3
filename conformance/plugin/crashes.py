"""What a crashed xdist worker was doing: the test, its replay command, the backend method.

A backend that ends its process (``os._exit``, a segfault in a kernel) leaves pytest-xdist
only "worker 'gw0' crashed while running T". Each worker therefore keeps a small note, in a
folder the controller names, of the test it runs and the adapter method in progress
(:func:`conformance.run.watchdog.on_method_change`); when a worker dies, the controller adds the
note to xdist's report of the crash, which then names the method and carries a reproducer.

The method changes at every adapter call and return, hundreds of thousands of times in a run, so
the note is not a file written each time (that was a file opened and written per call, about half
of a worker's time in the main job, with the disk's write-back on top): it is kept in a
memory-mapped file (:class:`_MappedNote`), rewritten in memory at each change. The mapping is
the file's page cache, so what was last written there is the file's content even when the
process ends a moment later, however it ends; the controller reads it as a plain file.
"""

from __future__ import annotations

import json
import mmap
import struct
import sys
from pathlib import Path
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
        #: The note's bytes per method (None: outside any) for the running test.
        self._encoded: dict[str | None, bytes] = {}
        self._handoff = WorkerFolder(config, _FOLDER_KEY, ".json")
        self._path = self._handoff.mine  # this worker's note; None in the controller
        self._mapped: _MappedNote | None = None
        if self._path is not None:
            self._mapped = _MappedNote(self._path)
            watchdog.on_method_change(self._method_changed)

    def close(self) -> None:
        if self._path is not None:
            watchdog.on_method_change(None)
        if self._mapped is not None:
            self._mapped.close()
            self._mapped = None
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
        note = _MappedNote.read(path)
        if note is None:
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
            self._encoded = {}
            self._method_changed(None)

    def _method_changed(self, method: str | None) -> None:
        if self._note is None or self._mapped is None:
            return
        # Never import torch here: this runs inside a test's timeout, and a backend need not
        # have loaded it; when it has not, nothing is being compiled.
        torch = sys.modules.get("torch")
        if torch is not None and torch.compiler.is_compiling():
            # A test compiling a step that calls the backend (E8M0-004): Dynamo traces this
            # function too, and must not try to trace file writes; the call runs compiled.
            return
        encoded = self._encoded.get(method)
        if encoded is None:
            encoded = self._encoded[method] = json.dumps({**self._note, "method": method}).encode("utf-8")
        # Whole each time: the process may end at any point after this call.
        self._mapped.write(encoded)


class _MappedNote:
    """A worker's note in a memory-mapped file: a length (8 bytes, little-endian) and that many
    bytes of JSON. :meth:`write` is a copy into memory, no system call; the file grows when a note
    does not fit."""

    _HEADER = struct.Struct("<Q")
    _SIZE = 1 << 16

    def __init__(self, path: Path) -> None:
        self._file = open(path, "w+b")  # noqa: SIM115 - open as long as the worker runs
        self._map = self._mapping(self._SIZE)

    def _mapping(self, size: int) -> mmap.mmap:
        self._file.truncate(size)
        return mmap.mmap(self._file.fileno(), size)

    def write(self, data: bytes) -> None:
        needed = self._HEADER.size + len(data)
        if needed > len(self._map):
            size = max(needed, 2 * len(self._map))
            self._map.close()
            self._map = self._mapping(size)
        self._map[self._HEADER.size:needed] = data
        self._map[:self._HEADER.size] = self._HEADER.pack(len(data))

    def close(self) -> None:
        self._map.close()
        self._file.close()

    @classmethod
    def read(cls, path: Path) -> dict[str, Any] | None:
        """The note last written to ``path``; None where there is none (no file, none written yet,
        or cut short)."""
        try:
            data = path.read_bytes()
            (length,) = cls._HEADER.unpack_from(data)
            note = json.loads(data[cls._HEADER.size:cls._HEADER.size + length].decode("utf-8"))
        except (OSError, ValueError, struct.error):
            return None
        return note if isinstance(note, dict) else None
