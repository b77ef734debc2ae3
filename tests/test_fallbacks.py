"""Fast paths that fall back say so: once through the ``fp8conf`` logger, and counted on the
compiled object, so that a torch whose internals moved costs speed or memory loudly.

On the torch this project tests with, every fast path is taken: a compile reports no fallback.
"""

from __future__ import annotations

import logging

import pytest

import fp8conf
from fp8conf import log
from fp8conf.compile import fast_call
from stack_steps import assert_matches_eager, traced


@pytest.fixture
def fresh_log(monkeypatch, caplog):
    monkeypatch.setattr(log, "_said", set())  # what this process already said is said again here
    caplog.set_level(logging.WARNING, logger="fp8conf")
    return caplog


@pytest.mark.parametrize("mode", ["regional", "full"])
def test_every_fast_path_is_taken_on_this_torch(mode, fresh_log):
    model, x, gm = traced(2)
    compiled = fp8conf.compile_joint(gm, mode=mode)
    assert compiled.fallbacks == ()
    assert not [r for r in fresh_log.records if r.name == "fp8conf"]


def test_a_unit_whose_wrappers_cannot_be_seen_through_falls_back_once_and_says_so(monkeypatch, fresh_log):
    # As on a torch whose wrapper layers this module does not know.
    monkeypatch.setattr(fast_call, "_next_layer", lambda layer: None)
    model, x, gm = traced(2)
    compiled = fp8conf.compile_joint(gm, mode="regional")
    assert len(compiled.fallbacks) == 1 and compiled.fallbacks[0].startswith("fast call: a wrapper layer"), compiled.fallbacks
    said = [r.getMessage() for r in fresh_log.records if r.name == "fp8conf"]
    assert len(said) == 1, said  # every unit fell back, for one reason: one line
    assert "fell back from its fast call path" in said[0] and "torch " in said[0]
    assert_matches_eager(gm, model, x, compiled.fn, seed=0)  # slower, never wrong


def test_a_backward_that_cannot_be_called_boxed_says_the_memory_saving_is_lost(monkeypatch, fresh_log):
    from fp8conf.compile import assemble as assemble_stage

    monkeypatch.setattr(assemble_stage, "_boxed_graph", lambda gm: None)
    model, x, gm = traced(2)
    compiled = fp8conf.compile_joint(gm, mode="regional")
    assert any(f.startswith("boxed backward:") for f in compiled.fallbacks), compiled.fallbacks
    assert any("keeps every saved value alive" in r.getMessage() for r in fresh_log.records if r.name == "fp8conf")
    assert_matches_eager(gm, model, x, compiled.fn, seed=0)


def test_doctor_shows_every_fast_path_on_here(capsys):
    from fp8conf.tools.cli import main

    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "torch    " in out and "torchao  " in out and "device   " in out
    from fp8conf.torch_internals import FAST_PATHS

    assert out.count("\non   ") == 2 + len(FAST_PATHS) and "OFF" not in out and "missing" not in out, out


def test_doctor_names_a_fast_path_that_is_off_and_an_untested_torch(monkeypatch, capsys):
    from fp8conf.tools import doctor
    from fp8conf.tools.cli import main

    monkeypatch.setattr(fast_call, "_next_layer", lambda layer: None)
    monkeypatch.setattr(doctor, "TESTED", {"torch": ("2.99",), "torchao": doctor.TESTED["torchao"]})
    assert main(["doctor"]) == 1
    captured = capsys.readouterr()
    assert "OFF  fast call" in captured.out and "regional: a wrapper layer" in captured.out, captured.out
    assert "is not among the tested releases (2.99)" in captured.err


def test_units_that_wait_for_their_kernels_one_by_one_are_counted_on_the_compiled_object(monkeypatch, fresh_log):
    # As on a torch whose AsyncCompile.wait this release cannot find: each unit waits for its
    # own kernels; the regional compile says so once and counts it.
    from fp8conf import torch_internals

    real = torch_internals.probe
    wait = "torch._inductor.async_compile.AsyncCompile.wait"
    failed = torch_internals.Probe(wait, False, "probe forced to fail")
    monkeypatch.setattr(torch_internals, "probe", lambda name: failed if name == wait else real(name))
    model, x, gm = traced(2)
    compiled = fp8conf.compile_joint(gm, mode="regional")
    assert compiled.fallbacks == ("put-off kernel waits: probe forced to fail",), compiled.fallbacks
    said = [r.getMessage() for r in fresh_log.records if r.name == "fp8conf"]
    assert len(said) == 1 and "put-off kernel waits" in said[0], said
    assert_matches_eager(gm, model, x, compiled.fn, seed=0)


def test_values_that_cannot_be_compared_are_different_blocks_and_the_log_says_why(caplog):
    from fp8conf.graph.equal_blocks import equal_values

    class Uncomparable:
        def __eq__(self, other):
            raise RuntimeError("no order here")

    with caplog.at_level(logging.DEBUG, logger="fp8conf"):
        assert not equal_values(Uncomparable(), Uncomparable())
    assert any("Uncomparable" in r.getMessage() and "taken as different" in r.getMessage() for r in caplog.records)


def test_a_torch_internal_that_fails_to_import_is_absent_with_its_reason_logged(monkeypatch, caplog):
    import importlib

    from fp8conf import torch_internals

    real = importlib.import_module

    def failing(name, *args, **kwargs):
        if name == "torch._inductor.codegen.cpp_utils":
            raise RuntimeError("broken on this build")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", failing)
    torch_internals.probe.cache_clear()  # probes are cached per process; this one must run now
    try:
        with caplog.at_level(logging.DEBUG, logger="fp8conf"):
            found = torch_internals.probe("torch._inductor.codegen.cpp_utils.DTYPE_TO_CPP")
    finally:
        torch_internals.probe.cache_clear()  # not the broken answer for later tests
    assert not found.found and "broken on this build" in found.reason
    assert any("broken on this build" in r.getMessage() for r in caplog.records)
