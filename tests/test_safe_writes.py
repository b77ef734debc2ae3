"""Every file fp8conf writes (artifacts, key files, region maps, reports) is written whole or not
at all, and never over something that is not a regular file.

A path naming a FIFO, a socket, a folder or a device node is refused with a
:class:`fp8conf.FileWriteError` naming it (a report's: the suite's ``ReportWriteError``), and the
node is left as it is (renamed over, a device node would become a regular file: as root,
``--out /dev/null`` would replace ``/dev/null``). A write the operating system refuses (a full
disk, a read-only file system) raises the same error and leaves neither a temporary file nor an
empty or partial file behind, so that ``keygen``, which never overwrites, can be run again.

The device node is made here, in the test's folder, never taken from ``/dev``. Runs that could
block on a FIFO (a plain ``open()`` for writing waits for a reader) run in a process of their
own, bounded in time. A full disk is a file size limit (``RLIMIT_FSIZE``, which holds for root
too) in a process of its own, or an ``os.fsync`` that fails with ``ENOSPC``.
"""

from __future__ import annotations

import errno
import os
import pathlib
import resource
import socket
import stat
import subprocess
import sys

import pytest

import fp8conf
from conformance.draw.models import build_model
from conformance.plugin import report_files
from fingerprint_models import SPEC_A
from fp8conf import QuantizationSignature
from fp8conf.artifacts.keys import generate_key_file, read_key_file
from fp8conf.tools.cli import main

KEY = bytes(range(100, 132))


@pytest.fixture(autouse=True)
def _signing_key(monkeypatch):
    monkeypatch.delenv("FP8CONF_ARTIFACT_KEY_FILE", raising=False)
    monkeypatch.setenv("FP8CONF_ARTIFACT_KEY", KEY.hex())


@pytest.fixture(scope="module")
def traced():
    """``(model, args, joint graph, signature)`` of SPEC_A: saved as graph_pickler, nothing compiles."""
    model, args = build_model(SPEC_A)
    return model, args, fp8conf.trace_joint(model, args), QuantizationSignature.from_model(model)


def _node(tmp_path: pathlib.Path, kind: str) -> pathlib.Path:
    """A ``kind`` of file system node that is not a regular file, in ``tmp_path``."""
    path = tmp_path / f"{kind}.out"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        with socket.socket(socket.AF_UNIX) as bound:
            bound.bind(str(path))
    elif kind == "directory":
        path.mkdir()
    elif kind == "character-device":
        try:  # the null device's numbers, at a path of the test's own
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))
        except (PermissionError, AttributeError) as exc:
            pytest.skip(f"cannot make a device node here: {exc}")
    return path


def _kind(path: pathlib.Path) -> int:
    return stat.S_IFMT(os.lstat(path).st_mode)


def _assert_left_as_it_was(raised: pytest.ExceptionInfo, path: pathlib.Path, kind: int) -> None:
    assert isinstance(raised.value, OSError)
    assert os.fspath(raised.value.path) == str(path) and str(path) in str(raised.value)
    assert "not a regular file" in raised.value.reason or raised.value.reason == "Is a directory"
    assert _kind(path) == kind, "the node was replaced"
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name], "a temporary file was left"


def _cli(*argv: str, limit_file_size: int | None = None) -> subprocess.CompletedProcess:
    """``fp8conf *argv`` in a process of its own, bounded to 120 s; ``limit_file_size``: the
    most bytes it may write to one file, as a full disk allows."""
    def limits():
        if limit_file_size is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_file_size, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        return subprocess.run([sys.executable, "-m", "fp8conf.tools.cli", *argv], capture_output=True, text=True,
                              timeout=120, preexec_fn=limits, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"fp8conf {' '.join(argv)} blocked for 120 s")


def _one_line(stderr: str, prefix: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, stderr
    return lines[0]


def _fail_fsync(monkeypatch, code: int = errno.ENOSPC) -> None:
    def fsync(descriptor):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "fsync", fsync)


# --- a target that is not a regular file is left as it is ---------------------------------------


@pytest.mark.parametrize("kind", ["fifo", "socket", "directory", "character-device"])
def test_save_artifact_refuses_a_target_that_is_not_a_regular_file(traced, tmp_path, kind):
    _, _, gm, signature = traced
    path = _node(tmp_path, kind)
    before = _kind(path)
    with pytest.raises(fp8conf.FileWriteError) as raised:
        fp8conf.save_artifact(path, gm, signature, mechanism="graph_pickler", key=KEY)
    _assert_left_as_it_was(raised, path, before)


@pytest.mark.parametrize("kind", ["fifo", "socket", "character-device"])
def test_a_report_refuses_a_target_that_is_not_a_regular_file(tmp_path, kind):
    path = _node(tmp_path, kind)
    before = _kind(path)
    with pytest.raises(report_files.ReportWriteError) as raised:
        report_files.replace_files({path: "{}"})
    _assert_left_as_it_was(raised, path, before)
    assert str(raised.value).startswith(f"cannot write the report {path}: it is a ")


@pytest.mark.parametrize("kind", ["socket", "directory", "character-device"])
def test_explain_model_refuses_a_target_that_is_not_a_regular_file(traced, tmp_path, kind):
    from fp8conf.tools.explain import explain_model

    model, args, _, _ = traced
    path = _node(tmp_path, kind)
    before = _kind(path)
    with pytest.raises(fp8conf.FileWriteError) as raised:
        explain_model(model, args, str(path))
    _assert_left_as_it_was(raised, path, before)


def test_explain_out_onto_a_fifo_exits_2_with_one_line_and_leaves_it(tmp_path):
    path = _node(tmp_path, "fifo")
    done = _cli("explain", "--out", str(path))
    line = _one_line(done.stderr, "fp8conf explain: ")
    assert done.returncode == 2 and done.stdout == ""
    assert line == (f"fp8conf explain: cannot write the region map {str(path)!r}: it is a FIFO, not a regular file. "
                    "It was left as it is; give the path of a regular file, or of none yet")
    assert _kind(path) == stat.S_IFIFO


@pytest.mark.parametrize("kind", ["fifo", "socket"])
def test_precompile_save_out_onto_a_node_exits_2_with_one_line_and_leaves_it(tmp_path, kind, capsys):
    path = _node(tmp_path, kind)
    before = _kind(path)
    argv = ["precompile", "save", "--model", "fingerprint_models:model_a", "--out", str(path), "--mechanism", "graph_pickler"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    line = _one_line(captured.err, "fp8conf precompile save: ")
    named = {"fifo": "a FIFO", "socket": "a socket"}[kind]
    assert line.startswith(f"fp8conf precompile save: cannot write the artifact {str(path)!r}: it is {named}, not a regular file")
    assert "saved" not in captured.out
    assert _kind(path) == before and sorted(p.name for p in tmp_path.iterdir()) == [path.name]


# --- a write the operating system refuses leaves nothing behind ---------------------------------


def test_save_artifact_on_a_full_disk_keeps_the_earlier_file_and_leaves_no_temporary_file(traced, tmp_path, monkeypatch):
    _, _, gm, signature = traced
    path = tmp_path / "a.fp8"
    path.write_bytes(b"the earlier artifact")
    _fail_fsync(monkeypatch)
    with pytest.raises(fp8conf.FileWriteError) as raised:
        fp8conf.save_artifact(path, gm, signature, mechanism="graph_pickler", key=KEY)
    assert (raised.value.path, raised.value.reason, raised.value.errno) == (str(path), "No space left on device", errno.ENOSPC)
    assert str(raised.value).startswith(f"cannot write the artifact {str(path)!r}: No space left on device. Free space")
    assert isinstance(raised.value, OSError) and isinstance(raised.value, fp8conf.FP8Error)
    assert path.read_bytes() == b"the earlier artifact"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.fp8"]


def test_save_artifact_into_a_read_only_file_system_raises_the_typed_error(traced, tmp_path, monkeypatch):
    # A read-only mount refuses root too, where a folder's mode 555 does not.
    _, _, gm, signature = traced
    folder = tmp_path / "read-only"
    folder.mkdir()
    real_open = os.open

    def open_(path, flags, *args, **kwargs):
        if os.path.dirname(os.path.abspath(path)) == str(folder) and flags & os.O_CREAT:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)
    with pytest.raises(fp8conf.FileWriteError) as raised:
        fp8conf.save_artifact(folder / "a.fp8", gm, signature, mechanism="graph_pickler", key=KEY)
    assert (raised.value.path, raised.value.reason) == (str(folder / "a.fp8"), "Read-only file system")
    assert list(folder.iterdir()) == []


def test_save_artifact_to_an_empty_path_raises_the_typed_error(traced, tmp_path, monkeypatch):
    _, _, gm, signature = traced
    monkeypatch.chdir(tmp_path)
    with pytest.raises(fp8conf.FileWriteError, match="the path is empty") as raised:
        fp8conf.save_artifact("", gm, signature, mechanism="graph_pickler", key=KEY)
    assert raised.value.path == ""
    assert list(tmp_path.iterdir()) == [] and list(tmp_path.parent.glob(".*.tmp")) == []


def test_keygen_on_a_full_disk_leaves_no_file_and_a_retry_writes_the_key(tmp_path):
    path = tmp_path / "k.key"
    done = _cli("precompile", "keygen", "--out", str(path), limit_file_size=16)
    assert done.returncode == 2, done.stderr
    assert list(tmp_path.iterdir()) == [], "a failed keygen left a file, which a retry would refuse as existing"
    line = _one_line(done.stderr, "fp8conf precompile keygen: ")
    assert line.startswith(f"fp8conf precompile keygen: cannot write the key file {str(path)!r}: File too large")
    assert main(["precompile", "keygen", "--out", str(path)]) == 0
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and len(read_key_file(path)) == 32


def test_a_key_file_is_private_from_its_creation_and_never_chmodded_after(tmp_path, monkeypatch):
    seen = []
    real_fsync = os.fsync

    def fsync(descriptor):
        seen.append(stat.S_IMODE(os.fstat(descriptor).st_mode))
        real_fsync(descriptor)

    def chmod(*args, **kwargs):
        raise AssertionError(f"os.chmod{args} after the key was written")

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "chmod", chmod)
    old_umask = os.umask(0o277)  # a umask that takes the owner's write bit off 0o600
    try:
        key = generate_key_file(tmp_path / "k.key")
    finally:
        os.umask(old_umask)
    assert seen == [0o600], "the key's bytes were on disk under another mode than 0600"
    assert stat.S_IMODE(os.stat(tmp_path / "k.key").st_mode) == 0o600
    assert (tmp_path / "k.key").read_text() == key.hex() + "\n"


def test_explain_on_a_full_disk_exits_2_with_one_line_and_leaves_no_file(tmp_path):
    path = tmp_path / "map.html"
    done = _cli("explain", "--out", str(path), limit_file_size=1000)
    assert done.returncode == 2, done.stderr
    assert list(tmp_path.iterdir()) == [], "a failed explain left a partial page"
    line = _one_line(done.stderr, "fp8conf explain: ")
    assert line.startswith(f"fp8conf explain: cannot write the region map {str(path)!r}: File too large")


def test_precompile_save_on_a_full_disk_exits_2_naming_the_path(tmp_path, monkeypatch, capsys):
    path = tmp_path / "a.fp8"
    _fail_fsync(monkeypatch)
    argv = ["precompile", "save", "--model", "fingerprint_models:model_a", "--out", str(path), "--mechanism", "graph_pickler"]
    assert main(argv) == 2
    line = _one_line(capsys.readouterr().err, "fp8conf precompile save: ")
    assert line.startswith(f"fp8conf precompile save: cannot write the artifact {str(path)!r}: No space left on device")
    assert list(tmp_path.iterdir()) == []


# --- the writer itself -----------------------------------------------------------------------------


def test_write_files_without_overwrite_never_replaces_a_file_that_appears_while_writing(tmp_path, monkeypatch):
    from fp8contract import writing

    path = tmp_path / "k.key"
    real_write_whole = writing._write_whole

    def write_whole(temporary, data, mode):
        real_write_whole(temporary, data, mode)
        path.write_text("someone else's")  # between the check and the move into place

    monkeypatch.setattr(writing, "_write_whole", write_whole)
    with pytest.raises(fp8conf.FileWriteError, match="it exists") as raised:
        writing.write_file(path, "mine", error=fp8conf.FileWriteError, what="key file", mode=0o600, overwrite=False)
    assert raised.value.errno == errno.EEXIST
    assert path.read_text() == "someone else's" and sorted(p.name for p in tmp_path.iterdir()) == ["k.key"]
