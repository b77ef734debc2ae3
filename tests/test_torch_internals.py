"""Every private torch symbol fp8conf uses is named in fp8conf.torch_internals, and found here."""

from __future__ import annotations

import logging
import pathlib
import re

import pytest
import torch

from fp8conf import torch_internals

ROOT = pathlib.Path(__file__).resolve().parents[1]
_DOTTED = re.compile(r"\b(torch(?:ao)?(?:\.\w+)+)")
_FROM = re.compile(r"^\s*from\s+(torch(?:ao)?(?:\.\w+)*)\s+import\s+\(?([^#\n]+)", re.M)


def _private(name: str) -> bool:
    return any(p.startswith("_") and not p.startswith("__") for p in name.split(".")[1:])


def _private_symbols(text: str) -> set[str]:
    found = set()
    for m in _FROM.finditer(text):
        for part in m.group(2).replace(")", "").split(","):
            name = part.strip().split(" as ")[0].strip()
            if name.isidentifier() and _private(f"{m.group(1)}.{name}"):
                found.add(f"{m.group(1)}.{name}")
    found.update(m.group(1) for m in _DOTTED.finditer(text) if _private(m.group(1)))
    return found


def test_every_private_torch_symbol_is_listed():
    unlisted = {}
    for root in ("fp8conf", "fp8contract", "conformance"):
        for path in (ROOT / root).rglob("*.py"):
            for name in _private_symbols(path.read_text()) - set(torch_internals.INTERNALS + torch_internals.NEWER_INTERNALS):
                unlisted.setdefault(name, str(path.relative_to(ROOT)))
    assert not unlisted, f"private torch symbols not in fp8conf.torch_internals.INTERNALS: {unlisted}"


def test_every_internal_is_found_on_the_installed_torch():
    assert torch_internals.failed_probes() == []


def test_newer_internals_are_found_on_newer_torch():
    """torch 2.14 and newer have every one of them: a rename there would silently take the
    native e8m0 path away."""
    release = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    missing = [p for p in map(torch_internals.probe, torch_internals.NEWER_INTERNALS) if not p.found]
    if release >= (2, 14):
        assert missing == []
        assert torch_internals.inductor_lowers_e8m0().found
    else:
        assert not torch_internals.inductor_lowers_e8m0().found
    # Pipelining's warm-up by vote: torch 2.13 has it, torch 2.11 not (2.12 was not tested).
    if release >= (2, 13) or release <= (2, 11):
        assert torch_internals.v_schedules_start_on_gloo().found == (release >= (2, 13))


def test_a_v_shaped_schedule_the_torch_cannot_start_over_gloo_is_refused_before_any_process(monkeypatch, capsys):
    from fp8conf.errors import FP8ConfigError
    from fp8conf.tools.cli import main
    from fp8conf.tools import pipeline_check

    failed = torch_internals.Probe("torch.distributed.pipelining.schedules._PipelineSchedule._warmup_p2p", False,
                                   "probe forced to fail")
    monkeypatch.setattr(torch_internals, "probe", lambda name: failed if name == failed.name else torch_internals.Probe(name, True))

    def spawned(*args, **kwargs):
        raise AssertionError("processes started")

    monkeypatch.setattr("torch.multiprocessing.start_processes", spawned)
    with pytest.raises(FP8ConfigError, match=r"DualPipeV cannot start over gloo .*probe forced to fail.*--backend nccl"):
        pipeline_check.launch(schedule="DualPipeV", ranks=2)
    main(["doctor"])
    assert "V-shaped pipeline schedules are refused over gloo: probe forced to fail" in capsys.readouterr().out


def test_each_fast_path_is_on():
    assert [(name, reason) for name, on, reason in torch_internals.fast_paths() if not on] == []


def test_the_wait_patch_is_undone_on_error():
    from torch._inductor.async_compile import AsyncCompile

    original = AsyncCompile.wait
    with pytest.raises(RuntimeError):
        with torch_internals.async_compile_wait_patched(lambda orig: orig):
            with torch_internals.async_compile_wait_patched(lambda orig: None):
                raise RuntimeError("boom")
    assert AsyncCompile.wait is original


def test_a_failed_probe_falls_back_with_one_warning(monkeypatch, caplog):
    import torch

    from fp8conf.compile import region_compile

    failed = torch_internals.Probe("torch._inductor.async_compile.AsyncCompile.wait", False, "probe forced to fail")
    monkeypatch.setattr(torch_internals, "probe", lambda name: failed)
    gm = torch.fx.symbolic_trace(lambda x: (torch.ops.aten.sin.default(x),))
    with torch._subclasses.FakeTensorMode() as mode:
        fake = [mode.from_tensor(torch.ones(4))]
    with caplog.at_level(logging.WARNING, logger="fp8conf"):
        units = [region_compile.InnerCompiledUnit(gm, fake) for _ in range(2)]
    assert all(u.fallback and "probe forced to fail" in u.fallback for u in units)
    assert sum("put-off kernel waits" in r.getMessage() for r in caplog.records) == 1


def test_doctor_reads_the_tested_range_and_warns_outside_it():
    from fp8conf.tools import doctor

    assert doctor.tested_torch() == torch_internals.TESTED_TORCH
    assert doctor.in_range("2.13.0+cpu", ">=2.11,<2.15")
    assert not doctor.in_range("2.15.0", ">=2.11,<2.15")
    assert not doctor.in_range("2.10.1", ">=2.11,<2.15")
