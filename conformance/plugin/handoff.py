"""A folder through which xdist workers hand files to their controller.

xdist carries nothing from a worker back to its controller but test reports, and a worker that
stops the run early or crashes sends none. So the controller makes a folder when it configures
its first worker and names it in each worker's ``workerinput`` under a key of the plugin's; a
worker writes its file there, named after its ID, and the controller reads it by the same name.
The plugin's selection record (:mod:`conformance.plugin.ending`), crash notes
(:mod:`conformance.plugin.crashes`) and environment problems (:mod:`conformance.plugin.probes`)
each have one.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

__all__ = ["WorkerFolder"]


class WorkerFolder:
    """The folder of ``key`` (workerinput key) and ``suffix`` (the workers' files, ``.json``)."""

    def __init__(self, config: pytest.Config, key: str, suffix: str) -> None:
        self.key = key
        self.suffix = suffix
        workerinput = getattr(config, "workerinput", None)
        #: This worker's file; None in the controller, or in a run without xdist.
        self.mine: Path | None = None
        if workerinput is not None and key in workerinput:
            self.mine = Path(workerinput[key]) / f"{workerinput['workerid']}{suffix}"
        #: The controller's folder, made for its first worker; None before, and in a worker.
        self.folder: Path | None = None

    def configure_node(self, node: Any) -> None:
        """In the controller: name the folder in ``node``'s ``workerinput`` (made the first time)."""
        if self.folder is None:
            self.folder = Path(tempfile.mkdtemp(prefix=f"{self.key.replace('_', '-')}-"))
        node.workerinput[self.key] = str(self.folder)

    def of(self, worker_id: str) -> Path | None:
        """In the controller: the file of worker ``worker_id`` (None before any worker started)."""
        return None if self.folder is None else self.folder / f"{worker_id}{self.suffix}"

    def files(self) -> list[Path]:
        """In the controller: every worker's file, in name order."""
        return [] if self.folder is None else sorted(self.folder.glob(f"*{self.suffix}"))

    def close(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
