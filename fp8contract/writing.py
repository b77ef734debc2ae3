"""How a file is written: whole or not at all, and never over something that is not a file.

Every file fp8conf writes (artifacts, key files, ``fp8conf explain``'s region maps) and every
report the conformance suite writes goes through :func:`write_files`:

1. each path is checked first: an empty path, or one naming a folder, a FIFO, a device or a
   socket (a link is followed), is refused, and what is there is left as it is. Renamed over, a
   device node or a FIFO would be replaced by a regular file (as root, ``--out /dev/null`` would
   replace ``/dev/null``);
2. each file is written to a temporary file beside it (so that the rename is one file system's),
   created with its final permissions, then flushed and fsynced;
3. only once every file is written are they moved into place: a reader sees the old file or the
   new one, never half of one, and after a crash the path holds one or the other.

Any failure removes the temporary files and raises the caller's ``error`` naming the path and
the operating system's reason (fp8conf's :class:`~fp8conf.errors.FileWriteError`, the suite's
``ReportWriteError``): a full disk leaves no empty or partial file behind, so that a retry (of
``keygen``, which never overwrites) finds the path free. The module lives here, imports nothing
but the standard library, and names no error type of its own, so that the suite writes its
reports as fp8conf writes its files without depending on fp8conf.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import uuid
from typing import Callable, Mapping, Union

__all__ = ["ErrorFactory", "check_write_target", "write_file", "write_files"]

#: What a caller raises: ``error(message, path=..., reason=..., errno=...)`` returns the exception.
ErrorFactory = Callable[..., Exception]
Contents = Union[bytes, str]

# The fp8conf logger, by name: what this module does not raise for, it says there.
_logger = logging.getLogger("fp8conf")

_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)

# What to do, by the operating system's reason.
_ADVICE = {
    errno.ENOSPC: "free space there or write elsewhere",
    errno.EDQUOT: "free space there or write elsewhere",
    errno.EFBIG: "free space there or write elsewhere",
    errno.EACCES: "write into a folder you may write to",
    errno.EPERM: "write into a folder you may write to",
    errno.EROFS: "write into a folder you may write to",
    errno.ENOENT: "create the folder first, or give a path in one that exists",
    errno.ENOTDIR: "give a path whose folders are folders",
}

# Link calls that fail because the file system has no hard links, not because of the target.
_NO_HARD_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK, errno.EXDEV}


def _refusal(error: ErrorFactory, path, what: str, reason: str, advice: str, code: int | None) -> Exception:
    return error(f"cannot write the {what} {os.fspath(path)!r}: {reason}. {advice}", path=path, reason=reason, errno=code)


def _exists(error: ErrorFactory, path, what: str) -> Exception:
    advice = "It was left as it is; remove it first if you mean to replace it"
    return _refusal(error, path, what, "it exists", advice, errno.EEXIST)


def _os_refusal(error: ErrorFactory, path, what: str, exc: OSError) -> Exception:
    reason = exc.strerror or str(exc)
    advice = _ADVICE.get(exc.errno)
    advice = f"{advice[0].upper()}{advice[1:]}; the path" if advice else "The path"
    return _refusal(error, path, what, reason, f"{advice} is as it was and no temporary file is left", exc.errno)


def check_write_target(path, *, error: ErrorFactory, what: str = "file", overwrite: bool = True) -> None:
    """Raise ``error`` unless a file may be written at ``path``: a path that is not empty and
    names nothing or a regular file (a link is followed; with ``overwrite=False``, nothing at all).

    Callers that work long before they write (a compile before an artifact is saved) call it
    first; :func:`write_files` calls it again.
    """
    text = os.fsdecode(os.fspath(path))
    if not text:
        raise _refusal(error, path, what, "the path is empty", "Give a file path", errno.ENOENT)
    if not overwrite and os.path.lexists(text):
        raise _exists(error, path, what)
    if not os.path.exists(text):
        # Nothing there yet (or a dangling link, which the file replaces). A path that cannot
        # be looked at (no permission, a file on its way) fails with its reason when written.
        return
    try:
        mode = os.stat(text).st_mode
    except OSError as exc:  # it went away, or cannot be looked at after all
        raise _os_refusal(error, path, what, exc) from None
    if stat.S_ISREG(mode):
        return
    if stat.S_ISDIR(mode):
        reason, code = os.strerror(errno.EISDIR), errno.EISDIR
    else:
        kind = next((name for test, name in _KINDS if test(mode)), None)
        reason, code = (f"it is {kind}, not a regular file" if kind else "it is not a regular file"), None
    raise _refusal(error, path, what, reason, "It was left as it is; give the path of a regular file, or of none yet", code)


def write_file(path, data: Contents, *, error: ErrorFactory, what: str = "file", mode: int | None = None,
               overwrite: bool = True, make_folders: bool = False) -> None:
    """Write ``data`` (bytes, or text as UTF-8) at ``path``; see :func:`write_files`."""
    write_files({path: data}, error=error, what=what, mode=mode, overwrite=overwrite, make_folders=make_folders)


def write_files(contents: Mapping, *, error: ErrorFactory, what: str = "file", mode: int | None = None,
                overwrite: bool = True, make_folders: bool = False) -> None:
    """Write each ``{path: data}`` of ``contents`` whole (bytes, or text as UTF-8), through a
    temporary file beside it; the files are moved into place only once all are written.

    ``error(message, path=..., reason=..., errno=...)`` makes what is raised (``path`` as given,
    ``errno`` ``None`` where the path itself is refused); ``what`` names the files in messages
    (``"artifact"``, ``"key file"``). ``mode``: the files' exact permission bits, given to the
    temporary file before a byte is written (``None``: 0o666 less the umask, as an ordinary
    write). ``overwrite=False`` never replaces anything at a path, also one that appears while
    writing. ``make_folders`` creates missing folders above a path.

    No temporary file is left when it raises (also on a KeyboardInterrupt while writing), and
    nothing at a path is changed.
    """
    for path in contents:
        check_write_target(path, error=error, what=what, overwrite=overwrite)
    pending: dict = {}
    try:
        for target, data in contents.items():
            pending[target] = _temporary_beside(os.fspath(target))
            with _refused_as(error, target, what):
                if make_folders:
                    os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
                _write_whole(pending[target], data.encode("utf-8") if isinstance(data, str) else data, mode)
        for target in list(pending):
            check_write_target(target, error=error, what=what, overwrite=overwrite)  # nothing took its place meanwhile
            with _refused_as(error, target, what):
                placed = _move_into_place(pending[target], target, overwrite, what)
            if not placed:
                raise _exists(error, target, what)
            del pending[target]
    except BaseException:
        for temporary in pending.values():
            _remove_temporary(temporary)
        raise


@contextlib.contextmanager
def _refused_as(error: ErrorFactory, path, what: str):
    """The operating system's refusal of a step of writing ``path``, raised as ``error``."""
    try:
        yield
    except OSError as exc:
        raise _os_refusal(error, path, what, exc) from exc


def _remove_temporary(temporary: str) -> None:
    if not os.path.lexists(temporary):
        return  # its creation was what failed
    try:
        os.unlink(temporary)
    except OSError as exc:
        _logger.warning("could not remove the temporary file %r of a write that failed (%s); remove it", temporary, exc.strerror)


def _temporary_beside(path: str) -> str:
    # In the same folder, so that the rename is one file system's; hidden, and named after the
    # process, so that a leftover (the machine went down mid-write) says whose it was.
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name[:160]}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


def _write_whole(temporary: str, data: bytes, mode: int | None) -> None:
    # O_EXCL and O_NOFOLLOW: never write through a file or link that is already there.
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    descriptor = os.open(temporary, flags, 0o666 if mode is None else mode)
    with os.fdopen(descriptor, "wb") as file:
        if mode is not None and hasattr(os, "fchmod"):
            # The umask may have taken bits off the mode asked for; the file is still empty.
            os.fchmod(file.fileno(), mode)
        file.write(data)
        file.flush()
        # On disk before the rename: after a crash the path holds the old file or the new one.
        os.fsync(file.fileno())


def _move_into_place(temporary: str, target, overwrite: bool, what: str) -> bool:
    """Whether ``temporary`` is now at ``target``: not when ``overwrite`` is off and something is there."""
    if overwrite:
        os.replace(temporary, target)
        return True
    # A hard link fails when anything is at the target, atomically; a rename would replace it.
    try:
        os.link(temporary, target)
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in _NO_HARD_LINKS:
            raise
        _logger.warning("writing the %s %r: this file system has no hard links (%s); checking that nothing is there, "
                        "then renaming, which a file created in between would not survive", what, os.fspath(target), exc.strerror)
        if os.path.lexists(target):
            return False
        os.replace(temporary, target)
        return True
    try:
        os.unlink(temporary)
    except OSError as exc:  # the file is in place; only its second name remains
        _logger.warning("wrote the %s %r, but could not remove its temporary name %r (%s); remove it",
                        what, os.fspath(target), temporary, exc.strerror)
    return True
