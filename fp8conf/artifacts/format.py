"""The artifact file format (version 3).

An artifact is one file::

    b"FP8CONF-ARTIFACT/3\\n" | 8-byte big-endian header length | header (canonical JSON) | payload
                           | sha256 of everything before (32 bytes) | HMAC-SHA256 of the same (32 bytes)

The header (:class:`ArtifactHeader`) holds the quantization signature and its sha256, the
mechanism that wrote the payload, the payload's size, what every graph input and output is and
the id of the key that signed it, and for a ``regional`` artifact its parts and the table of
its compiled pieces (version 3: each distinct compiled piece is stored once, however many call
sites use it; version 2 stored one copy per call site and is refused, to be re-saved). The
payload is code that runs when it is loaded (Inductor's generated wrapper and kernels, or a
pickled graph), so :func:`read_artifact` proves, before it
parses anything, that the bytes are the ones written (the digest: :class:`ArtifactIntegrityError`
otherwise) and that they were written by a holder of the key (the MAC, under the key of
:mod:`fp8conf.artifacts.keys`: :class:`ArtifactAuthenticityError` otherwise). Only then is the
header parsed, as bounded ASCII JSON checked field by field; the payload is left to the caller.
An unsigned artifact carries 32 zero bytes as its MAC and loads only when the caller says it
trusts unsigned artifacts, with a warning. Trusting unsigned artifacts never extends to one that
carries a MAC: a MAC that does not verify under the loader's key (another key, or altered and
re-hashed), or that no key is there to verify, is always refused. The file itself is read as
:mod:`fp8conf.artifacts.reading` reads it: a regular file only, of at most
``$FP8CONF_ARTIFACT_MAX_BYTES`` bytes, checked before a byte is read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import re
import warnings

from fp8contract.writing import write_file
from fp8conf.arguments import require
from fp8conf.artifacts.keys import ENV_KEY, ENV_KEY_FILE, key_id, resolve_key
from fp8conf.artifacts.reading import ENV_MAX_ARTIFACT_BYTES, max_artifact_bytes, read_regular_file, refuse_unless_regular_file
from fp8conf.artifacts.signature import QuantizationSignature
from fp8conf.errors import ArtifactAuthenticityError, ArtifactError, ArtifactIntegrityError, FileWriteError, FP8ConfigError
from fp8conf.log import logger

__all__ = [
    "ARTIFACT_MAGIC",
    "FORMAT_VERSION",
    "MECHANISMS",
    "ArtifactHeader",
    "check_artifact_path",
    "seal",
    "write_atomic",
    "read_artifact",
    "read_header",
    "parse_header",
    "verify_mac",
]

FORMAT_VERSION = 3
_MAGIC_PREFIX = b"FP8CONF-ARTIFACT"
ARTIFACT_MAGIC = _MAGIC_PREFIX + f"/{FORMAT_VERSION}\n".encode()
MECHANISMS = ("standalone_compile", "graph_pickler", "regional")
_LENGTH_BYTES = 8
_DIGEST_BYTES = 32
_TRAILER = 2 * _DIGEST_BYTES
_UNSIGNED = bytes(_DIGEST_BYTES)
_MAX_HEADER = 16 << 20  # a header describes inputs and modules: megabytes at most
_HEADER_FIELDS = {"mechanism", "signature", "fingerprint", "payload_size", "inputs", "outputs", "fp8conf_version", "note", "key_id", "parts", "split", "pieces"}


@dataclasses.dataclass(frozen=True)
class ArtifactHeader:
    """What an artifact says about itself, read without touching its payload.

    ``key_id`` names the key whose MAC the artifact carries (``None``: unsigned). A ``regional``
    artifact's payload is its ``parts`` one after the other (the joint graph, or a GraphPP split's
    forward, backward_input and backward_weight), each with its size and the FP8 regions compiled
    in it, then its ``pieces``: each distinct compiled piece the parts' graphs call, once, with its
    size and sha256; ``split`` holds the calling convention of a split (``None`` otherwise).
    """

    format_version: int
    mechanism: str
    signature: QuantizationSignature
    fingerprint: str
    payload_size: int
    inputs: list
    outputs: list
    fp8conf_version: str
    note: str = ""
    key_id: str | None = None
    parts: list = dataclasses.field(default_factory=list)
    split: dict | None = None
    pieces: list = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "mechanism": self.mechanism,
            "signature": self.signature.to_dict(),
            "fingerprint": self.fingerprint,
            "payload_size": self.payload_size,
            "inputs": self.inputs,
            "outputs": self.outputs,
            "fp8conf_version": self.fp8conf_version,
            "note": self.note,
            "key_id": self.key_id,
            "parts": self.parts,
            "split": self.split,
            "pieces": self.pieces,
        }


def seal(header: ArtifactHeader, payload: bytes, key: bytes | None) -> tuple[ArtifactHeader, bytes]:
    """``(header as written, file bytes)`` of ``header`` and ``payload``, signed with ``key``
    (unsigned when ``None``)."""
    header = dataclasses.replace(header, key_id=key_id(key) if key is not None else None, payload_size=len(payload))
    text = json.dumps(header.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    body = ARTIFACT_MAGIC + len(text).to_bytes(_LENGTH_BYTES, "big") + text + payload
    mac = hmac.new(key, body, hashlib.sha256).digest() if key is not None else _UNSIGNED
    return header, body + hashlib.sha256(body).digest() + mac


def write_atomic(path: str, data: bytes) -> None:
    """Write the artifact bytes ``data`` at ``path`` as :func:`fp8contract.writing.write_file`
    writes (a reader never sees half an artifact; a folder, FIFO or device at ``path`` is
    refused: :class:`~fp8conf.errors.FileWriteError`), readable by its owner alone, creating
    missing folders above it."""
    write_file(path, data, error=FileWriteError, what="artifact", mode=0o600, make_folders=True)


# --- reading ------------------------------------------------------------------------------------


def _read_bytes(path: str) -> bytes:
    data, _ = read_regular_file(
        path, name=f"artifact {path!r}", limit=max_artifact_bytes(),
        over_limit=f"; if it is an artifact you expect, set {ENV_MAX_ARTIFACT_BYTES} to at least {{size}}",
        error=lambda message: ArtifactError(message, path=path),
    )
    return _checked_magic(data, path)


def check_artifact_path(path: str) -> None:
    """:class:`~fp8conf.errors.ArtifactError` now, as reading would give it later, when ``path``
    names no regular file: for a caller that builds a model before it loads the artifact."""
    refuse_unless_regular_file(path, name=f"artifact {path!r}", error=lambda message: ArtifactError(message, path=path))


def _checked_magic(data: bytes, path: str) -> bytes:
    if not data.startswith(_MAGIC_PREFIX):
        raise ArtifactError(f"{path!r} is not an fp8conf artifact (bad magic bytes); save one with `fp8conf precompile save`", path=path)
    if not data.startswith(ARTIFACT_MAGIC):
        found = re.match(rb"FP8CONF-ARTIFACT/(\d{1,6})\n", data)
        version = int(found.group(1)) if found else 1  # format 1 had no version after the magic
        raise ArtifactError(
            f"artifact {path!r} has format version {version}; this fp8conf reads version {FORMAT_VERSION}. "
            "Re-save it with `fp8conf precompile save`.",
            path=path,
        )
    return data


def _checked_body(data: bytes, path: str) -> tuple[bytes, bytes]:
    """``(body, mac)`` once the digest proves the body intact; nothing is parsed before."""
    if len(data) < len(ARTIFACT_MAGIC) + _LENGTH_BYTES + _TRAILER:
        raise ArtifactIntegrityError(f"artifact {path!r} is truncated: {len(data)} bytes, shorter than an empty artifact", path=path)
    body, digest, mac = data[:-_TRAILER], data[-_TRAILER:-_DIGEST_BYTES], data[-_DIGEST_BYTES:]
    if not hmac.compare_digest(hashlib.sha256(body).digest(), digest):
        raise ArtifactIntegrityError(
            f"artifact {path!r} is truncated, corrupt or altered: its sha256 digest does not match its header and payload. "
            "Nothing of it was used; save it again.",
            path=path,
        )
    return body, mac


def verify_mac(body: bytes, mac: bytes, key: bytes | None) -> str:
    """``"valid"``, ``"unsigned"``, ``"no-key"`` or ``"invalid"``: the MAC of ``body`` under ``key``."""
    if mac == _UNSIGNED:
        return "unsigned"
    if key is None:
        return "no-key"
    return "valid" if hmac.compare_digest(hmac.new(key, body, hashlib.sha256).digest(), mac) else "invalid"


# A MAC claims that a holder of the key wrote the file. Trusting files that make no such claim
# must never let through one whose claim fails, or that no key is there to check.
_NOT_UNSIGNED = "; trust_unsigned=True / --trust-unsigned loads only files without a MAC, never one whose MAC cannot be verified."


def _refuse_unauthentic(status: str, body: bytes, key: bytes | None, path: str, trust_unsigned: bool) -> None:
    signed_with = _peek_key_id(body)
    mine = key_id(key) if key is not None else None
    if status == "unsigned":
        if trust_unsigned:
            warnings.warn(
                f"loading artifact {path!r} although it is unsigned: its payload is executable code and runs with your "
                "permissions; load only artifacts whose origin you trust (trust_unsigned=True / --trust-unsigned)",
                stacklevel=3,
            )
            return
        reason = "it is unsigned"
        advice = ("Load artifacts signed with your key (`fp8conf precompile keygen`, then save with it), or pass "
                  "trust_unsigned=True / --trust-unsigned if you trust where this file came from.")
    elif status == "no-key":
        reason = f"it is signed (key id {signed_with}) but no key was given to verify it (key=, ${ENV_KEY} or ${ENV_KEY_FILE})"
        advice = "Give the key it was signed with" + _NOT_UNSIGNED
    else:
        reason = (f"its MAC is not valid under your key (key id {mine}; the artifact names key id {signed_with}): "
                  "it was signed with another key, or altered and re-hashed by someone without your key")
        advice = "Load it with the key it was signed with, or save it again with yours" + _NOT_UNSIGNED
    raise ArtifactAuthenticityError(
        f"artifact {path!r} is refused: {reason}. Its payload is executable code and was not deserialized. {advice}",
        path=path, signed_with=signed_with, loader_key=mine,
    )


def _peek_key_id(body: bytes) -> str | None:
    """The key id an intact header names, for messages only (bounded JSON, never trusted)."""
    try:
        raw = json.loads(_header_bytes(body, "").decode("ascii"))
        found = raw.get("key_id") if isinstance(raw, dict) else None
        return found if isinstance(found, str) and re.fullmatch(r"[0-9a-f]{16}", found) else None
    except (ArtifactError, UnicodeDecodeError, ValueError) as exc:  # the caller reports the unknown key
        logger.debug("no key id readable in the artifact header: %r", exc)
        return None


def _header_bytes(body: bytes, path: str) -> bytes:
    start = len(ARTIFACT_MAGIC) + _LENGTH_BYTES
    length = int.from_bytes(body[len(ARTIFACT_MAGIC):start], "big")
    if length > _MAX_HEADER or start + length > len(body):
        raise ArtifactError(f"artifact {path!r} is malformed: header length {length} does not fit the file", path=path)
    return body[start:start + length]


def read_artifact(path, *, key=None, trust_unsigned: bool = False) -> tuple[ArtifactHeader, bytes]:
    """``(header, payload)`` of the artifact at ``path`` once its digest and its MAC under ``key``
    (see :func:`fp8conf.artifacts.keys.resolve_key`) are verified; ``trust_unsigned`` loads one
    that carries no MAC, with a warning, and never one whose MAC does not verify."""
    path = os.fspath(path)
    data = _read_bytes(path)
    body, mac = _checked_body(data, path)
    key = resolve_key(key)
    status = verify_mac(body, mac, key)
    if status != "valid":
        _refuse_unauthentic(status, body, key, path, trust_unsigned)
    header_bytes = _header_bytes(body, path)
    header = _parse_header(header_bytes, path)
    payload = body[len(ARTIFACT_MAGIC) + _LENGTH_BYTES + len(header_bytes):]
    if len(payload) != header.payload_size:
        raise ArtifactIntegrityError(f"artifact {path!r} is malformed: payload of {len(payload)} bytes, its header says {header.payload_size}", path=path)
    return header, payload


def read_header(path) -> ArtifactHeader:
    """The header of the artifact at ``path`` after checking its digest, without its MAC: for
    showing and diffing (parsing the header runs nothing); loading checks the MAC too."""
    require(path, "path", "read_header", "path")
    path = os.fspath(path)
    return parse_header(_read_bytes(path), path)


def parse_header(data: bytes, path) -> ArtifactHeader:
    """:func:`read_header` of an artifact file's bytes ``data``, already read from ``path``."""
    path = os.fspath(path)
    body, _ = _checked_body(_checked_magic(data, path), path)
    return _parse_header(_header_bytes(body, path), path)


def mac_status(path, *, key=None) -> str:
    """What :func:`verify_mac` says of the artifact at ``path`` under ``key`` (or the environment's)."""
    path = os.fspath(path)
    body, mac = _checked_body(_read_bytes(path), path)
    return verify_mac(body, mac, resolve_key(key))


# --- the header, field by field -----------------------------------------------------------------


def _parse_header(text: bytes, path: str) -> ArtifactHeader:
    try:
        raw = json.loads(text.decode("ascii"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ArtifactError(f"artifact {path!r} is malformed: its header is not JSON ({exc})", path=path) from None
    if not isinstance(raw, dict) or set(raw) != _HEADER_FIELDS:
        got = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        raise ArtifactError(f"artifact {path!r} is malformed: header fields {got}, expected {sorted(_HEADER_FIELDS)}", path=path)
    try:
        signature = QuantizationSignature.from_dict(raw["signature"])
    except FP8ConfigError as exc:
        raise ArtifactError(f"artifact {path!r} is malformed: {exc}", path=path) from None
    _expect(path, "mechanism", raw["mechanism"], lambda v: v in MECHANISMS)
    _expect(path, "fingerprint", raw["fingerprint"], lambda v: v == signature.sha256)
    _expect(path, "payload_size", raw["payload_size"], lambda v: type(v) is int and v >= 0)
    _expect(path, "inputs", raw["inputs"], lambda v: isinstance(v, list) and all(map(_is_input_spec, v)))
    _expect(path, "outputs", raw["outputs"], lambda v: isinstance(v, list) and all(map(_is_output_spec, v)))
    _expect(path, "key_id", raw["key_id"], lambda v: v is None or (isinstance(v, str) and re.fullmatch(r"[0-9a-f]{16}", v)))
    _expect(path, "pieces", raw["pieces"], lambda v: _are_pieces(v, raw["mechanism"]))
    _expect(path, "parts", raw["parts"], lambda v: _are_parts(v, raw["mechanism"], raw["payload_size"] - _pieces_size(raw["pieces"])))
    _expect(path, "split", raw["split"], lambda v: v is None or _is_split(v, raw["parts"]))
    for name in ("fp8conf_version", "note"):
        _expect(path, name, raw[name], lambda v: isinstance(v, str))
    return ArtifactHeader(
        FORMAT_VERSION, raw["mechanism"], signature, raw["fingerprint"], raw["payload_size"], raw["inputs"], raw["outputs"],
        raw["fp8conf_version"], raw["note"], raw["key_id"], raw["parts"], raw["split"], raw["pieces"],
    )


def _expect(path, name, value, ok) -> None:
    if not ok(value):
        raise ArtifactError(f"artifact {path!r} is malformed: header field {name!r} = {json.dumps(value)[:200]} is not valid", path=path)


_INPUT_KINDS = {"param", "buffer", "input", "tangent", "flat"}
_OUTPUT_KINDS = {"none", "grad", "output", "flat"}


def _is_name(v) -> bool:
    return isinstance(v, str) and 0 < len(v) < 1024


def _is_index(v) -> bool:
    return type(v) is int and v >= 0


def _is_input_spec(spec) -> bool:
    if not isinstance(spec, dict) or spec.get("kind") not in _INPUT_KINDS or not set(spec) <= {"kind", "target", "index", "shape", "dtype"}:
        return False
    named = _is_name(spec.get("target")) if spec["kind"] in ("param", "buffer") else _is_index(spec.get("index"))
    tensor = ("shape" in spec) == ("dtype" in spec) and (
        "shape" not in spec or (isinstance(spec["shape"], list) and all(map(_is_index, spec["shape"])) and _is_name(spec["dtype"]))
    )
    return named and tensor


def _is_output_spec(spec) -> bool:
    if not isinstance(spec, dict) or spec.get("kind") not in _OUTPUT_KINDS or not set(spec) <= {"kind", "target", "index"}:
        return False
    if spec["kind"] == "grad":
        target = spec.get("target")
        return _is_name(target) and (not target.startswith("input.") or target[6:].isdigit())
    return _is_index(spec.get("index"))



PART_NAMES = ("joint", "forward", "backward_input", "backward_weight")


def _is_region_spec(spec) -> bool:
    return (
        isinstance(spec, dict)
        and set(spec) == {"id", "module_fqn", "pass_name", "nodes"}
        and _is_name(spec["id"])
        and isinstance(spec["module_fqn"], str)
        and spec["pass_name"] in ("forward", "backward")
        and isinstance(spec["nodes"], list)
        and all(map(_is_name, spec["nodes"]))
    )


def _are_parts(parts, mechanism, payload_size) -> bool:
    if not isinstance(parts, list) or (mechanism == "regional") != bool(parts):
        return False
    if not parts:
        return True
    for part in parts:
        if not (isinstance(part, dict) and set(part) == {"name", "size", "regions"} and part["name"] in PART_NAMES
                and _is_index(part["size"]) and isinstance(part["regions"], list) and all(map(_is_region_spec, part["regions"]))):
            return False
    names = [p["name"] for p in parts]
    return names in (["joint"], list(PART_NAMES[1:])) and sum(p["size"] for p in parts) == payload_size


def _are_pieces(pieces, mechanism) -> bool:
    if not isinstance(pieces, list) or (mechanism != "regional" and pieces):
        return False
    return all(
        isinstance(p, dict) and set(p) == {"sha256", "size"} and isinstance(p["sha256"], str)
        and re.fullmatch(r"[0-9a-f]{64}", p["sha256"]) is not None and _is_index(p["size"])
        for p in pieces
    )


def _pieces_size(pieces) -> int:
    return sum(p["size"] for p in pieces)  # checked by _are_pieces first


def _is_split(split, parts) -> bool:
    fields = {"num_outputs", "saved_for_input", "saved_for_weight", "input_grads", "param_grads", "output_layout"}
    if not isinstance(split, dict) or set(split) != fields or [p["name"] for p in parts] != list(PART_NAMES[1:]):
        return False
    slots = split["output_layout"]
    return (
        _is_index(split["num_outputs"])
        and all(isinstance(split[k], list) and all(map(_is_index, split[k])) for k in ("saved_for_input", "saved_for_weight"))
        and all(isinstance(split[k], list) and all(map(_is_name, split[k])) for k in ("input_grads", "param_grads"))
        and isinstance(slots, list)
        and all(s is None or (isinstance(s, list) and len(s) == 2 and s[0] in ("output", "input_grad", "param_grad") and _is_index(s[1])) for s in slots)
    )
