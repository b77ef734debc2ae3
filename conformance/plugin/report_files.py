"""The report's files on disk: written whole or not at all, and an earlier run's report never
left to read as this run's.

:func:`replace_files` writes the files as fp8conf writes every file
(:func:`fp8contract.writing.write_files`): each to a temporary file beside it, moved into place
once all are written, so that a reader (a CI job, a second terminal) sees the previous file or
the new one, never half of one, and a folder, FIFO or device at the path is left as it is; a
write that fails removes its temporary files and raises :class:`ReportWriteError`.
:func:`remove_earlier_report` removes the files an earlier run of the suite wrote, and only those.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

from fp8contract.writing import write_files

__all__ = ["MARKDOWN_TITLE", "ReportWriteError", "is_report", "remove_earlier_report", "replace_files"]

#: The first line of every Markdown report: how an earlier run's Markdown is recognised.
MARKDOWN_TITLE = "# fp8conf conformance report"


class ReportWriteError(OSError):
    """A report file that could not be written: ``path`` names it, ``reason`` is the operating
    system's word for why (``"No space left on device"``), or the suite's (``"it is a FIFO, not
    a regular file"``: what is there is left as it is). No temporary file is left behind."""

    def __init__(self, path: Path, reason: str, errno: int | None = None) -> None:
        super().__init__(f"cannot write the report {path}: {reason}")
        self.path = path
        self.reason = reason
        self.errno = errno

    @classmethod
    def of_write(cls, message: str, *, path: Path, reason: str, errno: int | None) -> "ReportWriteError":
        """The error :func:`fp8contract.writing.write_files` raises, in a report's words."""
        return cls(path, reason, errno)


def replace_files(contents: Mapping[Path, str]) -> None:
    """Write each text at its path, all of them whole, through a temporary file beside each;
    the files are moved into place only once every one of them is written.

    Raises :class:`ReportWriteError` naming the path and the reason when one cannot be
    written; its temporary files are removed first (also on a KeyboardInterrupt while writing).
    """
    write_files(contents, error=ReportWriteError.of_write, what="report", make_folders=True)


def is_report(path: Path) -> bool:
    """Whether ``path`` is a file the suite wrote as a report: Markdown under its title, or JSON
    with the report's ``schema_version``, ``summary`` and ``properties``. Only a regular file is
    read: reading a FIFO would wait for a writer."""
    if not path.is_file():
        return False
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
