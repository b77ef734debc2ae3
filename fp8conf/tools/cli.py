"""Check a PyTorch graph trainer's FP8 handling against the conformance suite, map a model's
FP8 regions, and manage precompiled FP8 artifacts.

``fp8conf check`` runs the conformance suite against a backend and prints the per-property
summary table; it is ``pytest --fp8-backend=NAME`` with the suite's defaults filled in, so
every pytest option still works after ``--``. ``fp8conf precompile save|load|diff|show`` handles
precompiled artifacts and their quantization fingerprints (see :mod:`fp8conf.tools.precompile`).
``fp8conf doctor`` shows the versions, the device and whether each fast path is on
(:mod:`fp8conf.tools.doctor`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

from fp8conf.log import logger

__all__ = ["main"]


_EXAMPLES = """examples:
  fp8conf check                                  # the suite against the reference backend
  fp8conf check --backend mypkg.fp8:MyBackend -n 2
  fp8conf check --backend mine -- --fp8-property PROV   # pytest options after --
  fp8conf explain mypkg.models:make_model --out regions.html
  fp8conf precompile show step.fp8
"""
_CHECK_EXAMPLES = """examples:
  fp8conf check                                  # reference backend, report fp8conf-report.json
  fp8conf check --backend mypkg.fp8:MyBackend -n 2 --report out/mine.json
  fp8conf check --backend mine --expectations known-failures.toml
  fp8conf check --backend mine -- --fp8-property PROV-003 -x

The report lists failures first and names the property to fix first when others rely on it.
Exit status: 0 every property passed or is not supported; 1 a property failed; 2 the suite's
dependencies are not installed; 4 usage error (also a report that could not be written, and a
machine that cannot run the selected tests: no CUDA device for --fp8-device=cuda, gloo that
cannot start, or gloo ranks that could not connect mid-run while nothing of the backend failed);
6 the run ended before every selected test ran to a verdict (Ctrl-C, -x, a collection error):
its report says INTERRUPTED or INCOMPLETE, lists what was not reached and has no MUST score;
3 and 5 as pytest's (internal error, no tests collected).
"""
#: Exit status of a run that did not end complete (the report's ``run.ended``); pytest's own,
#: 2, is already this command's "the suite's dependencies are not installed".
EXIT_INCOMPLETE = 6


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fp8conf", description=__doc__.split("\n\n")[0], epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser(
        "check", help="run the conformance suite against a backend",
        description="Run the conformance suite against a backend: pytest --fp8-backend=NAME with "
        "the suite's defaults (Hypothesis profile fp8conf-ci, a JSON and Markdown report).",
        epilog=_CHECK_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    check.add_argument("--backend", default="reference", help="entry-point name or package.module:Class (default: reference)")
    check.add_argument("--report", default="fp8conf-report.json", help="JSON report path; a Markdown table is written beside it")
    check.add_argument("--profile", default="fp8conf-ci", choices=("fp8conf-dev", "fp8conf-ci", "fp8conf-thorough"), help="Hypothesis profile (default: fp8conf-ci)")
    check.add_argument("-n", "--workers", default=None, help="pytest-xdist workers (e.g. 2 or auto)")
    check.add_argument("--expectations", default=None, help="expected failures: JSON or TOML file mapping property or test IDs to {reason, link}")
    check.add_argument("--spec-version", default=None, help="spec version to check against (default: the backend's spec_version)")
    check.add_argument("--timeout", default=None, type=float, help="seconds one example of a conformance test may run before the test is reported 'error' (default: 300)")
    check.add_argument("pytest_args", nargs=argparse.REMAINDER, help="further pytest arguments, after --")
    from fp8conf.tools import precompile as precompile_cli

    precompile_cli.add_parser(commands)
    explain = commands.add_parser(
        "explain", help="write an HTML map of a model's FP8 regions",
        description="Write a self-contained HTML map of a model's FP8 regions. Exit status 2, with one line, when the "
        "model cannot be loaded or traced or --out cannot be written (not a regular file, a read-only or full folder: "
        "nothing is left at it, and what was there is unchanged).",
    )
    explain.add_argument(
        "model",
        nargs="?",
        default="fp8conf.tools.example_models:example_model",
        help="package.module:function returning (model, args); default: a 6-block example model",
    )
    explain.add_argument("--out", default="fp8-regions.html", help="HTML file to write (default: fp8-regions.html)")
    commands.add_parser(
        "doctor", help="show versions, the device and whether each of fp8conf's fast paths is on here",
        description="Python, torch, TorchAO and the device; then each fast path of the reference's compile "
        "(taken or not, with the reason) for a small FP8 model compiled here. Exit status 1 when one is off, or when "
        "the environment has a problem (torch or TorchAO that cannot be imported, a variable torch cannot read, a cache "
        "folder that cannot take a file, a compile that fails), said as a 'problem' line.",
    )
    return parser


class _ExplainError(Exception):
    """What ``fp8conf explain`` prints as its one line before exiting 2."""


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def _model_from_factory(spec: str):
    """``(model, args)`` from the ``package.module:function`` named ``spec``."""
    import importlib
    import inspect

    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise _ExplainError(f"cannot load {spec!r} ({_one_line(exc)}); expected package.module:function") from None
    if not callable(factory):
        raise _ExplainError(f"{spec!r} is {type(factory).__name__}, not a function returning (model, args)")
    try:
        inspect.signature(factory).bind()
    except TypeError:
        raise _ExplainError(f"{spec!r} needs arguments {inspect.signature(factory)}; give a function taking none") from None
    except ValueError:  # no signature to read (a builtin): calling it will tell
        logger.debug("explain: %r has no signature to check; calling it", spec)
    try:
        made = factory()
    except Exception as exc:
        raise _ExplainError(f"{spec!r} raised {_one_line(exc)}") from None
    if not (isinstance(made, tuple) and len(made) == 2 and callable(made[0])):
        raise _ExplainError(f"{spec!r} returned {type(made).__name__}; it must return (model, args)")
    return made


def _explain(args) -> int:
    from fp8contract.writing import check_write_target
    from fp8conf.errors import FileWriteError, FP8Error

    try:
        folder = Path(args.out).resolve().parent
        if not folder.is_dir():
            raise _ExplainError(f"--out {args.out}: folder {folder} does not exist")
        check_write_target(args.out, error=FileWriteError, what="region map")  # before the model is built and traced
        model, model_args = _model_from_factory(args.model)
        from fp8conf.tools.explain import explain_model

        try:
            regions = explain_model(model, tuple(model_args), args.out)
        except FileWriteError:
            raise
        except (FP8Error, OSError) as exc:
            raise _ExplainError(f"{args.model!r}: {_one_line(exc)}") from None
    except (_ExplainError, FileWriteError) as exc:
        print(f"fp8conf explain: {exc}", file=sys.stderr)
        return 2
    complete = sum(r.complete for r in regions)
    print(f"{args.out}: {len(regions)} FP8 regions, {complete} complete, {len(regions) - complete} incomplete")
    return 0


def threads_per_worker(workers: str | int, environ, cpus: int) -> str | None:
    """The OMP_NUM_THREADS each of ``workers`` pytest-xdist workers gets on ``cpus`` cores: its
    share of them, at least one; None where the environment sets OMP_NUM_THREADS already (the
    user's choice is kept) or ``workers`` is not a count (``0``: no workers). Left to OpenMP,
    every worker runs its kernels (Inductor's C++ code, torch's CPU ops) on all the cores and
    the workers spin against each other; "auto" and "logical" start about one worker per core."""
    if "OMP_NUM_THREADS" in environ:
        return None
    if str(workers) in ("auto", "logical"):
        return "1"
    if not str(workers).isdigit() or int(workers) < 1:
        return None  # no count: pytest-xdist refuses it, or starts no workers for 0
    return str(max(1, cpus // int(workers)))


def _absent(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is None
    except ImportError as exc:  # a parent package that cannot be imported: the module is not there
        logger.debug("looking up %s raised %r; taken as absent", module, exc)
        return True


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from fp8conf.log import library_notices_quieted

    # While fp8conf's command runs, TorchAO's load-time notices are noise; the filter goes with it.
    with library_notices_quieted():
        return _run(args)


def _run(args) -> int:
    if args.command == "precompile":
        from fp8conf.tools import precompile as precompile_cli

        return precompile_cli.run(args)
    if args.command == "explain":
        return _explain(args)
    if args.command == "doctor":
        from fp8conf.tools import doctor

        return doctor.run(args)
    missing = [name for name in ("pytest", "hypothesis") if _absent(name)]
    if args.workers and _absent("xdist"):
        missing.append("pytest-xdist")
    if missing:
        print(f"fp8conf check: the conformance suite needs {', '.join(missing)}, which is not installed; "
              "pip install 'fp8conf[conformance]'", file=sys.stderr)
        return 2
    import pytest

    pytest_args = [
        # The suite's plugin, named by its pytest11 entry point: pytest loads it (once, autoload
        # or not); fp8conf itself imports nothing of the suite.
        "-p", "fp8conf",
        f"--fp8-backend={args.backend}",
        f"--fp8-report={args.report}",
        f"--hypothesis-profile={args.profile}",
        "-p", "no:cacheprovider",
        "-q",
        # torch and torchao deprecation chatter says nothing about the backend under test.
        "-W", "ignore::DeprecationWarning",
        "-W", "ignore::FutureWarning",
        "-W", "ignore::UserWarning",
    ]
    if args.workers:
        pytest_args += ["-n", str(args.workers)]
        threads = threads_per_worker(args.workers, os.environ, os.cpu_count() or 1)
        if threads is not None:
            # The workers inherit it: each runs its OpenMP kernels on its share of the cores.
            os.environ["OMP_NUM_THREADS"] = threads
            logger.info("fp8conf check: %s workers on %d cores: OMP_NUM_THREADS=%s in each (set OMP_NUM_THREADS "
                        "to choose)", args.workers, os.cpu_count() or 1, threads)
    if args.expectations:
        pytest_args.append(f"--fp8-expectations={args.expectations}")
    if args.spec_version:
        pytest_args.append(f"--fp8-spec-version={args.spec_version}")
    if args.timeout is not None:
        pytest_args.append(f"--fp8-timeout={args.timeout:g}")
    pytest_args += [a for a in args.pytest_args if a != "--"]
    started = time.time()
    try:
        with _terminate_as_interrupt():
            status = int(pytest.main(pytest_args))
    except KeyboardInterrupt:
        # In pytest's start-up, before its session, which then says nothing of it.
        print("fp8conf check: interrupted in start-up, before any test ran; no report written", file=sys.stderr)
        return EXIT_INCOMPLETE
    ended = _how_the_run_ended(_report_path(pytest_args), since=started)
    if status == pytest.ExitCode.INTERRUPTED or ended in ("interrupted", "incomplete"):
        return EXIT_INCOMPLETE
    return status


@contextlib.contextmanager
def _terminate_as_interrupt():
    """Within: SIGTERM ends the run as Ctrl-C does (a KeyboardInterrupt naming the signal), so
    pytest writes an interrupted report and pytest-xdist stops its workers; left to the default
    action, the process died at once and its workers ran on without a parent."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(signum, frame):
        raise KeyboardInterrupt("SIGTERM: fp8conf check was terminated")

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _report_path(pytest_args: list[str]) -> Path | None:
    """The ``--fp8-report`` pytest takes from ``pytest_args``: the last one given."""
    found = None
    for index, arg in enumerate(pytest_args):
        if arg.startswith("--fp8-report="):
            found = arg.partition("=")[2]
        elif arg == "--fp8-report" and index + 1 < len(pytest_args):
            found = pytest_args[index + 1]
    return Path(found) if found else None


def _how_the_run_ended(path: Path | None, *, since: float) -> str | None:
    """``run.ended`` of the report at ``path``; None where this run wrote none there (it ended
    before its first test, or the file is an earlier run's or not a report)."""
    if path is None:
        return None
    try:
        if path.stat().st_mtime < since:
            return None
        return json.loads(path.read_text(encoding="utf-8"))["run"]["ended"]
    except FileNotFoundError:
        logger.debug("fp8conf check: no report at %s: this run wrote none", path)
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("fp8conf check: the report %s cannot be read as this run's (%s: %s); its exit status is pytest's",
                       path, type(exc).__name__, exc)
        return None


if __name__ == "__main__":
    sys.exit(main())
