"""What fp8conf reads as an artifact or a key file: only a regular file, and only up to a bound
checked before reading.

A path that names a FIFO blocks a plain ``open()`` for ever, and one that names ``/dev/zero``
(through a symlink, say) reads until memory runs out. Those cases run in a process of their
own, bounded in time and memory, so that a reader that blocks or reads without end fails the
test instead of hanging it or exhausting the machine.
"""

from __future__ import annotations

import os
import pathlib
import resource
import subprocess
import sys

import pytest

import fp8conf
from conformance.models import build_model
from fingerprint_models import SPEC_A
from fp8conf import ArtifactError, ArtifactKeyError, QuantizationSignature
from fp8conf.artifacts.keys import read_key_file
from fp8conf.artifacts.reading import ENV_MAX_ARTIFACT_BYTES
from fp8conf.tools.cli import main

KEY = bytes(range(100, 132))
_MEMORY_LIMIT = 3 << 30  # bytes of address space for a bounded process: torch imports in far less


@pytest.fixture(autouse=True)
def _loader_key(monkeypatch):
    for name in ("FP8CONF_ARTIFACT_KEY_FILE", ENV_MAX_ARTIFACT_BYTES):
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


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "directory"])
def test_an_artifact_path_that_is_not_a_regular_file_is_refused_without_reading(tmp_path, kind):
    path = _special(tmp_path, kind)
    code = "import sys; from fp8conf.artifacts.format import read_header; read_header(sys.argv[1])"
    proc = _bounded("-c", code, str(path))
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("fp8conf.errors.ArtifactError: ") and "is not a regular file" in last, proc.stderr
    assert str(path) in last
    for action in (["show", str(path)], ["diff", str(path), str(path)],
                   ["load", str(path), "--model", "fingerprint_models:model_a"]):
        proc = _bounded("-m", "fp8conf.tools.cli", "precompile", *action)
        last = proc.stderr.strip().splitlines()[-1]  # after torchao's notices, when load imports it
        assert proc.returncode == 2, proc.stderr
        assert last.startswith(f"fp8conf precompile {action[0]}: ArtifactError: ") and "is not a regular file" in last, proc.stderr


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_key_file_that_is_not_a_regular_file_is_refused_without_reading(genuine, tmp_path, kind):
    path = _special(tmp_path, kind)
    code = "import sys; from fp8conf.artifacts.keys import read_key_file; read_key_file(sys.argv[1])"
    proc = _bounded("-c", code, str(path))
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("fp8conf.errors.ArtifactKeyError: ") and "is not a regular file" in last, proc.stderr
    proc = _bounded("-m", "fp8conf.tools.cli", "precompile", "show", str(genuine[0]), "--key-file", str(path))
    assert proc.returncode == 2 and "is not a regular file" in proc.stderr, proc.stderr
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
