"""``fp8conf doctor``: what this environment gives fp8conf, and each fast path's state.

The reference's speed and memory savings rest on torch internals (Inductor's compiled-graph
layout, FX's boxed code generator); on another torch a fast path falls back, correctly but
slower or with a higher peak, and says so once in the ``fp8conf`` logger. This command shows it
up front: versions, the device, and for each fast path whether a small FP8 model compiled here
takes it, with the reason where it does not. An untested torch or TorchAO gets a warning, never
a refusal. Exit status 0 when every fast path is on, 1 when one is off.
"""

from __future__ import annotations

import platform
import sys

from fp8conf.log import logger

__all__ = ["TESTED", "tested_torch", "in_range", "diagnose", "run"]

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


def diagnose() -> dict:
    """Versions, device and the fast paths a regionally and a fully compiled FP8 block stack
    take here: ``{"versions": {...}, "device": str, "untested": [...], "paths": {name: reason or None}}``."""
    import torch
    import torchao

    from fp8conf.compile import compile_joint
    from fp8conf.graph.trace import trace_joint
    from fp8conf.tools.example_models import build_stack

    versions = {"python": platform.python_version(), "torch": torch.__version__, "torchao": torchao.__version__}
    untested = [f"{name} {versions[name]}" for name, releases in TESTED.items() if _release(versions[name]) not in releases]
    if not in_range(torch.__version__, tested_torch()):
        untested.append(f"torch {torch.__version__} is outside the tested range {tested_torch()}")
    from fp8conf import torch_internals

    failed = [f"{p.name}: {p.reason}" for p in torch_internals.failed_probes()]
    internal_paths = {name: None if on else reason for name, on, reason in torch_internals.fast_paths()}
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (no CUDA device)"
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
    paths.update({f"{name} (torch internals)": reason for name, reason in internal_paths.items()})
    native = torch_internals.inductor_lowers_e8m0()
    mx_scales = ("float8_e8m0fnu (Inductor compiles e8m0)" if native.found
                 else f"uint8 bytes (Inductor does not compile e8m0: {native.reason})")
    v_gloo = torch_internals.v_schedules_start_on_gloo()
    return {"versions": versions, "device": device, "untested": untested, "paths": paths, "failed_internals": failed,
            "mx_scales": mx_scales, "v_schedules_on_gloo": None if v_gloo.found else v_gloo.reason}


def run(args=None) -> int:
    found = diagnose()
    for name, version in found["versions"].items():
        print(f"{name:8} {version}")
    print(f"device   {found['device']}")
    # Not a fast path: either dtype carries the same bytes at the same speed.
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
    off = 0
    for name, reason in found["paths"].items():
        print(f"{'on ' if reason is None else 'OFF'}  {name}{'' if reason is None else f': {reason}'}")
        off += reason is not None
    return 1 if off else 0
