"""Artifacts you can trust: nothing of an artifact runs unless its digest and its MAC under the
loader's key verify, it was built for the loading configuration and for the model's shapes.

The artifacts here are crafted the way an attacker would: a payload that runs code when it is
unpickled (it creates a marker file), with every self-consistency an attacker can compute without
the key (the digest, the fingerprint, a MAC under a key of their own). Each is loaded through
:func:`fp8conf.load_artifact`, :func:`fp8conf.load_for_model` and ``fp8conf precompile load``;
each is refused and the marker never appears. The same payload signed with the loader's key does
run, so the refusals are what keeps it from running.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import pathlib
import pickle
import stat
import struct

import pytest
import torch

import fp8conf
from conformance.draw.models import build_model
from fingerprint_models import SPEC_A
from fp8conf import (
    ArtifactAuthenticityError,
    ArtifactError,
    ArtifactIntegrityError,
    QuantizationSignature,
    StaleArtifactError,
)
from fp8conf.artifacts.keys import generate_key_file, key_id, read_key_file
from fp8conf.tools.cli import main

KEY = bytes(range(100, 132))
OTHER_KEY = bytes(range(32))
MAGIC = b"FP8CONF-ARTIFACT/3\n"
HEADER_FIELDS = ["fingerprint", "fp8conf_version", "inputs", "key_id", "mechanism", "note", "outputs", "parts", "payload_size", "pieces", "signature", "split"]


@pytest.fixture(autouse=True)
def _loader_key(monkeypatch):
    monkeypatch.delenv("FP8CONF_ARTIFACT_KEY_FILE", raising=False)
    monkeypatch.setenv("FP8CONF_ARTIFACT_KEY", KEY.hex())


# --- crafting artifacts, independently of fp8conf's writer ---------------------------------------


@dataclasses.dataclass
class Parts:
    header: dict
    payload: bytes

    def body(self) -> bytes:
        text = json.dumps(self.header, sort_keys=True, separators=(",", ":")).encode("ascii")
        return MAGIC + struct.pack(">Q", len(text)) + text + self.payload

    def sealed(self, key: bytes | None) -> bytes:
        """The file, with a correct digest and a MAC under ``key`` (zeros: unsigned)."""
        body = self.body()
        mac = hmac.new(key, body, hashlib.sha256).digest() if key else bytes(32)
        return body + hashlib.sha256(body).digest() + mac


def parts_of(data: bytes) -> Parts:
    assert data.startswith(MAGIC)
    (length,) = struct.unpack(">Q", data[len(MAGIC):len(MAGIC) + 8])
    start = len(MAGIC) + 8
    return Parts(json.loads(data[start:start + length]), data[start + length:-64])


class _Touch:
    """Unpickling it creates ``path``: the observable stand-in for any code an attacker runs."""

    def __init__(self, path):
        self.path = pathlib.Path(path)

    def __reduce__(self):
        return (pathlib.Path.touch, (self.path,))


@pytest.fixture(scope="module")
def genuine(tmp_path_factory):
    """A signed graph_pickler artifact of SPEC_A (saved without compiling), its model and args."""
    model, args = build_model(SPEC_A)
    gm = fp8conf.trace_joint(model, args)
    path = tmp_path_factory.mktemp("genuine") / "a.fp8"
    fp8conf.save_artifact(path, gm, QuantizationSignature.from_model(model), mechanism="graph_pickler", key=KEY)
    return path, model, args


@pytest.fixture
def marker(tmp_path):
    return tmp_path / "code-ran"


@pytest.fixture
def evil(genuine, marker):
    """The genuine header over a code-running payload, its size matching."""
    parts = parts_of(genuine[0].read_bytes())
    payload = pickle.dumps(_Touch(marker))
    parts.payload, parts.header["payload_size"] = payload, len(payload)
    return parts


def _write(tmp_path, data: bytes, name="crafted.fp8") -> pathlib.Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def _assert_refused(path, error, marker, match=None):
    """Every loading entry point refuses ``path`` with ``error`` and the marker never appears."""
    model = build_model(SPEC_A)[0]
    with pytest.raises(error, match=match):
        fp8conf.load_artifact(path, QuantizationSignature.from_model(model))
    with pytest.raises(error, match=match):
        fp8conf.load_for_model(path, model)
    assert main(["precompile", "load", str(path), "--model", "fingerprint_models:model_a"]) == 3
    assert not marker.exists(), "the payload of a refused artifact ran"


# --- the control: signed with the loader's key, the payload does run ----------------------------


def test_the_code_running_payload_runs_when_the_artifact_is_signed_with_the_loaders_key(evil, marker, tmp_path):
    path = _write(tmp_path, evil.sealed(KEY))
    with pytest.raises(ArtifactError, match="torch could not load"):
        fp8conf.load_for_model(path, build_model(SPEC_A)[0])
    assert marker.exists(), "the crafted payload does not run, so the refusals below would prove nothing"


# --- authenticity -------------------------------------------------------------------------------


@pytest.mark.parametrize("mechanism", ["graph_pickler", "standalone_compile"])
def test_a_code_running_payload_with_a_self_consistent_digest_is_refused_unsigned(evil, marker, tmp_path, mechanism, capsys):
    evil.header["mechanism"] = mechanism
    path = _write(tmp_path, evil.sealed(None))
    _assert_refused(path, ArtifactAuthenticityError, marker, match="unsigned")
    assert "executable code" in capsys.readouterr().err


def test_an_artifact_signed_with_another_key_is_refused(evil, marker, tmp_path):
    evil.header["key_id"] = key_id(KEY)  # it may even claim the loader's key id
    path = _write(tmp_path, evil.sealed(OTHER_KEY))
    _assert_refused(path, ArtifactAuthenticityError, marker, match="not valid under your key")


def test_without_a_key_a_signed_artifact_is_refused(evil, marker, tmp_path, monkeypatch):
    path = _write(tmp_path, evil.sealed(KEY))
    monkeypatch.delenv("FP8CONF_ARTIFACT_KEY")
    _assert_refused(path, ArtifactAuthenticityError, marker, match="no key was given")


def test_a_stale_payload_under_a_fresh_header_resigned_without_the_key_is_refused(genuine, marker, tmp_path):
    """The issue's case: a tensorwise artifact whose header is rewritten to the rowwise signature,
    digest recomputed, the old MAC kept (or replaced by one under another key)."""
    parts = parts_of(genuine[0].read_bytes())
    old_mac = genuine[0].read_bytes()[-32:]
    rowwise = QuantizationSignature.from_model(build_model(dataclasses.replace(
        SPEC_A, layers=(dataclasses.replace(SPEC_A.layers[0], recipe="rowwise"), *SPEC_A.layers[1:])))[0])
    parts.header["signature"], parts.header["fingerprint"] = rowwise.to_dict(), rowwise.sha256
    body = parts.body()
    for data in (body + hashlib.sha256(body).digest() + old_mac, parts.sealed(OTHER_KEY)):
        path = _write(tmp_path, data)
        with pytest.raises(ArtifactAuthenticityError, match="not valid under your key"):
            fp8conf.load_artifact(path, rowwise)
    assert not marker.exists()


def test_trust_unsigned_loads_an_unsigned_artifact_with_a_warning_naming_the_risk(genuine, tmp_path, capsys):
    _, model, args = genuine
    parts = parts_of(genuine[0].read_bytes())
    parts.header["key_id"] = None
    path = _write(tmp_path, parts.sealed(None))
    with pytest.warns(UserWarning, match="executable code and runs with your permissions"):
        loaded = fp8conf.load_for_model(path, model, trust_unsigned=True)
    assert loaded.mechanism == "graph_pickler"
    with pytest.warns(UserWarning, match="executable code"):
        assert main(["precompile", "load", str(path), "--model", "fingerprint_models:model_a", "--trust-unsigned"]) == 0
    assert "loaded" in capsys.readouterr().out


@pytest.mark.parametrize("how", ["another-key", "rehashed", "no-loader-key"])
def test_trust_unsigned_never_loads_a_file_that_carries_a_mac_it_cannot_verify(genuine, evil, marker, tmp_path, monkeypatch, how):
    """``trust_unsigned`` trusts a file without a MAC, nothing else: a MAC that fails under the
    loader's key says someone tried to pass the file off as signed, and a MAC with no key to check
    it is not "unsigned" either."""
    if how == "rehashed":  # a genuine file's header altered, digest recomputed, its MAC kept
        parts = parts_of(genuine[0].read_bytes())
        parts.header["note"] = "altered"
        body = parts.body()
        data = body + hashlib.sha256(body).digest() + genuine[0].read_bytes()[-32:]
    else:
        data = evil.sealed(OTHER_KEY if how == "another-key" else KEY)
    if how == "no-loader-key":
        monkeypatch.delenv("FP8CONF_ARTIFACT_KEY")
    path = _write(tmp_path, data)
    model = build_model(SPEC_A)[0]
    match = "no key was given" if how == "no-loader-key" else "not valid under your key"
    with pytest.raises(ArtifactAuthenticityError, match=match):
        fp8conf.load_artifact(path, QuantizationSignature.from_model(model), trust_unsigned=True)
    with pytest.raises(ArtifactAuthenticityError, match="--trust-unsigned loads only files without a MAC"):
        fp8conf.load_for_model(path, model, trust_unsigned=True)
    assert main(["precompile", "load", str(path), "--model", "fingerprint_models:model_a", "--trust-unsigned"]) == 3
    assert not marker.exists(), "the payload of a file with a failing MAC ran under trust_unsigned"


# --- integrity: every header field, and every other part of the file ----------------------------


def _value_span(text: str, field: str) -> tuple[int, int]:
    start = text.index(f'"{field}":') + len(field) + 3
    _, end = json.JSONDecoder().raw_decode(text, start)
    return start, end


def test_every_header_field_is_covered():
    """The list the tests below flip is the header's whole list of fields."""
    from fp8conf.artifacts.format import _HEADER_FIELDS

    assert sorted(_HEADER_FIELDS) == HEADER_FIELDS


@pytest.mark.parametrize("field", HEADER_FIELDS)
def test_each_header_field_flipped_is_refused_before_anything_runs(evil, marker, tmp_path, field):
    """One bit of one header field flipped in a signed code-running artifact: refused as corrupt
    (digest) and, with the digest recomputed by someone without the key, as unauthentic."""
    signed = evil.sealed(KEY)
    text = signed[len(MAGIC) + 8:].decode("latin-1")
    start, end = _value_span(text, field)
    at = len(MAGIC) + 8 + (start + end) // 2
    flipped = signed[:at] + bytes([signed[at] ^ 0x01]) + signed[at + 1:]
    _assert_refused(_write(tmp_path, flipped), ArtifactIntegrityError, marker, match="digest does not match")
    body = flipped[:-64]
    rehashed = body + hashlib.sha256(body).digest() + signed[-32:]
    _assert_refused(_write(tmp_path, rehashed, "rehashed.fp8"), ArtifactAuthenticityError, marker, match="not valid under your key")


@pytest.mark.parametrize("where", ["magic", "header-length", "payload", "digest", "mac"])
def test_every_other_part_of_the_file_flipped_is_refused(evil, marker, tmp_path, where):
    signed = evil.sealed(KEY)
    at = {"magic": 3, "header-length": len(MAGIC) + 7, "payload": len(signed) - 70, "digest": len(signed) - 40, "mac": len(signed) - 1}[where]
    flipped = signed[:at] + bytes([signed[at] ^ 0x01]) + signed[at + 1:]
    error = {"magic": ArtifactError, "mac": ArtifactAuthenticityError}.get(where, ArtifactIntegrityError)
    model = build_model(SPEC_A)[0]
    with pytest.raises(error):
        fp8conf.load_for_model(_write(tmp_path, flipped), model)
    assert not marker.exists()


def test_swapped_gradient_targets_are_refused(genuine, tmp_path):
    """The issue's case: two ``outputs`` targets swapped would silently swap two gradients."""
    data = genuine[0].read_bytes()
    parts = parts_of(data)
    grads = [i for i, o in enumerate(parts.header["outputs"]) if o["kind"] == "grad"]
    a, b = grads[0], grads[1]
    outputs = parts.header["outputs"]
    outputs[a]["target"], outputs[b]["target"] = outputs[b]["target"], outputs[a]["target"]
    body = parts.body()
    with pytest.raises(ArtifactAuthenticityError):
        fp8conf.load_for_model(_write(tmp_path, body + hashlib.sha256(body).digest() + data[-32:]), genuine[1])


def test_a_header_that_is_not_what_fp8conf_writes_is_refused_even_when_trusted(genuine, tmp_path):
    """Trusting unsigned artifacts skips the MAC, never the header's own checks."""
    parts = parts_of(genuine[0].read_bytes())
    parts.header["outputs"][0] = {"kind": "grad", "target": "input.x"}
    with pytest.warns(UserWarning), pytest.raises(ArtifactError, match="header field 'outputs'"):
        fp8conf.load_for_model(_write(tmp_path, parts.sealed(None)), genuine[1], trust_unsigned=True)
    parts = parts_of(genuine[0].read_bytes())
    parts.header["extra"] = 1
    with pytest.warns(UserWarning), pytest.raises(ArtifactError, match="header fields"):
        fp8conf.load_for_model(_write(tmp_path, parts.sealed(None)), genuine[1], trust_unsigned=True)


# --- stale shapes at load -----------------------------------------------------------------------


def _never_deserialized(monkeypatch):
    from fp8conf.artifacts import store

    def never(*a, **k):
        raise AssertionError("the payload of a stale artifact was deserialized")

    monkeypatch.setattr(store, "_load_standalone", never)
    monkeypatch.setattr(store, "_load_pickled_graph", never)


def test_other_parameter_shapes_are_refused_at_load_naming_them(genuine, monkeypatch):
    _never_deserialized(monkeypatch)
    wider = dataclasses.replace(SPEC_A, layers=(dataclasses.replace(SPEC_A.layers[0], width=32), *SPEC_A.layers[1:]))
    model, _ = build_model(wider)
    with pytest.raises(StaleArtifactError) as info:
        fp8conf.load_for_model(genuine[0], model)
    names = [d[0] for d in info.value.differences]
    assert "layers.0.weight" in names and "layers.0.bias" in names and "layers.1.weight" in names
    assert "layers.0.weight: (16, 16) float32 (artifact) -> (32, 16) float32 (current)" in str(info.value)


def test_other_buffers_and_parameters_are_refused_at_load(genuine, monkeypatch):
    _never_deserialized(monkeypatch)
    model, _ = build_model(SPEC_A)
    model.register_buffer("running_scale", torch.ones(4))
    with pytest.raises(StaleArtifactError, match=r"running_scale: None \(artifact\) -> \(4,\) float32"):
        fp8conf.load_for_model(genuine[0], model)
    model, _ = build_model(SPEC_A)
    model.layers[0].bias = None
    with pytest.raises(StaleArtifactError, match=r"layers\.0\.bias: \(16,\) float32 \(artifact\) -> None"):
        fp8conf.load_for_model(genuine[0], model)


def test_other_declared_inputs_are_refused_at_load(genuine, monkeypatch):
    _never_deserialized(monkeypatch)
    model, args = build_model(dataclasses.replace(SPEC_A, batch=8))
    with pytest.raises(StaleArtifactError, match=r"input 0: \(16, 16\) float32 \(artifact\) -> \(8, 16\) float32 \(current\)"):
        fp8conf.load_for_model(genuine[0], model, args)
    with pytest.raises(StaleArtifactError, match=r"input 1: None \(artifact\)"):
        fp8conf.load_for_model(genuine[0], model, (torch.ones(16, 16), torch.ones(3)))
    assert main(["precompile", "load", str(genuine[0]), "--model", "fingerprint_models:model_a_batch_8"]) == 1


# --- keys and the exit codes of `fp8conf precompile` --------------------------------------------


def test_keygen_writes_a_private_key_file_and_never_overwrites(tmp_path, capsys):
    path = tmp_path / "k.key"
    assert main(["precompile", "keygen", "--out", str(path)]) == 0
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    key = read_key_file(path)
    assert len(key) == 32 and key_id(key) in capsys.readouterr().out
    assert main(["precompile", "keygen", "--out", str(path)]) == 2
    assert "never overwrites" in capsys.readouterr().err and read_key_file(path) == key
    with pytest.raises(fp8conf.FP8ConfigError):
        generate_key_file(path)


def test_a_key_file_signs_and_verifies_from_the_cli(genuine, tmp_path, monkeypatch, capsys):
    key_file = tmp_path / "k.key"
    generate_key_file(key_file)
    parts = parts_of(genuine[0].read_bytes())
    path = _write(tmp_path, parts.sealed(read_key_file(key_file)))
    assert main(["precompile", "load", str(path), "--model", "fingerprint_models:model_a"]) == 3  # the environment's key
    assert main(["precompile", "load", str(path), "--model", "fingerprint_models:model_a", "--key-file", str(key_file)]) == 0
    monkeypatch.delenv("FP8CONF_ARTIFACT_KEY")
    monkeypatch.setenv("FP8CONF_ARTIFACT_KEY_FILE", str(key_file))
    assert main(["precompile", "show", str(path)]) == 0
    assert "the MAC verifies under your key" in capsys.readouterr().out


def test_saving_without_a_key_says_how_to_make_one(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("FP8CONF_ARTIFACT_KEY")
    assert main(["precompile", "save", "--model", "fingerprint_models:model_a", "--out", str(tmp_path / "x.fp8")]) == 2
    assert "fp8conf precompile keygen" in capsys.readouterr().err and not (tmp_path / "x.fp8").exists()


@pytest.mark.parametrize(
    "model, message",
    [
        ("no_such_module:make", "cannot load it (ModuleNotFoundError"),
        ("fingerprint_models:no_such_factory", "cannot load it (AttributeError"),
        ("fingerprint_models", "must be MODULE:CALLABLE"),
        ("fingerprint_models:SPEC_A", "is not callable"),
        ("fingerprint_models:broken_factory", "calling it raised RuntimeError: the factory is broken"),
        ("fingerprint_models:not_a_model", "must return (model, args) or a model"),
    ],
)
def test_a_bad_model_is_a_one_line_usage_error(genuine, model, message, capsys):
    assert main(["precompile", "load", str(genuine[0]), "--model", model]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_a_model_fp8conf_refuses_is_bad_input(tmp_path, capsys):
    assert main(["precompile", "save", "--model", "fingerprint_models:unquantized_model", "--out", str(tmp_path / "x.fp8")]) == 2
    assert "NoQuantizedModulesError" in capsys.readouterr().err


def test_a_key_file_others_can_read_is_refused(tmp_path):
    path = tmp_path / "k.key"
    generate_key_file(path)
    os.chmod(path, 0o644)
    with pytest.raises(fp8conf.KeyFilePermissionError, match=f"mode 644.*chmod 600 {path}"):
        read_key_file(path)
    path.write_text("abcd\n")
    os.chmod(path, 0o600)
    with pytest.raises(fp8conf.FP8ConfigError, match="at least 16"):
        read_key_file(path)


def test_exit_codes(genuine, tmp_path, capsys):
    path = genuine[0]
    assert main(["precompile", "load", str(path), "--model", "fingerprint_models:model_a"]) == 0
    assert main(["precompile", "load", str(path), "--model", "fingerprint_models:model_b"]) == 1
    assert main(["precompile", "diff", str(path), "--model", "fingerprint_models:model_b"]) == 1
    (tmp_path / "text.fp8").write_text("hello")
    assert main(["precompile", "load", str(tmp_path / "text.fp8"), "--model", "fingerprint_models:model_a"]) == 2
    assert main(["precompile", "load", str(tmp_path / "missing.fp8"), "--model", "fingerprint_models:model_a"]) == 2
    assert main(["precompile", "diff", str(path)]) == 2
    with pytest.raises(SystemExit) as info:
        main(["precompile", "load", str(path)])  # --model missing: argparse's usage error
    assert info.value.code == 2
    (tmp_path / "cut.fp8").write_bytes(path.read_bytes()[:-10])
    for action in (["load", "--model", "fingerprint_models:model_a"], ["show"], ["diff", str(path)]):
        assert main(["precompile", action[0], str(tmp_path / "cut.fp8"), *action[1:]]) == 3
    capsys.readouterr()


def test_help_says_an_artifact_is_code_and_lists_the_exit_codes(capsys):
    with pytest.raises(SystemExit):
        main(["precompile", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "An artifact is executable code" in text and "FP8CONF_ARTIFACT_KEY_FILE" in text and "keygen" in text
    for line in ("0 success", "1 the artifact was built for another configuration", "2 usage or bad input", "3 integrity or authenticity"):
        assert line in text
    with pytest.raises(SystemExit):
        main(["precompile", "load", "--help"])
    assert "its code runs with your permissions" in " ".join(capsys.readouterr().out.split())
