"""The artifact file format.

An artifact is one file::

    b"FP8CONF-ARTIFACT\\n"  | 8-byte big-endian header length | header (canonical JSON) | payload

The header (:class:`ArtifactHeader`) holds the quantization signature and its sha256, the
mechanism that wrote the payload, the payload's size and sha256, and what every graph input and
output is. :func:`read_header` checks that a file is an fp8conf artifact of a known format,
complete and uncorrupted, before anything reads the payload.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile

from fp8conf.artifacts.signature import QuantizationSignature
from fp8conf.errors import ArtifactError

__all__ = ["ARTIFACT_MAGIC", "FORMAT_VERSION", "MECHANISMS", "ArtifactHeader", "encode", "write_atomic", "read_artifact", "read_header"]

ARTIFACT_MAGIC = b"FP8CONF-ARTIFACT\n"
FORMAT_VERSION = 1
MECHANISMS = ("standalone_compile", "graph_pickler")
_LENGTH_BYTES = 8
_MAX_HEADER = 64 << 20


@dataclasses.dataclass(frozen=True)
class ArtifactHeader:
    """What an artifact says about itself, read without touching its payload."""

    format_version: int
    mechanism: str
    signature: QuantizationSignature
    fingerprint: str
    payload_size: int
    payload_sha256: str
    inputs: list
    outputs: list
    fp8conf_version: str
    note: str = ""

    def to_dict(self) -> dict:
        return {
            "format_version": self.format_version,
            "mechanism": self.mechanism,
            "signature": self.signature.to_dict(),
            "fingerprint": self.fingerprint,
            "payload_size": self.payload_size,
            "payload_sha256": self.payload_sha256,
            "inputs": self.inputs,
            "outputs": self.outputs,
            "fp8conf_version": self.fp8conf_version,
            "note": self.note,
        }


def encode(header: ArtifactHeader, payload: bytes) -> bytes:
    text = json.dumps(header.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    return ARTIFACT_MAGIC + len(text).to_bytes(_LENGTH_BYTES, "big") + text + payload


def write_atomic(path: str, data: bytes) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".fp8conf-artifact-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # a reader never sees a half-written artifact
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise



def read_artifact(path) -> tuple[ArtifactHeader, bytes]:
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ArtifactError(f"cannot read artifact {path!r}: {exc}", path=path) from exc
    if not data.startswith(ARTIFACT_MAGIC):
        raise ArtifactError(f"{path!r} is not an fp8conf artifact (bad magic bytes); save one with `fp8conf precompile save`", path=path)
    start = len(ARTIFACT_MAGIC) + _LENGTH_BYTES
    if len(data) < start:
        raise ArtifactError(f"artifact {path!r} is truncated: {len(data)} bytes, its header length is missing", path=path)
    length = int.from_bytes(data[len(ARTIFACT_MAGIC):start], "big")
    if length > _MAX_HEADER:
        raise ArtifactError(f"artifact {path!r} is corrupt: header length {length} is implausible", path=path)
    if len(data) < start + length:
        raise ArtifactError(f"artifact {path!r} is truncated: header of {length} bytes, only {len(data) - start} present", path=path)
    try:
        raw = json.loads(data[start:start + length].decode("ascii"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ArtifactError(f"artifact {path!r} is corrupt: its header is not JSON ({exc})", path=path) from None
    if not isinstance(raw, dict) or raw.get("format_version") != FORMAT_VERSION:
        version = raw.get("format_version") if isinstance(raw, dict) else None
        raise ArtifactError(f"artifact {path!r} has format version {version!r}; this fp8conf reads version {FORMAT_VERSION}. Re-save it.", path=path)
    try:
        signature = QuantizationSignature.from_dict(raw["signature"])
        header = ArtifactHeader(
            format_version=raw["format_version"],
            mechanism=raw["mechanism"],
            signature=signature,
            fingerprint=raw["fingerprint"],
            payload_size=int(raw["payload_size"]),
            payload_sha256=raw["payload_sha256"],
            inputs=raw["inputs"],
            outputs=raw["outputs"],
            fp8conf_version=raw.get("fp8conf_version", "?"),
            note=raw.get("note", ""),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ArtifactError(f"artifact {path!r} is corrupt: malformed header ({exc})", path=path) from None
    if header.mechanism not in MECHANISMS:
        raise ArtifactError(f"artifact {path!r} was written by unknown mechanism {header.mechanism!r}", path=path)
    if signature.sha256 != header.fingerprint:
        raise ArtifactError(f"artifact {path!r} is corrupt: its signature does not hash to its recorded fingerprint", path=path)
    payload = data[start + length:]
    if len(payload) != header.payload_size:
        state = "truncated" if len(payload) < header.payload_size else "corrupt (trailing bytes)"
        raise ArtifactError(f"artifact {path!r} is {state}: payload of {len(payload)} bytes, expected {header.payload_size}", path=path)
    if hashlib.sha256(payload).hexdigest() != header.payload_sha256:
        raise ArtifactError(f"artifact {path!r} is corrupt: payload sha256 does not match the header", path=path)
    return header, payload


def read_header(path) -> ArtifactHeader:
    """The header of the artifact at ``path``, after checking the file is complete and intact."""
    return read_artifact(path)[0]

