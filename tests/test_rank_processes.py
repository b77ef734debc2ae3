"""Rank processes started from a fork server (fp8contract/rank_processes.py) get what a spawned
rank gets: the launcher's environment at the launch, its sys.path, and an output that reaches
the launcher's streams; a rank's error reaches the launcher as torch.multiprocessing raises it."""

from __future__ import annotations

import logging
import os

import pytest
import torch.multiprocessing as mp

from fp8contract import rank_processes
from fp8contract.rank_processes import start_ranks

# Rank functions: module-level, so that a rank can import them (tests/ is on sys.path).


def _say(rank: int, word: str) -> None:
    print(f"rank {rank} says {word} on stdout", flush=True)
    os.write(2, f"rank {rank} says {word} on stderr\n".encode())


def _write_environment(rank: int, name: str, out: str) -> None:
    with open(os.path.join(out, f"rank{rank}"), "w") as file:
        file.write(os.environ.get(name, "<unset>"))


def _raise(rank: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 cannot go on")


def test_what_a_rank_prints_reaches_the_launchers_streams(capfd):
    start_ranks(_say, ("hello",), nprocs=2)
    out, err = capfd.readouterr()
    assert "rank 0 says hello on stdout" in out and "rank 1 says hello on stdout" in out, out
    assert "rank 0 says hello on stderr" in err and "rank 1 says hello on stderr" in err, err


def test_a_rank_runs_in_the_environment_of_the_launch(monkeypatch, tmp_path):
    start_ranks(_say, ("first",), nprocs=1)  # the server, if this launch starts it, has no such variable
    monkeypatch.setenv("FP8CONF_RANK_PROBE", "set after the server started")
    start_ranks(_write_environment, ("FP8CONF_RANK_PROBE", str(tmp_path)), nprocs=2)
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["set after the server started"] * 2


def test_a_variable_torch_reads_at_import_changed_since_the_server_started_spawns_the_ranks(monkeypatch, tmp_path, caplog):
    start_ranks(_say, ("first",), nprocs=1)
    if rank_processes._server_environment is None:
        pytest.skip("this platform has no fork server: ranks are always spawned")
    monkeypatch.setenv("TORCH_FP8CONF_RANK_PROBE", "changed")
    with caplog.at_level(logging.INFO, logger="fp8conf"):
        start_ranks(_write_environment, ("TORCH_FP8CONF_RANK_PROBE", str(tmp_path)), nprocs=1)
    assert (tmp_path / "rank0").read_text() == "changed"
    assert any("spawned, not forked: TORCH_FP8CONF_RANK_PROBE changed" in r.getMessage() for r in caplog.records), caplog.text


def test_a_ranks_error_reaches_the_launcher():
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 cannot go on"):
        start_ranks(_raise, (), nprocs=2)
