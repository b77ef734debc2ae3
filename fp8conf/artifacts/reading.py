"""Reading an artifact or a key file: a regular file only, and only up to a bound checked before
a byte is read.

A path can name something other than a file of bytes: a FIFO blocks a plain ``open()`` until a
writer comes, and ``/dev/zero`` (behind a symlink named like an artifact) reads until memory
runs out. So the path is opened without blocking, what was opened is checked on its descriptor
(checking the path first and opening it after would let it be swapped in between), and the size
the descriptor reports is compared with the bound before reading; at most one byte past that
size is read, so a file that grows meanwhile is refused too.

The bound of an artifact is ``FP8CONF_ARTIFACT_MAX_BYTES`` (default 4 GiB: an artifact holds
generated code and kernels, not weights, and is read whole into memory to check its digest and
MAC). The bound of a key file is fixed: a key file holds 64 hex digits.
"""

from __future__ import annotations

import os
import stat
from typing import Callable

from fp8conf.errors import FP8ConfigError

__all__ = [
    "refuse_unless_regular_file",
    "DEFAULT_MAX_ARTIFACT_BYTES",
    "ENV_MAX_ARTIFACT_BYTES",
    "MAX_KEY_FILE_BYTES",
    "max_artifact_bytes",
    "read_regular_file",
]

ENV_MAX_ARTIFACT_BYTES = "FP8CONF_ARTIFACT_MAX_BYTES"
DEFAULT_MAX_ARTIFACT_BYTES = 4 << 30
MAX_KEY_FILE_BYTES = 4096  # 64 hex digits and a newline, with room for whitespace around them
_OPEN_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_NONBLOCK", 0)  # a FIFO opens at once instead of waiting for a writer
    | getattr(os, "O_NOCTTY", 0)  # a terminal device never becomes the controlling terminal
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_BINARY", 0)
)
_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def max_artifact_bytes() -> int:
    """The size bound of an artifact: ``$FP8CONF_ARTIFACT_MAX_BYTES``, else 4 GiB."""
    text = os.environ.get(ENV_MAX_ARTIFACT_BYTES, "").strip()
    if not text:
        return DEFAULT_MAX_ARTIFACT_BYTES
    if not text.isdigit() or int(text) == 0:
        raise FP8ConfigError(
            f"${ENV_MAX_ARTIFACT_BYTES}={os.environ[ENV_MAX_ARTIFACT_BYTES]!r} is not a positive whole number of "
            f"bytes; set it to the size of the largest artifact to read, or leave it unset (default "
            f"{DEFAULT_MAX_ARTIFACT_BYTES} bytes)"
        )
    return int(text)


def _kind(mode: int) -> str:
    return next((name for is_kind, name in _KINDS if is_kind(mode)), "not a file of bytes")


def _not_regular(name: str, info: os.stat_result) -> str:
    return f"{name} is not a regular file but {_kind(info.st_mode)}: nothing was read from it; give the path of the file itself"


def refuse_unless_regular_file(path: str, *, name: str, error: Callable[[str], Exception]) -> None:
    """Refuse ``path`` unless it names a regular file, as :func:`read_regular_file` would, without
    opening it (a FIFO does not block a ``stat``): for a caller with long work to do before it
    reads the file, so that a wrong path is said first. The reader checks again on what it opens."""
    try:
        info = os.stat(path)
    except OSError as exc:
        raise error(f"cannot read {name}: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise error(_not_regular(name, info))


def read_regular_file(
    path: str, *, name: str, limit: int, over_limit: str, error: Callable[[str], Exception]
) -> tuple[bytes, os.stat_result]:
    """The bytes of the regular file at ``path`` and its ``fstat``, the size bound ``limit``
    checked before reading.

    Every refusal is ``error(message)``, the message starting with ``name`` (what the file is and
    where, as the caller may show it). ``over_limit`` ends the message of a file over the bound,
    formatted with its ``size``: how to raise the bound, or why there is none to raise.
    """
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        raise error(f"cannot read {name}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise error(_not_regular(name, info))
        if info.st_size > limit:
            raise error(f"{name} is {info.st_size} bytes, over the bound of {limit} bytes{over_limit.format(size=info.st_size)}")
        # O_NONBLOCK does nothing to a regular file. One byte past the size it reported tells a
        # file that grows meanwhile; the read never allocates more than the file holds.
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(info.st_size + 1)
    except OSError as exc:
        raise error(f"cannot read {name}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if len(data) != info.st_size:
        raise error(f"{name} changed while it was read ({info.st_size} bytes when opened): read it again once it is written")
    return data, info
