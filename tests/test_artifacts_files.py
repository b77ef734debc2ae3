"""What fp8conf reads as an artifact or a key file: only a regular file, only up to a bound
checked before reading, and no key material in any message.

A path that names a FIFO blocks a plain ``open()`` for ever, and one that names ``/dev/zero``
(through a symlink, say) reads until memory runs out. Those cases run in a process of their
own, bounded in time and memory, so that a reader that blocks or reads without end fails the
test instead of hanging it or exhausting the machine.
"""

from __future__ import annotations

import json
import os
import pathlib
import resource
import stat
import subprocess
import sys

import pytest

import fp8conf
from conformance.draw.models import build_model
from fingerprint_models import SPEC_A
from fp8conf import ArtifactError, ArtifactKeyError, KeyFilePermissionError, QuantizationSignature
from fp8conf.artifacts.keys import ENV_KEY_FILE_SHARED, generate_key_file, read_key_file
from fp8conf.artifacts.reading import ENV_MAX_ARTIFACT_BYTES
from fp8conf.tools.cli import main

KEY = bytes(range(100, 132))
# Bytes of address space for a bounded process: torch imports in less (a CUDA build of torch 2.14
# on CPU, whose OpenBLAS reserves more, needs over 3 GiB); reading /dev/zero would pass it in seconds.
_MEMORY_LIMIT = 4 << 30


@pytest.fixture(autouse=True)
def _loader_key(monkeypatch):
    for name in ("FP8CONF_ARTIFACT_KEY_FILE", ENV_KEY_FILE_SHARED, ENV_MAX_ARTIFACT_BYTES):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FP8CONF_ARTIFACT_KEY", KEY.hex())


@pytest.fixture(scope="module")
def genuine(tmp_path_factory):
    """A signed graph_pickler artifact of SPEC_A (saved without compiling) and its model."""
    model, args = build_model(SPEC_A)
    path = tmp_path_factory.mktemp("genuine") / "a.fp8"
    fp8conf.save_artifact(path, fp8conf.trace_joint(model, args), QuantizationSignature.from_model(model),
                          mechanism="graph_pickler", key=KEY)
    return path, model


def _special(tmp_path: pathlib.Path, kind: str) -> pathlib.Path:
    path = tmp_path / f"{kind}.fp8"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    else:
        path.mkdir()
    return path


def _bounded(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python *args`` limited to 60 s and a few GiB of address space."""
    def limit_memory():
        resource.setrlimit(resource.RLIMIT_AS, (_MEMORY_LIMIT, _MEMORY_LIMIT))

    path = os.pathsep.join(p for p in sys.path if p)
    try:
        return subprocess.run(
            [sys.executable, *args], capture_output=True, text=True, timeout=60, preexec_fn=limit_memory,
            env={**os.environ, "PYTHONPATH": path, **(env or {})},
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{args} blocked for 60 s")


# --- only regular files are read ----------------------------------------------------------------


#: Run in one bounded process per kind of path (a process that imports torch costs seconds):
#: ``read_header``'s and each ``fp8conf precompile`` action's exit code and stderr, one JSON line
#: each, in order. A reader that blocks or reads without end takes the whole process down with it.
_READ_EVERY_WAY = """
import contextlib, io, json, sys
from fp8conf.tools.cli import main
path = sys.argv[1]
def run(call):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = call()
        except SystemExit as exc:
            code = exc.code
        except Exception as exc:
            code, _ = None, print(f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}", file=err)
    print(json.dumps([code, err.getvalue()]), flush=True)
def read():
    from fp8conf.artifacts.format import read_header
    read_header(path)
run(read)
for action in (["show", path], ["diff", path, path], ["load", path, "--model", "fingerprint_models:model_a"]):
    run(lambda: main(["precompile", *action]))
"""


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "directory"])
def test_an_artifact_path_that_is_not_a_regular_file_is_refused_without_reading(tmp_path, kind):
    path = _special(tmp_path, kind)
    proc = _bounded("-c", _READ_EVERY_WAY, str(path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("[")]
    assert len(results) == 4, proc.stdout + proc.stderr[-3000:]
    (code, err), *actions = results
    last = err.strip().splitlines()[-1]
    assert code is None and last.startswith("fp8conf.errors.ArtifactError: ") and "is not a regular file" in last, err
    assert str(path) in last
    for action, (code, err) in zip(("show", "diff", "load"), actions):
        last = err.strip().splitlines()[-1]  # after torchao's notices, when load imports it
        assert code == 2, err
        assert last.startswith(f"fp8conf precompile {action}: ArtifactError: ") and "is not a regular file" in last, err


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_key_file_that_is_not_a_regular_file_is_refused_without_reading(genuine, tmp_path, kind):
    path = _special(tmp_path, kind)
    code = "import sys; from fp8conf.artifacts.keys import read_key_file; read_key_file(sys.argv[1])"
    proc = _bounded("-c", code, str(path))
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("fp8conf.errors.ArtifactKeyError: ") and "is not a regular file" in last, proc.stderr
    proc = _bounded("-m", "fp8conf.tools.cli", "precompile", "show", str(genuine[0]), "--key-file", str(path))
    assert proc.returncode == 2 and "--key-file" in proc.stderr and "is not a regular file" in proc.stderr, proc.stderr
    proc = _bounded("-m", "fp8conf.tools.cli", "precompile", "show", str(genuine[0]), env={"FP8CONF_ARTIFACT_KEY": "",
                    "FP8CONF_ARTIFACT_KEY_FILE": str(path)})
    assert proc.returncode == 2 and "is not a regular file" in proc.stderr, proc.stderr


# --- the size bound, checked before reading -----------------------------------------------------


def test_an_artifact_over_the_size_bound_is_refused_naming_its_size_and_how_to_raise_it(genuine, monkeypatch, capsys):
    path, model = genuine
    size = path.stat().st_size
    monkeypatch.setenv(ENV_MAX_ARTIFACT_BYTES, str(size - 1))
    expected = f"artifact {str(path)!r} is {size} bytes, over the bound of {size - 1} bytes; if it is " \
               f"an artifact you expect, set {ENV_MAX_ARTIFACT_BYTES} to at least {size}"
    with pytest.raises(ArtifactError) as info:
        fp8conf.load_artifact(path, QuantizationSignature.from_model(model))
    assert str(info.value) == expected and info.value.path == str(path)
    with pytest.raises(ArtifactError, match=ENV_MAX_ARTIFACT_BYTES):
        fp8conf.read_header(path)
    assert main(["precompile", "show", str(path)]) == 2
    assert expected in capsys.readouterr().err
    monkeypatch.setenv(ENV_MAX_ARTIFACT_BYTES, str(size))
    assert fp8conf.read_header(path).mechanism == "graph_pickler"


@pytest.mark.parametrize("value", ["lots", "-1", "0", "1.5"])
def test_a_bad_size_bound_is_a_config_error_naming_the_variable(genuine, monkeypatch, value):
    monkeypatch.setenv(ENV_MAX_ARTIFACT_BYTES, value)
    with pytest.raises(fp8conf.FP8ConfigError, match=f"{ENV_MAX_ARTIFACT_BYTES}={value!r} is not a positive"):
        fp8conf.read_header(genuine[0])


def test_a_key_file_far_larger_than_a_key_is_refused_before_reading(tmp_path):
    path = tmp_path / "big.key"
    path.write_text("ab" * 50_000 + "\n")  # valid hex: read whole, it would be a 50 kB key
    os.chmod(path, 0o600)
    with pytest.raises(ArtifactKeyError, match=r"is 100001 bytes, over the bound of \d+ bytes of a key file"):
        read_key_file(path)


# --- no key material in any message -------------------------------------------------------------


def _assert_no_key_in(text: str) -> None:
    hex_key = KEY.hex()
    chunks = {hex_key[i:i + 8] for i in range(0, len(hex_key) - 7)}
    leaked = [chunk for chunk in chunks if chunk in text.lower()]
    assert not leaked, f"key material in the message: {text}"


def test_a_key_given_where_a_key_file_path_is_expected_is_never_echoed(genuine, monkeypatch, capsys):
    path, model = genuine
    signature = QuantizationSignature.from_model(model)
    with pytest.raises(ArtifactKeyError) as info:
        fp8conf.load_artifact(path, signature, key=KEY.hex())
    _assert_no_key_in(str(info.value))
    assert "key=" in str(info.value) and "bytes.fromhex" in str(info.value) and info.value.path is None
    assert main(["precompile", "show", str(path), "--key-file", KEY.hex()]) == 2
    err = capsys.readouterr().err
    _assert_no_key_in(err)
    assert "--key-file" in err and "FP8CONF_ARTIFACT_KEY" in err
    monkeypatch.setenv("FP8CONF_ARTIFACT_KEY", "")
    monkeypatch.setenv("FP8CONF_ARTIFACT_KEY_FILE", f"  {KEY.hex().upper()}\n")
    with pytest.raises(ArtifactKeyError) as info:
        fp8conf.load_artifact(path, signature)
    _assert_no_key_in(str(info.value))
    assert "$FP8CONF_ARTIFACT_KEY_FILE" in str(info.value)


def test_a_key_file_path_that_cannot_be_a_key_is_named(tmp_path):
    with pytest.raises(ArtifactKeyError, match="missing.key") as info:
        read_key_file(tmp_path / "missing.key")
    assert info.value.path == str(tmp_path / "missing.key")


# --- key file permissions -----------------------------------------------------------------------


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620], ids=["group-read", "world-read", "group-write"])
def test_a_key_file_others_may_read_or_write_is_refused(tmp_path, mode, capsys):
    path = tmp_path / "k.key"
    key = generate_key_file(path)
    os.chmod(path, mode)
    with pytest.raises(KeyFilePermissionError) as info:
        read_key_file(path)
    message = str(info.value)
    assert f"mode {mode:o}" in message and f"chmod 600 {path}" in message and ENV_KEY_FILE_SHARED in message
    assert (info.value.path, info.value.mode) == (str(path), mode)
    assert isinstance(info.value, ArtifactError) and isinstance(info.value, fp8conf.FP8ConfigError)
    assert main(["precompile", "keygen", "--out", str(tmp_path / "other.key")]) == 0
    assert main(["precompile", "show", str(tmp_path / "missing.fp8"), "--key-file", str(path)]) == 2
    assert f"chmod 600 {path}" in capsys.readouterr().err
    assert stat.S_IMODE(os.stat(path).st_mode) == mode and key  # nothing was changed behind the user's back


def test_a_shared_key_file_is_read_when_the_owner_says_so(tmp_path, monkeypatch):
    path = tmp_path / "k.key"
    key = generate_key_file(path)
    os.chmod(path, 0o644)
    with pytest.warns(UserWarning, match=f"mode 644.*{ENV_KEY_FILE_SHARED}"):
        assert read_key_file(path, allow_shared=True) == key
    monkeypatch.setenv(ENV_KEY_FILE_SHARED, "1")
    with pytest.warns(UserWarning, match="others may read"):
        assert read_key_file(path) == key
    monkeypatch.setenv(ENV_KEY_FILE_SHARED, "yes")
    with pytest.raises(ArtifactKeyError, match=f"{ENV_KEY_FILE_SHARED}='yes': set it to 1"):
        read_key_file(path)
    monkeypatch.setenv(ENV_KEY_FILE_SHARED, "0")
    with pytest.raises(KeyFilePermissionError):
        read_key_file(path)
