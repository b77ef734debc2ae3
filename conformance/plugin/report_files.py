"""The report's files on disk: written whole or not at all, and an earlier run's report never
left to read as this run's.

:func:`replace_files` writes each file to a temporary file beside it and moves it into place
with ``os.replace``, so that a reader (a CI job, a second terminal) sees the previous file or
the new one, never half of one; a write that fails removes its temporary files and raises
:class:`ReportWriteError`. :func:`remove_earlier_report` removes the files an earlier run of the
suite wrote, and only those.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Mapping

__all__ = ["MARKDOWN_TITLE", "ReportWriteError", "is_report", "remove_earlier_report", "replace_files"]

#: The first line of every Markdown report: how an earlier run's Markdown is recognised.
MARKDOWN_TITLE = "# fp8conf conformance report"


class ReportWriteError(OSError):
    """A report file that could not be written: ``path`` names it, ``reason`` is the operating
    system's word for why (``"No space left on device"``). No temporary file is left behind."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"cannot write the report {path}: {reason}")
        self.path = path
        self.reason = reason


def _temporary_beside(path: Path) -> Path:
    # In the same folder, so that os.replace is a rename on one file system; hidden, and named
    # after the process, so that a leftover (the machine went down mid-write) says whose it was.
    return path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


def _write_whole(temporary: Path, text: str) -> None:
    # O_EXCL: never write through a file or link that is already there; 0o666 less the umask,
    # the mode an ordinary write gives.
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    with os.fdopen(descriptor, "w", encoding="utf-8") as file:
        file.write(text)
        file.flush()
        # On disk before the rename: after a crash the path holds the old file or the new one.
        os.fsync(file.fileno())


def replace_files(contents: Mapping[Path, str]) -> None:
    """Write each text at its path, all of them whole, through a temporary file beside each;
    the files are moved into place only once every one of them is written.

    Raises :class:`ReportWriteError` naming the path and the reason when one cannot be
    written; its temporary files are removed first (also on a KeyboardInterrupt while writing).
    """
    pending: dict[Path, Path] = {}
    target = None
    try:
        for target, text in contents.items():
            target.parent.mkdir(parents=True, exist_ok=True)
            pending[target] = _temporary_beside(target)
            _write_whole(pending[target], text)
        for target in list(pending):
            os.replace(pending[target], target)
            del pending[target]
    except BaseException as exc:
        for temporary in pending.values():
            try:
                temporary.unlink()
            except FileNotFoundError:
                pass  # its creation was what failed
        if isinstance(exc, OSError) and target is not None:
            raise ReportWriteError(target, exc.strerror or str(exc)) from exc
        raise


def is_report(path: Path) -> bool:
    """Whether ``path`` is a file the suite wrote as a report: Markdown under its title, or JSON
    with the report's ``schema_version``, ``summary`` and ``properties``."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, ValueError):  # missing, a folder, unreadable, not UTF-8
        return False
    if text.startswith(MARKDOWN_TITLE):
        return True
    try:
        found = json.loads(text)
    except ValueError:
        return False
    return isinstance(found, dict) and {"schema_version", "summary", "properties"} <= found.keys()


def remove_earlier_report(paths: tuple[Path, ...]) -> tuple[list[Path], list[str]]:
    """Remove those of ``paths`` that hold a report (:func:`is_report`); return the paths
    removed and, for each that could not be, why.

    Anything else at those paths is left as it is: a file the suite did not write cannot be
    taken for its verdict, and a mistyped ``--fp8-report`` must not cost the file it names.
    """
    removed: list[Path] = []
    problems: list[str] = []
    for path in paths:
        if not is_report(path):
            continue
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            problems.append(f"{path}: {exc.strerror or exc}")
        else:
            removed.append(path)
    return removed, problems
