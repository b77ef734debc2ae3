"""The key an artifact's MAC is made with.

An artifact's payload is code that runs when it is loaded (Inductor's generated wrapper and
kernels, or a pickled graph), so fp8conf only loads an artifact whose HMAC-SHA256 verifies under
a key the user holds. The key is 32 random bytes kept as hex text in a file only its owner can
read (:func:`generate_key_file`, ``fp8conf precompile keygen --out FILE``) and found, when no
``key=`` is passed, through the environment:

* ``FP8CONF_ARTIFACT_KEY``: the key itself, as hex;
* ``FP8CONF_ARTIFACT_KEY_FILE``: the path of a key file.

Anyone holding the key can write artifacts this process will run: keep it as secret as the
permission to run code on the machines that load them. A key file is read as
:mod:`fp8conf.artifacts.reading` reads any file: a regular file only, of at most 4096 bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import warnings

from fp8conf.artifacts.reading import MAX_KEY_FILE_BYTES, read_regular_file
from fp8conf.errors import ArtifactKeyError

__all__ = ["ENV_KEY", "ENV_KEY_FILE", "KEY_BYTES", "generate_key_file", "read_key_file", "resolve_key", "key_id"]

ENV_KEY = "FP8CONF_ARTIFACT_KEY"
ENV_KEY_FILE = "FP8CONF_ARTIFACT_KEY_FILE"
KEY_BYTES = 32
_MIN_KEY_BYTES = 16  # below this a MAC key can be guessed


def _parse(text: str, where: str, path: str | None = None) -> bytes:
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        raise ArtifactKeyError(f"artifact key from {where} is not hex text; make one with `fp8conf precompile keygen --out FILE`", path=path) from None
    if len(key) < _MIN_KEY_BYTES:
        raise ArtifactKeyError(f"artifact key from {where} has {len(key)} bytes; at least {_MIN_KEY_BYTES} are needed ({KEY_BYTES} from keygen)", path=path)
    return key


def generate_key_file(path) -> bytes:
    """Write a new random key to ``path`` (hex, mode 0600; an existing file is never overwritten)
    and return it."""
    path = os.fspath(path)
    key = secrets.token_bytes(KEY_BYTES)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ArtifactKeyError(f"{path!r} exists; fp8conf never overwrites a key file (remove it first if you mean to replace the key)", path=path) from None
    except OSError as exc:
        raise ArtifactKeyError(f"cannot create key file {path!r}: {exc.strerror}", path=path) from None
    with os.fdopen(fd, "w") as f:
        f.write(key.hex() + "\n")
    os.chmod(path, 0o600)  # O_CREAT's mode is masked by the umask
    return key


def read_key_file(path) -> bytes:
    """The key in the key file at ``path``, a regular file of at most 4096 bytes; warns when
    others may read the file."""
    path = os.fspath(path)
    data, info = read_regular_file(
        path, name=f"artifact key file {path!r}", limit=MAX_KEY_FILE_BYTES,
        over_limit=" of a key file, which holds 64 hex digits; give the file `fp8conf precompile keygen` wrote",
        error=lambda message: ArtifactKeyError(message, path=path),
    )
    mode = info.st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        warnings.warn(f"artifact key file {path!r} is readable by others (mode {stat.S_IMODE(mode):o}): anyone who reads it can "
                      f"write artifacts you will run; chmod 600 it", stacklevel=2)
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
            return read_key_file(key)
        raise ArtifactKeyError(f"key must be bytes or the path of a key file, got {type(key).__qualname__}")
    if os.environ.get(ENV_KEY):
        return _parse(os.environ[ENV_KEY], f"${ENV_KEY}")
    if os.environ.get(ENV_KEY_FILE):
        return read_key_file(os.environ[ENV_KEY_FILE])
    return None


def key_id(key: bytes) -> str:
    """A short public name of ``key`` (it reveals nothing of the key), recorded in what it signs
    so that a refusal can say which key an artifact was signed with."""
    return hmac.new(key, b"fp8conf artifact key id", hashlib.sha256).hexdigest()[:16]
