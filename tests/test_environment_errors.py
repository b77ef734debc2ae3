"""The machine's problems are told apart from the backend's, and the tools survive their
environment.

* Before any property runs, the suite probes what the selected tests need: a CUDA device for
  ``--fp8-device=cuda``, a gloo process group for those marked ``fp8_gloo`` (DP-003). A problem
  is a usage error (exit status 4) naming the fix, no test runs and no report is left.
* Ranks that cannot connect mid-run are ``environment_error``, printed ``error (environment)``,
  never a failure of the backend and outside its MUST score.
* ``fp8conf doctor`` reports a broken TorchAO, a cache folder that cannot take a file, a failing
  compile or a variable torch cannot read as a ``problem`` line, exit status 1, no traceback.
* The check tools' ranks: fewer than one is a usage error; a rank's failure is one typed error
  naming the cause (fp8conf's own error as itself, a process group that did not start as
  ``ProcessGroupStartError``).

The plugin's runs are in-process pytester runs with the torch-free fake backends of
``tests/fake_backends.py`` (the probes import torch, which this process has loaded already); one
runs under xdist, in processes of its own. The doctor runs in this process with imports and
writes patched, except where torch reads a variable as it imports (a fresh process); the tools'
ranks run in this process one after another, over torch's fake process group where one must
start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch  # imported before any in-process pytester run, which would otherwise unload it

from conformance.run import distributed, environment
from conformance.plugin import report as report_model
from fp8conf import errors as fp8_errors
import fake_backends  # tests/fake_backends.py (tests/ is on sys.path)

pytest_plugins = ["pytester"]

FAKE = "--fp8-backend=fakebackends:Fake"
#: A backend that claims ``distributed``, so that its DP tests run.
DISTRIBUTED = fake_backends.BASE + """
    class Distributed(Fake):
        capabilities = frozenset({"provenance", "distributed"})
"""
# Each test writes ran-<name> when it runs: a probe that stops the run leaves none.
PROPERTY_TESTS = """
    from pathlib import Path

    import pytest

    @pytest.mark.fp8_property("PROV-001")
    def test_PROV_001_builds_on_the_device(fp8_backend, fp8_device):
        Path("ran-PROV-001").write_text(fp8_device)

    @pytest.mark.fp8_property("DP-003")
    @pytest.mark.fp8_gloo
    def test_DP_003_over_gloo(fp8_backend):
        Path("ran-DP-003").write_text("")
"""
ENVIRONMENT_STOPS = """
    import pytest

    from conformance.run.environment import EnvironmentProblem

    @pytest.mark.fp8_property("PROV-001")
    def test_PROV_001_cannot_connect(fp8_backend):
        raise EnvironmentProblem("the 2 gloo processes could not connect", evidence="RuntimeError: Connection refused",
                                 fix="set GLOO_SOCKET_IFNAME=lo")

    @pytest.mark.fp8_property("PROV-003")
    def test_PROV_003_passes(fp8_backend):
        pass
"""
# A ProcessRaisedException's text, as torch.multiprocessing gives it for a rank of DP-003 whose
# process group did not start.
RANK_START_FAILED = """

-- Process 0 terminated with the following error:
Traceback (most recent call last):
  File "/site-packages/torch/distributed/distributed_c10d.py", line 2169, in _new_process_group_helper
    backend_class = ProcessGroupGloo(
RuntimeError: [enforce fail at gloo/transport/tcp/device.cc:84] ifa != nullptr. Unable to find address for: bogus0

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "/conformance/run/distributed.py", line 325, in _gloo_worker
    raise RuntimeError(f"rank {rank}: {GLOO_START_FAILED}: {type(exc).__name__}: {' '.join(str(exc).split())}") from exc
RuntimeError: rank 0: the gloo process group did not start: RuntimeError: [enforce fail at gloo/transport/tcp/device.cc:84] ifa != nullptr. Unable to find address for: bogus0
"""
RANK_BACKEND_FAILED = """

-- Process 1 terminated with the following error:
Traceback (most recent call last):
  File "/conformance/run/distributed.py", line 330, in _gloo_worker
    backend = backend_class()
ValueError: the backend needs a license file
"""


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.delenv("FP8CONF_HYPOTHESIS_PROFILE", raising=False)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    pytester.makepyfile(fakebackends=DISTRIBUTED, test_props=PROPERTY_TESTS)
    pytester.syspathinsert()
    return pytester


def run(pytester: pytest.Pytester, *args: str, tests: str = "test_props.py") -> pytest.RunResult:
    return pytester.runpytest("-p", "no:cacheprovider", "-p", "no:randomly", *args, tests)


def ran(pytester: pytest.Pytester) -> list[str]:
    return sorted(path.name for path in pytester.path.glob("ran-*"))


# -- probed before the first test ---------------------------------------------------------------


@pytest.mark.parametrize("visible", [None, "junk"], ids=["plain", "CUDA_VISIBLE_DEVICES=junk"])
def test_cuda_on_a_torch_without_it_is_a_usage_error_before_any_test(suite, monkeypatch, visible):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    earlier = run(suite, "--fp8-backend=fakebackends:Distributed", "--fp8-report=out/r.json", "-k", "PROV")
    assert earlier.ret == 0 and (suite.path / "out" / "r.json").exists()
    (suite.path / "ran-PROV-001").unlink()
    result = run(suite, "--fp8-backend=fakebackends:Distributed", "--fp8-report=out/r.json", "--fp8-device=cuda")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()
    result.stderr.fnmatch_lines([
        "ERROR: --fp8-device=cuda: torch * is built without CUDA; install a CUDA build of torch, or run on the CPU "
        "with --fp8-device=cpu. No test ran: 1 selected test builds models on cuda"
    ])
    assert ran(suite) == [] and "Traceback" not in result.stdout.str() + result.stderr.str()
    assert "MUST score" not in result.stdout.str()  # no verdict printed for a run that had none
    # The earlier run's passing report is not left to be read as this one's.
    assert not (suite.path / "out" / "r.json").exists() and not (suite.path / "out" / "r.md").exists()


def test_fp8conf_check_passes_the_device_through_to_the_probe(suite, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from fp8conf.tools.cli import main

    status = main(["check", "--backend", "fakebackends:Fake", "--report", "r.json", "--",
                   "test_props.py", "-p", "no:randomly", "--fp8-device=cuda"])
    assert status == pytest.ExitCode.USAGE_ERROR
    assert "--fp8-device=cuda: torch" in capsys.readouterr().err
    assert ran(suite) == [] and not (suite.path / "r.json").exists()


@pytest.mark.parametrize("workers, cpus, chosen, threads", [
    ("2", 2, None, "1"), ("2", 8, None, "4"), ("3", 2, None, "1"), ("auto", 16, None, "1"),
    ("logical", 16, None, "1"), ("0", 2, None, None), ("two", 2, None, None), ("2", 8, "3", None),
])
def test_fp8conf_check_gives_each_worker_its_share_of_the_cores(workers, cpus, chosen, threads):
    from fp8conf.tools.cli import threads_per_worker

    environ = {} if chosen is None else {"OMP_NUM_THREADS": chosen}
    assert threads_per_worker(workers, environ, cpus) == threads


def test_fp8conf_check_workers_run_with_their_share_of_the_cores(suite):
    # Two workers: each left to OpenMP runs its kernels on every core and the two spin against
    # each other; each gets half the cores (at least one), which the workers themselves see.
    # fp8conf check runs as a user starts it, in a process of its own: xdist's workers take the
    # sys.path their controller started with.
    suite.makepyfile(test_threads="""
        import os
        from pathlib import Path

        import pytest

        @pytest.mark.fp8_property("PROV-001")
        @pytest.mark.parametrize("n", range(4))
        def test_PROV_001_threads(fp8_backend, n):
            Path(f"threads-{os.environ.get('PYTEST_XDIST_WORKER')}-{n}").write_text(os.environ.get("OMP_NUM_THREADS", "unset"))
    """)
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(suite.path), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "fp8conf.tools.cli", "check", "--backend", "fakebackends:Fake", "--report", "r.json",
         "-n", "2", "--", "test_threads.py", "-p", "no:randomly"],
        cwd=suite.path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    seen = {path.name: path.read_text() for path in suite.path.glob("threads-*")}
    assert len(seen) == 4 and all("-gw" in name for name in seen), seen  # run by the xdist workers
    assert set(seen.values()) == {str(max(1, (os.cpu_count() or 1) // 2))}, seen


def test_a_cuda_torch_without_a_visible_device_names_the_variable(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "junk")
    problem = environment.cuda_problem("cuda")
    assert "no CUDA device is usable" in problem and "CUDA_VISIBLE_DEVICES='junk' is set: unset it" in problem, problem
    assert environment.cuda_problem("cpu") is None


def test_gloo_that_cannot_start_is_a_usage_error_naming_the_variable(suite, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "bogus0")
    result = run(suite, "--fp8-backend=fakebackends:Distributed")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()
    result.stderr.fnmatch_lines([
        "ERROR: DP-003 runs ranks in gloo processes on this machine, but the gloo process group did not start: "
        "*Unable to find address for: bogus0; GLOO_SOCKET_IFNAME='bogus0' names no network interface of this "
        "machine: unset it, or name one that `ip link` lists (lo for ranks on one machine). No test ran; or leave "
        "DP-003 out (--fp8-property, -k) to run the others"
    ])
    assert ran(suite) == [] and "Traceback" not in result.stdout.str() + result.stderr.str()


def test_gloo_is_probed_only_for_a_gloo_test_that_will_run(suite, monkeypatch):
    probed = []
    monkeypatch.setattr(environment, "gloo_problem", lambda world=2: probed.append(world))
    # Deselected, and not claimed by the backend (not_supported): no probe.
    assert run(suite, "--fp8-backend=fakebackends:Distributed", "-k", "PROV").ret == 0
    assert run(suite, FAKE).ret == 0
    assert probed == [] and ran(suite) == ["ran-PROV-001"]
    assert run(suite, "--fp8-backend=fakebackends:Distributed", "--fp8-property=DP").ret == 0
    assert probed == [2] and ran(suite) == ["ran-DP-003", "ran-PROV-001"]


def test_the_gloo_probe_is_quick_where_gloo_works(monkeypatch):
    import time

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    started = time.perf_counter()
    assert environment.gloo_problem() is None
    assert time.perf_counter() - started < 2.0


@pytest.mark.slow
def test_a_probe_problem_under_xdist_is_the_same_usage_error(suite, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "bogus0")
    result = suite.runpytest_subprocess(
        "-p", "no:cacheprovider", "-p", "no:randomly", "-n", "2", "--fp8-backend=fakebackends:Distributed",
        "--fp8-report=r.json", "test_props.py",
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str() + result.stderr.str()
    result.stderr.fnmatch_lines(["ERROR: DP-003 runs ranks in gloo processes on this machine, but *GLOO_SOCKET_IFNAME='bogus0'*"])
    assert ran(suite) == [] and not (suite.path / "r.json").exists()


# -- mid-run: the machine, not the backend ------------------------------------------------------


def _ranks_raising(monkeypatch, text):
    import torch.multiprocessing as mp

    def start_processes(*args, **kwargs):
        raise mp.ProcessRaisedException(text, 0, 12345)

    monkeypatch.setattr(mp, "start_processes", start_processes)


class _Backend:
    """Stands for a backend class: the ranks never start here."""


def test_ranks_whose_process_group_did_not_start_are_an_environment_problem(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "bogus0")
    _ranks_raising(monkeypatch, RANK_START_FAILED)
    with pytest.raises(environment.EnvironmentProblem) as raised:
        distributed.gloo_gradients(_Backend, ())
    message = str(raised.value)
    assert message.startswith("the 2 gloo processes could not connect: RuntimeError: rank 0: the gloo process group "
                              "did not start: RuntimeError: [enforce fail"), message
    assert "Unable to find address for: bogus0" in raised.value.evidence
    assert raised.value.fix.startswith("GLOO_SOCKET_IFNAME='bogus0' names no network interface of this machine")


def test_a_rank_that_fails_in_the_backend_stays_the_backends_failure(monkeypatch):
    import torch.multiprocessing as mp

    _ranks_raising(monkeypatch, RANK_BACKEND_FAILED)
    with pytest.raises(mp.ProcessRaisedException, match="license file"):
        distributed.gloo_gradients(_Backend, ())
    assert environment.gloo_start_evidence(RANK_BACKEND_FAILED) is None


def test_an_environment_error_is_reported_apart_from_the_backends_failures(suite):
    suite.makepyfile(test_stops=ENVIRONMENT_STOPS)
    result = run(suite, FAKE, "--fp8-report=r.json", tests="test_stops.py")
    # Nothing of the backend failed: the run's failure is a usage error, like a probe's.
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()
    result.stdout.fnmatch_lines([
        "PROV-001*test_PROV_001_cannot_connect  error (environment)*",
        "MUST score: 1/2 passed, 1 not checked: error (environment) [PROV-001] (backend fake 1.2)",
        "PROV-001 error (environment), not a failure of the backend: the 2 gloo processes could not connect: "
        "RuntimeError: Connection refused; set GLOO_SOCKET_IFNAME=lo",
    ])
    result.assert_outcomes(passed=1, errors=1)
    report = json.loads((suite.path / "r.json").read_text())
    row = report["properties"]["PROV-001"]
    assert row["status"] == report_model.ENVIRONMENT_ERROR and row["reproducer"] is None and "evidence" not in row
    assert row["reason"].endswith("Connection refused; set GLOO_SOCKET_IFNAME=lo")
    summary = report["summary"]
    assert (summary["must_passed"], summary["must_applicable"], summary["must_total"]) == (1, 1, 2)
    assert summary["must_environment_errors"] == ["PROV-001"] and summary["defects"] == []
    # 1/1 of what ran would read as a pass of a run the machine stopped.
    assert summary["must_score"] is None
    assert "| PROV-001 | MUST | provenance | error (environment) |" in (suite.path / "r.md").read_text()


def test_a_backend_failure_beside_an_environment_error_keeps_its_exit_status(suite):
    suite.makepyfile(test_stops=ENVIRONMENT_STOPS.replace("def test_PROV_003_passes(fp8_backend):\n        pass",
                                                          "def test_PROV_003_fails(fp8_backend):\n        assert False"))
    result = run(suite, FAKE, tests="test_stops.py")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(failed=1, errors=1)


# -- fp8conf doctor: the environment is a finding ------------------------------------------------


def _doctor(capsys) -> tuple[int, str]:
    from fp8conf.tools.cli import main

    status = main(["doctor"])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    return status, captured.out


@pytest.mark.parametrize("torchao", [None, "empty"], ids=["cannot_be_imported", "empty"])
def test_doctor_reports_a_broken_torchao(monkeypatch, capsys, torchao):
    import sys
    import types

    # None in sys.modules makes every import of torchao fail, as a broken install's does.
    monkeypatch.setitem(sys.modules, "torchao", None if torchao is None else types.ModuleType("torchao"))
    status, out = _doctor(capsys)
    assert status == 1
    if torchao is None:
        assert "torchao  cannot be imported" in out
        assert "problem  torchao cannot be imported: ModuleNotFoundError: " in out and "reinstall it" in out, out
    else:
        assert "torchao  not a TorchAO installation" in out
        assert "is not a TorchAO installation (it has no __version__); reinstall it" in out, out
    assert "fast paths not checked: torchao " in out and "on   fast call" not in out, out


def test_doctor_reports_an_inductor_cache_folder_that_cannot_take_a_file(monkeypatch, capsys, tmp_path):
    import errno
    import os

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(os, "fsync", full)
    status, out = _doctor(capsys)
    assert status == 1
    assert (f"problem  Inductor's cache folder {tmp_path} cannot take a file (No space left on device): Inductor writes "
            "every kernel it compiles there; free space there, or point TORCHINDUCTOR_CACHE_DIR at a folder that can") in out, out
    assert "fast paths not checked: Inductor's cache folder cannot take a file" in out
    assert list(tmp_path.iterdir()) == []  # the check's file is gone


def test_doctor_reports_a_compile_that_fails_here(monkeypatch, capsys):
    import errno

    import fp8conf.compile

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", "/tmp/torchinductor_x/ab/kernel.py")

    monkeypatch.setattr(fp8conf.compile, "compile_joint", full_disk)
    status, out = _doctor(capsys)
    assert status == 1
    assert ("problem  compiling a small FP8 model here failed: OSError: [Errno 28] No space left on device: "
            "'/tmp/torchinductor_x/ab/kernel.py'") in out, out
    assert "fast paths not checked: the compile failed" in out


@pytest.mark.parametrize(("variable", "value", "line"), [
    ("TORCH_LOGS", "nonsense", "problem  torch cannot be imported: ValueError: Invalid log settings: nonsense, "),
    ("TORCHINDUCTOR_COMPILE_THREADS", "abc",
     "problem  Inductor's configuration cannot be read: ValueError: invalid literal for int() with base 10: 'abc'; "),
])
def test_doctor_names_a_variable_torch_cannot_read(variable, value, line):
    """A fresh process: torch reads these as it imports."""
    import os
    import subprocess
    import sys

    env = {**os.environ, variable: value}
    proc = subprocess.run([sys.executable, "-m", "fp8conf.tools.cli", "doctor"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert line in proc.stdout, proc.stdout
    assert f"set in the environment: {variable}={value!r}: unset it or give it a value torch accepts" in proc.stdout
    assert "fast paths not checked: " in proc.stdout


# -- the check tools' ranks: one typed error naming the cause ------------------------------------


def _ranks_in_this_process(monkeypatch, start_process_group=None):
    """Run a tool's ranks in this process, one after another, as torch.multiprocessing reports a
    failed rank; with ``start_process_group``, in place of the tool's."""
    import os
    import traceback

    import torch.multiprocessing as mp

    from fp8conf.tools import ranks

    def start_processes(fn, args=(), nprocs=1, join=True, start_method="spawn"):
        for rank in range(nprocs):
            try:
                fn(rank, *args)
            except Exception:
                raise mp.ProcessRaisedException(
                    f"\n\n-- Process {rank} terminated with the following error:\n{traceback.format_exc()}", rank, os.getpid()
                ) from None

    monkeypatch.setattr(mp, "start_processes", start_processes)
    if start_process_group is not None:
        monkeypatch.setattr(ranks, "start_process_group", start_process_group)


def _fake_process_group(backend, init_file, rank, ranks, **options):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=ranks)


@pytest.mark.parametrize("ranks", ["0", "-2"])
def test_a_tool_refuses_fewer_than_one_rank_as_a_usage_error(capsys, ranks):
    from fp8conf.tools import pipeline_check, sharded_check, tensor_parallel_check

    for tool in (sharded_check, pipeline_check, tensor_parallel_check):
        with pytest.raises(SystemExit) as ended:
            tool.main(["--ranks", ranks])
        assert ended.value.code == 2
        assert f"argument --ranks: {ranks}: give 1 or more ranks" in capsys.readouterr().err
    with pytest.raises(fp8_errors.FP8ConfigError, match="ranks must be a whole number of 1 or more, got 0"):
        sharded_check.launch(ranks=0)


def test_fp8conf_own_error_on_a_rank_is_raised_as_itself(monkeypatch, capsys):
    from fp8conf.tools import sharded_check

    # Rank 0 of 3, over a fake process group: the model's 64 rows do not divide by 3.
    _ranks_in_this_process(monkeypatch, _fake_process_group)
    with pytest.raises(fp8_errors.FP8ConfigError, match="cannot be sharded evenly along dim 0 over 3 ranks") as raised:
        sharded_check.launch(ranks=3, float8_all_gather=True, dim=64, blocks=1, tokens=6, repeats=1)
    assert raised.value.__notes__ == ["raised on rank 0 of 3 of sharded_check"]
    assert sharded_check.main(["--ranks", "3", "--float8-all-gather", "on", "--blocks", "1", "--repeats", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sharded_check: FP8ConfigError: shard_data_parallel: parameter 'model.blocks.0.norm.weight' of "
                          "shape (64,) cannot be sharded evenly along dim 0 over 3 ranks"), err
    assert err.rstrip().endswith("(raised on rank 0 of 3 of sharded_check)") and "Traceback" not in err


@pytest.mark.parametrize("tool", ["sharded_check", "pipeline_check"])
def test_a_process_group_that_cannot_start_is_one_typed_error_naming_the_variable(monkeypatch, capsys, tool):
    import importlib

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "bogus0")
    _ranks_in_this_process(monkeypatch)
    module = importlib.import_module(f"fp8conf.tools.{tool}")
    with pytest.raises(fp8_errors.ProcessGroupStartError) as raised:
        module.launch(ranks=2)
    assert raised.value.rank == 0 and "Unable to find address for: bogus0" in raised.value.reason
    assert module.main(["--ranks", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{tool}: ProcessGroupStartError: the gloo process group of 2 ranks did not start on rank 0: "
                          "RuntimeError: [enforce fail"), err
    assert "GLOO_SOCKET_IFNAME='bogus0' is set: unset it, or name a network interface of this machine" in err
    assert "Traceback" not in err


def test_any_other_rank_failure_is_a_rank_failed_error(monkeypatch):
    import pickle

    import torch.multiprocessing as mp

    from fp8conf.tools import ranks

    def broken(rank):
        raise RuntimeError(f"rank {rank}: no kernel for this dtype")

    _ranks_in_this_process(monkeypatch)
    with pytest.raises(fp8_errors.RankFailedError, match=r"^tool: rank 0 of 2 failed: RuntimeError: rank 0: no kernel") as raised:
        ranks.spawn(broken, (), ranks=2, tool="tool")
    assert raised.value.rank == 0 and raised.value.reason == "RuntimeError: rank 0: no kernel for this dtype"

    def killed(*args, **kwargs):
        raise mp.ProcessExitedException("process 1 terminated with signal SIGKILL", 1, 123, -9, "SIGKILL")

    monkeypatch.setattr(mp, "start_processes", killed)
    with pytest.raises(fp8_errors.RankFailedError, match="rank 1 of 2 failed: it ended without an error of its own"):
        ranks.spawn(broken, (), ranks=2, tool="tool")
    # What a rank raises travels to its launcher pickled: the typed errors survive it whole.
    sent = fp8_errors.ProcessGroupStartError("did not start", rank=1, reason="RuntimeError: x")
    received = pickle.loads(pickle.dumps(sent))
    assert (type(received), received.rank, received.reason) == (type(sent), 1, "RuntimeError: x")
