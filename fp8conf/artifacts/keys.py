"""The key an artifact's MAC is made with.

An artifact's payload is code that runs when it is loaded (Inductor's generated wrapper and
kernels, or a pickled graph), so fp8conf only loads an artifact whose HMAC-SHA256 verifies under
a key the user holds. The key is 32 random bytes kept as hex text in a file only its owner can
read (:func:`generate_key_file`, ``fp8conf precompile keygen --out FILE``) and found, when no
``key=`` is passed, through the environment:

* ``FP8CONF_ARTIFACT_KEY``: the key itself, as hex;
* ``FP8CONF_ARTIFACT_KEY_FILE``: the path of a key file.

Anyone holding the key can write artifacts this process will run: keep it as secret as the
permission to run code on the machines that load them. So a key file others than its owner may
read or write is refused (:class:`~fp8conf.errors.KeyFilePermissionError`), unless its owner says
the sharing is meant: ``read_key_file(path, allow_shared=True)`` or
``FP8CONF_ARTIFACT_KEY_FILE_SHARED=1`` (a secret mounted group-readable for a group of
trainers), which reads it with a warning. A key file is read as :mod:`fp8conf.artifacts.reading`
reads any file: a regular file only, of at most 4096 bytes. No message ever holds key material,
nor a value given as a key file's path that could be a key itself.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import re
import secrets
import shlex
import stat
import warnings

from fp8contract.writing import write_file
from fp8conf.artifacts.reading import MAX_KEY_FILE_BYTES, read_regular_file
from fp8conf.errors import ArtifactKeyError, FileWriteError, KeyFilePermissionError

__all__ = [
    "ENV_KEY",
    "ENV_KEY_FILE",
    "ENV_KEY_FILE_SHARED",
    "KEY_BYTES",
    "generate_key_file",
    "read_key_file",
    "resolve_key",
    "key_id",
]

ENV_KEY = "FP8CONF_ARTIFACT_KEY"
ENV_KEY_FILE = "FP8CONF_ARTIFACT_KEY_FILE"
ENV_KEY_FILE_SHARED = "FP8CONF_ARTIFACT_KEY_FILE_SHARED"
KEY_BYTES = 32
_MIN_KEY_BYTES = 16  # below this a MAC key can be guessed
# Hex or base64 text of at least 16 bytes: what a key written out looks like.
_KEY_LIKE = re.compile(r"[0-9A-Za-z+/=_-]{22,}")
_OTHERS = stat.S_IRWXG | stat.S_IRWXO


def _parse(text: str, where: str, path: str | None = None) -> bytes:
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        raise ArtifactKeyError(f"artifact key from {where} is not hex text; make one with `fp8conf precompile keygen --out FILE`", path=path) from None
    if len(key) < _MIN_KEY_BYTES:
        raise ArtifactKeyError(f"artifact key from {where} has {len(key)} bytes; at least {_MIN_KEY_BYTES} are needed ({KEY_BYTES} from keygen)", path=path)
    return key


def generate_key_file(path) -> bytes:
    """Write a new random key to ``path`` (hex, mode 0600 from its creation; an existing file is
    never overwritten) and return it. A write that fails leaves nothing at ``path``
    (:class:`~fp8conf.errors.FileWriteError`), so that it can be tried again."""
    path = os.fspath(path)
    key = secrets.token_bytes(KEY_BYTES)
    try:
        write_file(path, key.hex() + "\n", error=FileWriteError, what="key file", mode=0o600, overwrite=False)
    except FileWriteError as exc:
        if exc.errno == errno.EEXIST:
            raise ArtifactKeyError(f"{path!r} exists; fp8conf never overwrites a key file (remove it first if you mean to replace the key)", path=path) from None
        raise
    return key


def _could_be_a_key(path: str) -> bool:
    """Whether ``path`` could be a key itself rather than a key file's path: text that names
    nothing on disk and looks like hex or base64 of 16 bytes or more. Such a value is never shown."""
    return not os.path.lexists(path) and _KEY_LIKE.fullmatch(path.strip()) is not None


def _allows_shared(allow_shared: bool | None) -> bool:
    if allow_shared is not None:
        return allow_shared
    value = os.environ.get(ENV_KEY_FILE_SHARED, "")
    if value not in ("", "0", "1"):
        raise ArtifactKeyError(f"${ENV_KEY_FILE_SHARED}={value!r}: set it to 1 to read a key file others may read, or leave it unset")
    return value == "1"


def read_key_file(path, *, allow_shared: bool | None = None, given_as: str | None = None) -> bytes:
    """The key in the key file at ``path``.

    The file must be a regular file of at most 4096 bytes that only its owner may read or write:
    one that others may is a :class:`~fp8conf.errors.KeyFilePermissionError`, unless
    ``allow_shared`` (default: ``$FP8CONF_ARTIFACT_KEY_FILE_SHARED`` is ``1``), which reads it
    with a warning. ``given_as`` names where ``path`` came from (``"--key-file"``, ``"key="``) in
    messages, which say that alone when ``path`` looks like a key rather than a path.
    """
    path = os.fspath(path)
    shared_ok = _allows_shared(allow_shared)
    if _could_be_a_key(path):
        raise ArtifactKeyError(
            f"{given_as or 'the key file path'} names no file, and its value looks like a key itself rather than a path (not shown): "
            f"give a key file's path there (`fp8conf precompile keygen --out FILE` makes one), and pass a key as "
            f"bytes (key=bytes.fromhex(...)) or through ${ENV_KEY}"
        )
    data, info = read_regular_file(
        path, name=f"artifact key file {path!r}" + (f" ({given_as})" if given_as else ""), limit=MAX_KEY_FILE_BYTES,
        over_limit=" of a key file, which holds 64 hex digits; give the file `fp8conf precompile keygen` wrote",
        error=lambda message: ArtifactKeyError(message, path=path),
    )
    mode = stat.S_IMODE(info.st_mode)
    # Windows reports no group or other bits of its own (its ACLs decide): only POSIX modes say.
    if os.name == "posix" and mode & _OTHERS:
        exposed = f"its group or others may read or write it (mode {mode:o})"
        risk = "whoever reads it can write artifacts you will run"
        if not shared_ok:
            raise KeyFilePermissionError(
                f"artifact key file {path!r} is refused: {exposed}, and {risk}. Run `chmod 600 {shlex.quote(path)}`; if "
                f"sharing it is meant (a secret mounted for a group of trainers), set ${ENV_KEY_FILE_SHARED}=1 or pass "
                "allow_shared=True",
                path=path, mode=mode,
            )
        warnings.warn(f"reading artifact key file {path!r} although {exposed}, as ${ENV_KEY_FILE_SHARED}=1 or "
                      f"allow_shared=True allows: {risk}", stacklevel=2)
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise ArtifactKeyError(f"artifact key file {path!r} is not ASCII hex text; make one with `fp8conf precompile keygen --out FILE`", path=path) from None
    return _parse(text, f"key file {path!r}", path)


def resolve_key(key=None) -> bytes | None:
    """The key to sign or verify with: ``key`` (bytes, or a key file path), else
    ``FP8CONF_ARTIFACT_KEY``, else ``FP8CONF_ARTIFACT_KEY_FILE``, else ``None``."""
    if isinstance(key, (bytes, bytearray)):
        if len(key) < _MIN_KEY_BYTES:
            raise ArtifactKeyError(f"artifact key has {len(key)} bytes; at least {_MIN_KEY_BYTES} are needed")
        return bytes(key)
    if key is not None:
        if isinstance(key, str) or hasattr(key, "__fspath__"):
            return read_key_file(key, given_as="key=")
        raise ArtifactKeyError(f"key must be bytes or the path of a key file, got {type(key).__qualname__}")
    if os.environ.get(ENV_KEY):
        return _parse(os.environ[ENV_KEY], f"${ENV_KEY}")
    if os.environ.get(ENV_KEY_FILE):
        return read_key_file(os.environ[ENV_KEY_FILE], given_as=f"${ENV_KEY_FILE}")
    return None


def key_id(key: bytes) -> str:
    """A short public name of ``key`` (it reveals nothing of the key), recorded in what it signs
    so that a refusal can say which key an artifact was signed with."""
    return hmac.new(key, b"fp8conf artifact key id", hashlib.sha256).hexdigest()[:16]
