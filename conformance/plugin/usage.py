"""Usage errors found before any test runs: the backend, where the report goes and which
properties run.

Each is one ``pytest.UsageError`` line (exit status 4), raised while the plugin configures
itself, so a typo costs seconds, not the run it would otherwise end.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import stat
from pathlib import Path

import pytest

from conformance.api import PROPERTIES
from conformance.run.loading import ENTRY_POINT_GROUP

__all__ = ["checked_backend_spec", "checked_properties", "checked_report_path", "require_suite_dependencies", "selects"]

#: What a run of the suite imports beyond pytest, by import name, and the extra that installs it.
_SUITE_MODULES = ("hypothesis",)
SUITE_EXTRA = "fp8conf[conformance]"


def require_suite_dependencies() -> None:
    """Refuse a run whose suite cannot import what it needs, before anything else: fp8conf
    installed without its ``conformance`` extra has the plugin (inert) but not Hypothesis."""
    import importlib.util

    def absent(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is None
        except ImportError:
            return True

    missing = [name for name in _SUITE_MODULES if absent(name)]
    if missing:
        raise pytest.UsageError(
            f"--fp8-backend: the conformance suite needs {', '.join(missing)}, which is not installed; "
            f"pip install '{SUITE_EXTRA}'"
        )

_AREA = re.compile(r"^[A-Z][A-Z0-9]*$")


def checked_backend_spec(config: pytest.Config) -> str | None:
    """``--fp8-backend`` as given; None without the option.

    An empty or blank value (``--fp8-backend=$BACKEND`` with the variable unset) is refused: taken
    for "no backend", it would make the run skip every conformance test and exit 0, a green run
    that checked nothing. Only the option left out keeps the plugin inert.
    """
    spec = config.getoption("fp8_backend")
    if spec is not None and not spec.strip():
        # Only the names are read: listing must not import any backend's module.
        names = sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP).names)
        raise pytest.UsageError(
            f"--fp8-backend is empty; pass an installed backend name (installed: "
            f"{', '.join(names) or 'none'}) or package.module:Class, or leave the option out"
        )
    return spec


def _missing_folders(path: Path) -> list[Path]:
    """The folders above ``path`` that do not exist yet, nearest first."""
    missing = []
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def _create_and_remove(path: Path, missing: list[Path]) -> str | None:
    """Create the ``missing`` folders and the file ``path``, then remove all of them again; why
    that failed, None when it worked. Creating is the only answer that holds for root (to whom
    ``os.access`` says yes everywhere), ``/proc``, read-only mounts and full disks."""
    made: list[Path] = []
    try:
        for folder in reversed(missing):
            folder.mkdir()
            made.append(folder)
        # O_EXCL: a file that appeared meanwhile is never opened here, let alone removed.
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        os.unlink(path)
    except FileExistsError:
        return _open_for_appending(path)
    except OSError as exc:
        where = "" if exc.filename in (None, str(path)) else f"{exc.filename}: "
        return f"cannot be created: {where}{exc.strerror}"
    finally:
        for folder in reversed(made):
            try:
                folder.rmdir()
            except OSError:
                pass  # something else wrote into it meanwhile: not the check's to remove
    return None


def _open_for_appending(path: Path) -> str | None:
    """Open the existing file ``path`` for appending and write nothing: its bytes stay as they
    are; why it cannot be opened, None when it can."""
    try:
        with open(path, "ab"):
            pass
    except OSError as exc:
        return f"is not writable: {exc.strerror}"
    return None


def _unwritable(path: Path) -> str | None:
    """Why a file cannot be written at ``path``; None when it can."""
    if path.is_dir():
        return "is a directory"
    if path.exists():
        mode = path.stat().st_mode
        if not stat.S_ISREG(mode):
            # Opening a FIFO would wait for a reader; a device or socket is no report.
            kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device or other special file"
            return f"is {kind}, not a regular file (left as it is)"
        return _open_for_appending(path)
    missing = _missing_folders(path)
    existing = missing[-1].parent if missing else path.parent
    if not existing.is_dir():
        return f"cannot be created: {existing} is not a directory"
    return _create_and_remove(path, missing)


def checked_report_path(config: pytest.Config) -> Path | None:
    """``--fp8-report`` resolved against the invocation directory, once its JSON and Markdown
    files are known to be writable (by creating them, and removing what did not exist before);
    None without the option."""
    given = config.getoption("fp8_report")
    if given is None:
        return None
    if not given.strip():
        raise pytest.UsageError("--fp8-report is empty; give a file path, or leave the option out")
    from conformance.plugin.render import markdown_path

    path = Path(config.invocation_params.dir, given).resolve()
    if hasattr(config, "workerinput"):
        return path  # an xdist worker writes no report: its controller checked the path
    for target in (path, markdown_path(path)):
        problem = _unwritable(target)
        if problem:
            raise pytest.UsageError(
                f"--fp8-report={given}: {target} {problem}; give a file path in a writable folder"
            )
    return path


def checked_properties(config: pytest.Config) -> tuple[str, ...]:
    """The ``--fp8-property`` selections (property IDs or areas such as ``PROV``), each known
    to the spec registry; empty: every property."""
    selected = tuple(config.getoption("fp8_property") or ())
    areas = {pid.split("-", 1)[0] for pid in PROPERTIES}
    for name in selected:
        if name in PROPERTIES or (_AREA.match(name) and name in areas):
            continue
        raise pytest.UsageError(
            f"--fp8-property {name}: not a property or area of the spec; areas: "
            f"{', '.join(sorted(areas))}; properties look like PROV-003"
        )
    return selected


def selects(selected: tuple[str, ...], property_ids: list[str]) -> bool:
    """Whether a test citing ``property_ids`` is selected by ``selected`` (empty: all)."""
    if not selected:
        return True
    return any(
        pid in selected or pid.split("-", 1)[0] in selected for pid in property_ids
    )
