"""``fp8conf doctor``: what this environment gives fp8conf, and each fast path's state.

The reference's speed and memory savings rest on torch internals (Inductor's compiled-graph
layout, FX's boxed code generator); on another torch a fast path falls back, correctly but
slower or with a higher peak, and says so once in the ``fp8conf`` logger. This command shows it
up front: versions, the device, and for each fast path whether a small FP8 model compiled here
takes it, with the reason where it does not. An untested torch or TorchAO gets a warning, never
a refusal. Exit status 0 when every fast path is on, 1 when one is off.

A doctor is run when something is wrong, so what is wrong with the environment is its finding,
never its traceback: torch or TorchAO that cannot be imported (or a TorchAO that is not one), an
environment variable torch cannot read (``TORCH_LOGS``, ``TORCHINDUCTOR_COMPILE_THREADS``: named
with its value), an Inductor cache folder that cannot take a file (a full disk), a compile that
fails. Each is a ``problem`` line naming the fix, the checks that need what failed are left out
(and say so), and the exit status is 1. The traceback goes to the ``fp8conf`` logger at debug.
"""

from __future__ import annotations

import importlib
import os
import platform
import sys
import tempfile

from fp8conf.log import logger

__all__ = ["TESTED", "tested_torch", "in_range", "diagnose", "run"]

#: Prefixes of the environment variables torch, Inductor and TorchAO read; one of these whose
#: name or value an error shows is named beside it.
_TORCH_VARIABLES = ("TORCH", "PYTORCH", "CUDA_", "GLOO_")
#: Bytes the cache check writes: a folder on a full disk refuses them.
_CACHE_PROBE_BYTES = 1 << 20

#: The torch and TorchAO releases the project's test matrix runs (tox.ini, the H200 runs).
TESTED = {"torch": ("2.11", "2.13", "2.14"), "torchao": ("0.17", "0.18")}


def _release(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def tested_torch() -> str:
    """The tested torch range: ``[tool.fp8conf] tested-torch`` of the checkout's pyproject.toml
    where there is one, else the range the installed package was released with."""
    import pathlib
    import tomllib

    from fp8conf.torch_internals import TESTED_TORCH

    pyproject = pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml"
    try:
        return tomllib.loads(pyproject.read_text())["tool"]["fp8conf"]["tested-torch"]
    except (OSError, KeyError, tomllib.TOMLDecodeError) as exc:  # an installed wheel has no pyproject
        logger.debug("doctor: no tested torch range in %s (%r); using the built-in %s", pyproject, exc, TESTED_TORCH)
        return TESTED_TORCH


def in_range(version: str, spec: str) -> bool:
    """Whether ``version``'s release is inside ``spec`` (clauses ``>=X.Y`` and ``<X.Y``, comma-separated)."""
    def key(v):
        return tuple(int(p) for p in v.split("+")[0].split(".")[:2] if p.isdigit())

    here = key(version)
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        if clause.startswith(">=") and here < key(clause[2:]):
            return False
        if clause.startswith("<") and not clause.startswith("<=") and here >= key(clause[1:]):
            return False
    return True


def _one_line(exc: BaseException, limit: int = 240) -> str:
    text = " ".join(str(exc).split()) or "(no message)"
    return f"{type(exc).__name__}: {text if len(text) <= limit else text[:limit] + ' ...'}"


def _variables_behind(exc: BaseException) -> list[str]:
    """The environment variables of torch's that ``exc`` shows: named in its traceback's source
    (``os.environ["TORCHINDUCTOR_COMPILE_THREADS"]``) or with their value in its message
    (``Invalid log settings: nonsense``), as ``NAME='value'``."""
    import traceback

    shown = "".join(traceback.format_exception(exc))
    message = str(exc)
    return [
        f"{name}={value!r}" for name, value in sorted(os.environ.items())
        if name.startswith(_TORCH_VARIABLES)
        and (name in shown or (len(value.strip()) > 1 and value.strip() in message))
    ]


#: What :func:`_guarded` returns for a check that raised.
_FAILED = object()


def _guarded(what: str, call, problems: list[str], *, fix: str | None = None):
    """What ``call()`` returns; :data:`_FAILED` when it raises, with the problem said: ``what``,
    the error in one line, the torch variables behind it and what to do about them (else
    ``fix``). The traceback goes to the ``fp8conf`` logger at debug."""
    try:
        return call()
    except Exception as exc:  # the environment's finding: a problem line, never a traceback
        logger.debug("doctor: %s", what, exc_info=exc)
        line = f"{what}: {_one_line(exc)}"
        variables = _variables_behind(exc)
        if variables:
            line += f"; set in the environment: {', '.join(variables)}: unset it or give it a value torch accepts"
        elif fix:
            line += f"; {fix}"
        problems.append(line)
        return _FAILED


def _imported(name: str, problems: list[str]):
    """The module ``name``; :data:`_FAILED`, with the problem said, when it cannot be imported."""
    return _guarded(f"{name} cannot be imported", lambda: importlib.import_module(name), problems,
                    fix=f"reinstall it (pip install --force-reinstall {name})")


def _torchao_version(torchao, problems: list[str]) -> str | None:
    """TorchAO's version; None, with the problem said, for a ``torchao`` that is not TorchAO."""
    version = getattr(torchao, "__version__", None)
    if isinstance(version, str):
        return version
    where = ", ".join(getattr(torchao, "__path__", ())) or getattr(torchao, "__file__", None) or "?"
    problems.append(f"torchao at {where} is not a TorchAO installation (it has no __version__); reinstall it "
                    f"(pip install --force-reinstall 'torchao=={TESTED['torchao'][-1]}.*')")
    return None


def _inductor_cache_problem() -> str | None:
    """Why Inductor's cache folder cannot take a file (it writes every compiled kernel there); None when it can."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "(the default)")
    try:
        folder = cache_dir()  # made here when missing
        with tempfile.NamedTemporaryFile(dir=folder, prefix="fp8conf-doctor-") as probe:
            probe.write(bytes(_CACHE_PROBE_BYTES))
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as exc:
        logger.debug("doctor: the Inductor cache folder %s", folder, exc_info=exc)
        return (f"Inductor's cache folder {folder} cannot take a file ({exc.strerror or _one_line(exc)}): Inductor writes "
                "every kernel it compiles there; free space there, or point TORCHINDUCTOR_CACHE_DIR at a folder that can")
    return None


def _internals(found: dict) -> None:
    """What the installed torch's internals give: failed probes, fast paths, MX scales, V schedules."""
    from fp8conf import torch_internals

    found["failed_internals"] = [f"{p.name}: {p.reason}" for p in torch_internals.failed_probes()]
    found["internal_paths"] = {name: None if on else reason for name, on, reason in torch_internals.fast_paths()}
    native = torch_internals.inductor_lowers_e8m0()
    found["mx_scales"] = ("float8_e8m0fnu (Inductor compiles e8m0)" if native.found
                          else f"uint8 bytes (Inductor does not compile e8m0: {native.reason})")
    v_gloo = torch_internals.v_schedules_start_on_gloo()
    found["v_schedules_on_gloo"] = None if v_gloo.found else v_gloo.reason


def _compiled_paths(torch) -> dict:
    """The fast paths a regionally and a fully compiled FP8 block stack take here."""
    from fp8conf.compile import compile_joint
    from fp8conf.graph.trace import trace_joint
    from fp8conf.tools.example_models import build_stack

    model = build_stack(32, 2, seed=0)
    x = torch.randn(16, 32, requires_grad=True)
    gm = trace_joint(model, (x,))
    paths = {"fast call (regional units called straight through Inductor's code)": None,
             "boxed backward (saved values freed as the backward uses them)": None}
    for mode in ("regional", "full"):
        for line in compile_joint(gm, mode=mode).fallbacks:
            name, _, reason = line.partition(": ")
            key = next(k for k in paths if k.startswith(name))
            paths[key] = paths[key] or f"{mode}: {reason}"
    return paths


def _untested(versions: dict) -> list[str]:
    untested = [f"{name} {versions[name]}" for name, releases in TESTED.items()
                if name in versions and _release(versions[name]) not in releases and versions[name][:1].isdigit()]
    if not in_range(versions["torch"], tested_torch()):
        untested.append(f"torch {versions['torch']} is outside the tested range {tested_torch()}")
    return untested


def diagnose() -> dict:
    """Versions, device and the fast paths a regionally and a fully compiled FP8 block stack
    take here: ``{"versions": {...}, "device": str, "untested": [...], "paths": {name: reason or
    None}, "problems": [...], "not_checked": reason or None, ...}``. A check that cannot run adds
    its ``problems`` line and leaves out those that need it (``not_checked`` says why the fast
    paths were not)."""
    problems: list[str] = []
    found = {"versions": {"python": platform.python_version()}, "device": None, "untested": [], "paths": {},
             "failed_internals": [], "mx_scales": None, "v_schedules_on_gloo": None, "problems": problems,
             "not_checked": None}
    versions = found["versions"]
    torch = _imported("torch", problems)
    versions["torch"] = "cannot be imported" if torch is _FAILED else torch.__version__
    if torch is _FAILED:
        found["not_checked"] = "torch cannot be imported"
        return found
    device = _guarded("the CUDA device cannot be read", lambda: torch.cuda.get_device_name()
                      if torch.cuda.is_available() else "CPU (no CUDA device)", problems)
    found["device"] = None if device is _FAILED else device
    # First: TorchAO and every internal import it, and fail all alike when it fails.
    if _guarded("Inductor's configuration cannot be read", lambda: importlib.import_module("torch._inductor.config"),
                problems) is _FAILED:
        versions["torchao"] = "not checked"
        found["not_checked"] = "Inductor's configuration cannot be read"
        return found
    torchao = _imported("torchao", problems)
    version = None if torchao is _FAILED else _torchao_version(torchao, problems)
    versions["torchao"] = version or ("cannot be imported" if torchao is _FAILED else "not a TorchAO installation")
    blocked = [] if version else [f"torchao {'cannot be imported' if torchao is _FAILED else 'is not a TorchAO installation'}"]
    found["untested"] = _untested(versions)
    if _guarded("torch's internals cannot be probed", lambda: _internals(found), problems) is _FAILED:
        blocked.append("torch's internals cannot be probed")
    if not blocked:
        cache = _inductor_cache_problem()
        if cache is not None:
            problems.append(cache)
            blocked.append("Inductor's cache folder cannot take a file")
    if blocked:
        found["not_checked"] = "; ".join(blocked)
        return found
    paths = _guarded("compiling a small FP8 model here failed", lambda: _compiled_paths(torch), problems)
    if paths is _FAILED:
        found["not_checked"] = "the compile failed"
        return found
    found["paths"] = {**paths, **{f"{name} (torch internals)": reason for name, reason in found.pop("internal_paths").items()}}
    return found


def run(args=None) -> int:
    found = diagnose()
    for name, version in found["versions"].items():
        print(f"{name:8} {version}")
    if found["device"] is not None:
        print(f"device   {found['device']}")
    if found["mx_scales"] is not None:  # not a fast path: either dtype carries the same bytes at the same speed
        print(f"MX scales travel as {found['mx_scales']}")
    if found["v_schedules_on_gloo"] is not None:  # not a fast path either: a schedule refused up front
        print(f"V-shaped pipeline schedules are refused over gloo: {found['v_schedules_on_gloo']}")
    for item in found["untested"]:
        if "outside the tested range" in item:
            print(f"warning: {item}; fast paths may fall back (below)", file=sys.stderr)
            continue
        tested = ", ".join(TESTED[item.split()[0]])
        print(f"warning: {item} is not among the tested releases ({tested}); fast paths may fall back (below)", file=sys.stderr)
    for line in found["failed_internals"]:
        print(f"missing  {line}")
    for line in found["problems"]:
        print(f"problem  {line}")
    if found["not_checked"] is not None:
        print(f"fast paths not checked: {found['not_checked']}")
    off = 0
    for name, reason in found["paths"].items():
        print(f"{'on ' if reason is None else 'OFF'}  {name}{'' if reason is None else f': {reason}'}")
        off += reason is not None
    return 1 if off or found["problems"] else 0
