"""Runs of the conformance suite for fp8conf's own tests: several backends, one Python process.

A run is what ``pytest --fp8-backend=BACKEND --fp8-report=...`` does, with the ``fp8conf-mutants``
Hypothesis profile (derandomized, no shrinking), restricted to some properties' tests or not;
the tests read its JSON report back. Starting a process costs more than most runs of a few
properties: importing torch and TorchAO, drawing the shared corpus of models, Inductor's start.
So :func:`run_suites` hands a plan of runs to one subprocess, ``python -m suite_runs PLAN``, which
runs them one after the other, each a pytest session of its own (:func:`pytest.main`):

* the plugin constructs the backend anew for each session, so nothing a backend instance holds
  (nor the FP8 ops the suite finds for it) reaches the next run; traced graphs are shared only
  between backends that trace alike (``tests/shared_traces.py``: the mutants of the reference
  mostly do), and a session says how many it took from earlier ones;
* the suite's test modules are imported anew for each session (removed from ``sys.modules``
  after it), so what they compute at import from the Hypothesis profile starts afresh, and the
  profile loaded before a session is loaded again after it (the ``fp8conf-mutants`` profile has
  no example database);
* Dynamo forgets the frames it compiled (``torch._dynamo.reset()``), so a later backend's
  compiled calls are never guarded against, or limited by, an earlier one's;
* each session writes its own output file beside its report.

What the sessions share is what is the same for every backend: imported modules, the corpus of
drawn model specs (derandomized, drawn once per process by design) and Inductor's caches.

The subprocess runs under a hang guard only: sized for a busy 2-core machine many times over, it
ends a process that stopped making progress, and each run it did not finish is reported as
``hang guard: ... did not finish in N s``, never as a verdict on the backend.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

__all__ = ["HANG_GUARD_S", "OTHER_BACKENDS", "POWER_EXAMPLES", "TEST_TIMEOUT_S", "Run", "Verdict", "failing", "other_backend_runs", "reads_shared_run", "run_suite", "run_suites"]

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
#: Seconds one subprocess may take before it is taken for hung: a group of runs or a whole-suite
#: run takes minutes on an idle 2-core machine and several times that on a busy one.
HANG_GUARD_S = 3600.0
#: pytest-timeout of a test that waits for a plan: above the guard, so that the guard speaks first.
TEST_TIMEOUT_S = HANG_GUARD_S + 300
#: ``--fp8-timeout`` of the runs: one Hypothesis example may take this long before the suite
#: reports it ``error``; like the guard, a bound on a hang, not on a slow machine.
EXAMPLE_TIMEOUT_S = 1200.0
#: Models per property of the runs that show a property bites: every mutant's run, and the whole
#: run of each backend a mutant is built on (the reference, makefx, the worked example), so that a
#: mutant is caught on drawn models its base backend passes (derandomized: the same profile draws
#: the same models). Every mutant is caught within twelve (the meta-test shows it; at 25, 110 of
#: 135 failed by their fifth); the main job (``fp8conf check``) runs the reference at the full 25.
POWER_EXAMPLES = 12


@dataclasses.dataclass(frozen=True)
class Run:
    """One pytest session of the suite: ``backend`` (an entry point or ``module:Class``; the
    mutants are ``mutants.<module>:<Class>``), checked on ``properties`` only (None: all), with
    ``examples`` models per property (None: the ``fp8conf-mutants`` profile's 25, as
    ``fp8conf-ci``). The mutants and the backends they are built on run at
    :data:`POWER_EXAMPLES`; a run that shows only that the suite keeps going (the misbehaving
    backends) or that a backend conforms on a few rules (tests/test_dead_compute.py) at fewer."""

    label: str
    backend: str
    properties: tuple[str, ...] | None = None
    examples: int | None = None

    @property
    def profile(self) -> str:
        return "fp8conf-mutants" if self.examples is None else f"{_BRIEF_PREFIX}{self.examples}"

    def pytest_args(self, directory: Path) -> list[str]:
        selection = " or ".join(_test_name(p) for p in self.properties) if self.properties else ""
        return [
            *_files_defining(self.properties),
            f"--fp8-backend={self.backend}", f"--fp8-report={self.report(directory)}",
            f"--fp8-timeout={EXAMPLE_TIMEOUT_S:g}", f"--hypothesis-profile={self.profile}",
            "-k", selection, "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
            # Its two full garbage collections per session were a third of a short one; without
            # it an exception nobody can raise goes to the output as Python prints it.
            "-p", "no:unraisableexception",
            # Sessions after a process's first find pytest's plugins (Hypothesis's) imported
            # already, too late to rewrite their asserts: true, and nothing to do with the backend.
            "-W", "ignore::pytest.PytestAssertRewriteWarning",
        ]

    def report(self, directory: Path) -> Path:
        return directory / f"{self.label}.json"

    def output(self, directory: Path) -> Path:
        return directory / f"{self.label}.log"

    def timing(self, directory: Path) -> Path:
        return directory / f"{self.label}.seconds"

    def describe(self) -> str:
        chosen = ", ".join(self.properties) if self.properties else "every property"
        return f"the suite against {self.backend} ({chosen})"


#: Profiles of runs with fewer examples: ``fp8conf-mutants`` with ``max_examples`` the number
#: after the prefix, registered by the subprocess (:func:`_register_brief_profile`).
_BRIEF_PREFIX = "fp8conf-mutants-examples-"


def _test_name(property_id: str) -> str:
    return "test_" + property_id.replace("-", "_") + "_"


def _files_defining(properties) -> list[str]:
    """The suite's test files that define the tests of ``properties`` (all: none named, the plugin
    collects every one): a session that collects only those imports a file or two, not eleven."""
    if not properties:
        return []
    from conformance.plugin import PROPERTIES_DIR

    files = [path for path in sorted(PROPERTIES_DIR.glob("test_*.py"))
             if any(f"def {_test_name(p)}" in _source(path) for p in properties)]
    return [str(path) for path in files] if files else []


@functools.cache
def _source(path: Path) -> str:
    return path.read_text()


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What one run left: its report's rows per property (None: no report), its output, and
    why there is no report when there is none."""

    run: Run
    statuses: dict | None
    output: str
    problem: str | None = None
    #: The session's wall time in its process (None: it did not end).
    seconds: float | None = None
    #: The report's coverage matrix: module family -> the areas that built it (None: no report).
    coverage: dict | None = None

    def status(self, property_id: str) -> str | None:
        return (self.statuses or {}).get(property_id, {}).get("status")

    def require(self) -> tuple[dict, str]:
        """``(statuses, output)``; fails the calling test, saying why, when the run left no report."""
        if self.statuses is None:
            pytest.fail(self.problem, pytrace=False)
        return self.statuses, self.output


def failing(statuses: dict) -> dict[str, str]:
    """Property ID -> status of every property of a run that neither passed nor was left out
    (``not_supported``, or ``skipped``: a GPU property on a machine without one)."""
    return {k: v["status"] for k, v in statuses.items() if v["status"] not in ("pass", "not_supported", "skipped")}


def run_suites(runs: list[Run], directory: Path, *, guard_s: float = HANG_GUARD_S) -> dict[str, Verdict]:
    """Run ``runs`` one after the other in one subprocess; their verdicts by label."""
    labels = [run.label for run in runs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"run labels must be unique, got {labels}")
    directory.mkdir(parents=True, exist_ok=True)
    plan = directory / "plan.json"
    plan.write_text(json.dumps([dataclasses.asdict(run) for run in runs], indent=1))
    path = [str(TESTS), str(ROOT / "docs" / "examples"), os.environ.get("PYTHONPATH")]  # mutants, the worked example
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, path)))
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "suite_runs", str(plan)],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=guard_s,
        )
        ended = f"the process running it ended with exit status {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}"
    except subprocess.TimeoutExpired:
        ended = None
    return {run.label: _verdict(run, directory, ended, guard_s) for run in runs}


def _verdict(run: Run, directory: Path, ended: str | None, guard_s: float) -> Verdict:
    output_file = run.output(directory)
    output = output_file.read_text(errors="replace") if output_file.exists() else ""
    report = run.report(directory)
    timing = run.timing(directory)
    seconds = float(timing.read_text()) if timing.exists() else None
    if report.exists():
        found = json.loads(report.read_text())
        return Verdict(run, found["properties"], output, seconds=seconds, coverage=found.get("coverage"))
    if ended is None:
        problem = f"hang guard: {run.describe()} did not finish in {guard_s:g} s"
    else:
        problem = f"no report from {run.describe()}; {ended}"
    return Verdict(run, None, output, f"{problem}\n{output[-3000:]}")


def reads_shared_run(group: str):
    """Marks of a test that reads a run other tests read too (a fixture makes it): ``slow``, in
    xdist group ``group`` so that one worker makes the run once, and a pytest-timeout above the
    run's hang guard, so that the guard reports a hang first."""

    def mark(test):
        for marker in (pytest.mark.slow, pytest.mark.xdist_group(group), pytest.mark.timeout(TEST_TIMEOUT_S)):
            test = marker(test)
        return test

    return mark


#: The xdist group, and time-summary area, of the tests that read the whole-suite runs of the
#: backends other than the reference (the worked example, makefx, the misbehaving backends).
OTHER_BACKENDS = "suite-other-backends"


def other_backend_runs(request, tmp_path_factory) -> dict[str, Verdict]:
    """The verdicts of every ``SHARED_RUNS`` of the modules whose selected tests read them
    (:func:`reads_shared_run` with :data:`OTHER_BACKENDS`), by label: one plan, so one process,
    for all of them (a process start costs torch's import, Inductor's start and the corpus of
    drawn models). Made once per worker; the group puts every such test on the same one."""
    grouped = [item for item in request.session.items
               if any(OTHER_BACKENDS in mark.args for mark in item.iter_markers("xdist_group"))]
    modules = sorted({item.module for item in grouped}, key=lambda module: module.__name__)
    runs = [run for module in modules for run in module.SHARED_RUNS]
    return run_suites(runs, tmp_path_factory.mktemp("other-backends"))


def run_suite(backend: str, property_ids, tmp_path: Path) -> tuple[dict, str]:
    """Run the suite against ``backend`` (only ``property_ids``' tests, or all when None) in a
    process of its own; ``(statuses, output)`` of its report, or the test fails saying why not."""
    run = Run(backend.rsplit(":", 1)[-1], backend, tuple(property_ids) if property_ids else None)
    return run_suites([run], tmp_path)[run.label].require()


# --- the subprocess ---------------------------------------------------------------------------


@contextlib.contextmanager
def _output_to(path: Path):
    """Send this process's stdout and stderr, Python's and native code's alike, to ``path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "wb") as file:
        os.dup2(file.fileno(), 1)
        os.dup2(file.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, original in zip((1, 2), saved):
            os.dup2(original, fd)
            os.close(original)


def _forget_test_modules() -> None:
    """Remove the suite's test modules and conftest from ``sys.modules``: pytest imports a
    module it finds there instead of importing it anew."""
    from conformance.plugin import PROPERTIES_DIR

    # By the module's name and then its folder: resolving the path of every module loaded (some
    # thousands with torch) took a third of a short session.
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if name.startswith("test_") or name == "conftest" or name.startswith("conformance.properties"):
            if file and Path(file).resolve().parent == PROPERTIES_DIR:
                del sys.modules[name]


def _session(run: Run, directory: Path) -> int:
    import torch
    from hypothesis import settings

    import shared_traces

    traces = shared_traces.install()
    traces.new_session()
    hits, traced = traces.hits, traces.traced
    profile = settings.get_current_profile_name()
    if run.examples is not None:
        _register_brief_profile(run.examples)
    try:
        with _output_to(run.output(directory)):
            code = int(pytest.main(run.pytest_args(directory)))
            print(f"shared traces: {traces.hits - hits} traced graph(s) taken from earlier sessions of this process, "
                  f"{traces.traced - traced} traced in this one")
            for line in shared_traces.check_models_kept(traces):
                print(line)
            return code
    finally:
        settings.load_profile(profile)
        _forget_test_modules()
        torch._dynamo.reset()


def _register_brief_profile(examples: int) -> None:
    """Register ``fp8conf-mutants`` with ``examples`` models per property (the plugin registers
    its own profiles again when the session starts; this one it leaves alone)."""
    from hypothesis import settings

    from conformance.plugin.profiles import register_profiles

    register_profiles()
    settings.register_profile(f"{_BRIEF_PREFIX}{examples}", settings.get_profile("fp8conf-mutants"), max_examples=examples)


def main(argv: list[str]) -> int:
    plan = Path(argv[0])
    runs = [Run(r["label"], r["backend"], tuple(r["properties"]) if r["properties"] else None, r.get("examples"))
            for r in json.loads(plan.read_text())]
    for run in runs:
        start = time.monotonic()
        code = _session(run, plan.parent)
        run.timing(plan.parent).write_text(f"{time.monotonic() - start:.2f}")
        print(f"{run.label}: pytest exit status {code}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
