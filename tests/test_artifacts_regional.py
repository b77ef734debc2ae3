"""Regional precompile (fp8conf.artifacts.regional): a regionally compiled joint graph and a
GraphPP split's three callables saved, checked and loaded like every artifact, loading compiling
nothing and reproducing the compiled step bitwise in a fresh process."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fp8conf
from conformance.draw.models import build_model
from fingerprint_models import SPEC_A, SPEC_B
from fp8conf import ArtifactError, ArtifactIntegrityError, FingerprintMismatchError, QuantizationSignature
from fp8conf.artifacts.format import read_artifact, seal, write_atomic
from fp8conf.artifacts.regional import load_split_artifact, save_split_artifact
from fp8conf.tools.cli import main

ROOT = Path(__file__).resolve().parent.parent
KEY = bytes(range(7, 39))
#: SPEC_A whose input needs a gradient, so that the split's dI is not empty.
SPEC_R = dataclasses.replace(SPEC_A, input_requires_grad=True)


@pytest.fixture(autouse=True)
def _loader_key(monkeypatch):
    monkeypatch.delenv("FP8CONF_ARTIFACT_KEY_FILE", raising=False)
    monkeypatch.setenv("FP8CONF_ARTIFACT_KEY", KEY.hex())


def _same(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and a.dtype == b.dtype and torch.equal(a, b))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """SPEC_R's step compiled regionally, whole and split, saved, with what each computed."""
    directory = tmp_path_factory.mktemp("regional")
    model, args = build_model(SPEC_R)
    signature = QuantizationSignature.from_model(model)
    gm = fp8conf.trace_joint(model, args)
    grad_outputs = (torch.randn(SPEC_R.batch, SPEC_R.layers[-1].width, generator=torch.Generator().manual_seed(3)),)
    joint = fp8conf.precompile_joint(gm, mode="regional")
    outputs, grads = joint.run(model, args, grad_outputs)
    joint_header = fp8conf.save_artifact(directory / "joint.fp8", joint, signature, key=KEY)
    split = fp8conf.split_stage(gm)
    fns = fp8conf.compile_split(split, mode="regional")
    primals, tangents = fp8conf.joint_signature(gm).feed(model, args, grad_outputs)
    split_flat = split.run([p.detach() for p in primals], [t.detach() for t in tangents], fns)
    split_header = save_split_artifact(directory / "split.fp8", gm, split, signature, fns, key=KEY)
    fp8conf.save_artifact(directory / "pickled.fp8", gm, signature, mechanism="graph_pickler", key=KEY)  # compiled when loaded
    torch.save({"state": model.state_dict(), "args": args, "grad_outputs": grad_outputs, "outputs": outputs, "grads": grads,
                "split_flat": split_flat}, directory / "expected.pt")
    return directory, model, args, grad_outputs, joint, joint_header, split_header, outputs, grads, split_flat


def test_the_header_records_each_compiled_region_and_the_parts(saved):
    joint, joint_header, split_header = saved[4], saved[5], saved[6]
    assert joint_header.mechanism == "regional" and [p["name"] for p in joint_header.parts] == ["joint"]
    regions = joint_header.parts[0]["regions"]
    # layers.0 is the only non-emulated quantized module: one forward and one backward region.
    assert sorted((r["module_fqn"], r["pass_name"]) for r in regions) == [("layers.0", "backward"), ("layers.0", "forward")]
    assert all(any(n.startswith("_scaled_mm") for n in r["nodes"]) for r in regions)
    assert regions == joint.regions
    assert [p["name"] for p in split_header.parts] == ["forward", "backward_input", "backward_weight"]
    assert split_header.split["input_grads"] == ["input.0"] and split_header.split["num_outputs"] == 1
    assert sum(p["size"] for p in split_header.parts) + sum(p["size"] for p in split_header.pieces) == split_header.payload_size


def _piece_calls(graph) -> list:
    from fp8conf.artifacts.regional import _compiled_piece

    return [n for n in graph.graph.nodes if n.op == "call_function" and _compiled_piece(n.target) is not None]


def test_each_distinct_compiled_region_is_stored_once_and_loaded_once(tmp_path):
    """Four identical blocks, compiled in units of one block's forward or backward (the last
    block's both in one, with nothing eager between them): seven call sites of four distinct
    compiled units (the forward of every block but the last; the last block's; the backward of
    the middle blocks; the first block's, which makes no input gradient). The artifact holds four
    compiled pieces, and after loading the seven call sites share four callables, computing
    what the compiled step computed."""
    from fp8conf.tools.example_models import build_stack

    model = build_stack(16, 4, "tensorwise", head=False)
    x, grad = torch.randn(32, 16, generator=torch.Generator().manual_seed(1)), torch.ones(32, 16)
    joint = fp8conf.precompile_joint(fp8conf.trace_joint(model, (x,)), mode="regional")
    calls = _piece_calls(joint.artifact)
    distinct = {id(n.target.__wrapped__) for n in calls}
    assert len(calls) == 7 and len(distinct) == 4
    header = fp8conf.save_artifact(tmp_path / "stack.fp8", joint, QuantizationSignature.from_model(model), key=KEY)
    assert len(header.pieces) == len(distinct)
    assert header.payload_size == header.parts[0]["size"] + sum(p["size"] for p in header.pieces)
    loaded = fp8conf.load_for_model(tmp_path / "stack.fp8", model, (x,))
    loaded_calls = _piece_calls(loaded.artifact)
    assert len(loaded_calls) == 7 and len({n.target for n in loaded_calls}) == 4
    (out, grads), (want, want_grads) = loaded.run(model, (x,), (grad,)), joint.run(model, (x,), (grad,))
    assert all(_same(a, b) for a, b in zip(out, want)) and all(_same(grads[k], want_grads[k]) for k in want_grads)
    # A piece whose bytes are not the ones its (authenticated) header entry names is not loaded,
    # even re-signed with the loader's key.
    read, payload = read_artifact(tmp_path / "stack.fp8", key=KEY)
    at = read.parts[0]["size"] + 10
    _, data = seal(read, payload[:at] + bytes([payload[at] ^ 1]) + payload[at + 1:], KEY)
    write_atomic(str(tmp_path / "piece.fp8"), data)
    with pytest.raises(ArtifactIntegrityError, match="compiled piece 0 does not match its sha256"):
        fp8conf.load_for_model(tmp_path / "piece.fp8", model, (x,))


def test_a_regional_artifact_loads_in_process_bitwise(saved):
    directory, model, args, grad_outputs, *_, outputs, grads, split_flat = saved
    loaded = fp8conf.load_for_model(directory / "joint.fp8", build_model(SPEC_R)[0], args)
    assert loaded.mechanism == "regional" and len(loaded.regions) == 2
    out, got = loaded.run(model, args, grad_outputs)
    assert all(_same(a, b) for a, b in zip(out, outputs)) and sorted(got) == sorted(grads)
    assert all(_same(got[k], grads[k]) for k in grads)
    split = load_split_artifact(directory / "split.fp8", QuantizationSignature.from_model(model))
    primals, tangents = split.joint_signature.feed(model, args, grad_outputs)
    assert all(_same(a, b) for a, b in zip(split.run(primals, tangents), split_flat))
    assert sorted(split.regions) == ["backward_input", "backward_weight", "forward"]


def test_the_remainders_compiled_pieces_are_saved_and_loaded_with_the_regions(saved):
    directory, model, args, *_ = saved
    joint = saved[4]
    # Two compiled regions; the rest of the step is compiled in pieces of its own.
    calls = len(_piece_calls(joint.artifact))
    assert calls > len(joint.regions) == 2
    loaded = fp8conf.load_for_model(directory / "joint.fp8", build_model(SPEC_R)[0], args)
    assert len(_piece_calls(loaded.artifact)) == calls


@pytest.mark.slow
def test_round_trip_in_a_fresh_process_is_bitwise_and_compiles_nothing(saved, tmp_path):
    """A new interpreter with an empty Inductor cache, in which every way of compiling a graph
    raises, loads both artifacts and reproduces what the compiled graphs computed, bit for bit."""
    directory = saved[0]
    code = textwrap.dedent(
        f"""
        import warnings; warnings.simplefilter("ignore")
        import torch, fp8conf
        import torch._inductor.compile_fx as compile_fx, torch._inductor.standalone_compile as standalone
        import torch.fx.passes.regional_inductor as regional_inductor
        import fp8conf.compile.joint as graph_compile

        def compiled(*a, **k):
            raise RuntimeError("loading an artifact compiled a graph")

        for module, name in [(compile_fx, "compile_fx"), (compile_fx, "compile_fx_inner"), (standalone, "standalone_compile"),
                             (torch._inductor, "standalone_compile"), (regional_inductor, "regional_inductor"),
                             (graph_compile, "compile_joint"), (torch, "compile")]:
            setattr(module, name, compiled)
        from conformance.draw.models import build_model
        from test_artifacts_regional import SPEC_R
        from fp8conf.artifacts.regional import load_split_artifact
        data = torch.load({str(directory / "expected.pt")!r})
        model, _ = build_model(SPEC_R)
        model.load_state_dict(data["state"])
        loaded = fp8conf.load_for_model({str(directory / "joint.fp8")!r}, model, data["args"])
        outputs, grads = loaded.run(model, data["args"], data["grad_outputs"])
        same = len(outputs) == len(data["outputs"]) and all(torch.equal(a, b) for a, b in zip(outputs, data["outputs"]))
        same = same and sorted(grads) == sorted(data["grads"]) and all(torch.equal(grads[k], data["grads"][k]) for k in grads)
        split = load_split_artifact({str(directory / "split.fp8")!r}, fp8conf.QuantizationSignature.from_model(model))
        primals, tangents = split.joint_signature.feed(model, data["args"], data["grad_outputs"])
        flat = split.run(primals, tangents)
        same_split = len(flat) == len(data["split_flat"]) and all(
            (a is None and b is None) or torch.equal(a, b) for a, b in zip(flat, data["split_flat"]))
        print("JOINT", "BITWISE" if same else "DIFFERENT", "SPLIT", "BITWISE" if same_split else "DIFFERENT")
        try:  # the control: an artifact that is compiled when loaded trips the patches
            fp8conf.load_for_model({str(directory / "pickled.fp8")!r}, model)
        except fp8conf.ArtifactError as exc:
            print("CONTROL", "TRIPPED" if "loading an artifact compiled a graph" in str(exc) else exc)
        """
    )
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor-cache"))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "JOINT BITWISE SPLIT BITWISE" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "CONTROL TRIPPED" in proc.stdout, proc.stdout[-2000:]


def test_a_regional_artifact_is_checked_like_every_artifact(saved, tmp_path):
    directory = saved[0]
    with pytest.raises(FingerprintMismatchError, match="layers.0: recipe tensorwise"):
        fp8conf.load_for_model(directory / "joint.fp8", build_model(SPEC_B)[0])
    with pytest.raises(FingerprintMismatchError):
        load_split_artifact(directory / "split.fp8", QuantizationSignature.from_model(build_model(SPEC_B)[0]))
    data = bytearray((directory / "split.fp8").read_bytes())
    data[-1000] ^= 1
    (tmp_path / "bad.fp8").write_bytes(bytes(data))
    with pytest.raises(ArtifactIntegrityError):
        load_split_artifact(tmp_path / "bad.fp8", QuantizationSignature.from_model(saved[1]))
    with pytest.raises(ArtifactError, match="holds a GraphPP split"):
        fp8conf.load_artifact(directory / "split.fp8", QuantizationSignature.from_model(saved[1]))
    with pytest.raises(ArtifactError, match="not a GraphPP split"):
        load_split_artifact(directory / "joint.fp8", QuantizationSignature.from_model(saved[1]))


def test_a_recorded_region_that_runs_eagerly_after_loading_is_refused(saved, tmp_path):
    """The header names each compiled region's nodes; a graph in which one of them is an eager
    node (a region left out of the compiled code) is not used, even when properly signed."""
    directory, model, joint = saved[0], saved[1], saved[4]
    eager = next(n.name for n in joint.artifact.graph.nodes if n.op == "call_function")
    header, payload = read_artifact(directory / "joint.fp8", key=KEY)
    parts = [dict(p, regions=[dict(r) for r in p["regions"]]) for p in header.parts]
    parts[0]["regions"][0]["nodes"] = parts[0]["regions"][0]["nodes"] + [eager]
    _, data = seal(dataclasses.replace(header, parts=parts), payload, KEY)
    write_atomic(str(tmp_path / "eager.fp8"), data)
    with pytest.raises(ArtifactError, match=rf"FP8 region .* of module 'layers.0' .* runs eagerly after loading \(nodes \['{eager}'\]\)"):
        fp8conf.load_for_model(tmp_path / "eager.fp8", model)


def test_cli_saves_and_runs_a_regional_artifact(tmp_path, capsys):
    out = tmp_path / "cli.fp8"
    assert main(["precompile", "save", "--model", "fingerprint_models:model_a", "--out", str(out), "--mechanism", "regional"]) == 0
    assert "saved" in capsys.readouterr().out and fp8conf.read_header(out).mechanism == "regional"
    assert main(["precompile", "load", str(out), "--model", "fingerprint_models:model_a", "--run"]) == 0
    assert "regional" in capsys.readouterr().out


def test_cli_save_with_a_repeat_naming_no_container_is_a_usage_error(tmp_path, capsys):
    from fp8conf.tools.precompile import EXIT_USAGE

    out = tmp_path / "none.fp8"
    assert main(["precompile", "save", "--model", "fingerprint_models:model_a", "--out", str(out), "--repeat", "trunk"]) == EXIT_USAGE
    assert "has no submodule 'trunk'" in capsys.readouterr().err and not out.exists()


def test_cli_save_hands_one_compile_config_to_precompile_model(tmp_path, monkeypatch):
    import fp8conf.artifacts.store

    seen = []

    def precompile_model(path, model, args, config=None, **keywords):
        seen.append(config)
        raise fp8conf.FP8ConfigError("stopped before compiling")

    monkeypatch.setattr(fp8conf.artifacts.store, "precompile_model", precompile_model)
    out = tmp_path / "config.fp8"
    argv = ["precompile", "save", "--model", "fingerprint_models:model_a", "--out", str(out), "--mechanism", "regional"]
    main(argv + ["--no-strict", "--remainder", "eager", "--workers", "2"])
    assert seen == [fp8conf.CompileConfig(strict=False, remainder="eager", workers=2)]


def test_cli_save_refuses_a_bad_compile_setting_before_tracing(tmp_path, capsys):
    from fp8conf.tools.precompile import EXIT_USAGE

    out = tmp_path / "bad.fp8"
    assert main(["precompile", "save", "--model", "fingerprint_models:model_a", "--out", str(out), "--workers", "-1"]) == EXIT_USAGE
    assert "CompileConfig(workers=-1)" in capsys.readouterr().err and not out.exists()


def test_precompile_takes_a_compile_config_or_its_keywords_not_both():
    gm = fp8conf.trace_joint(*_small())
    with pytest.raises(fp8conf.FP8ConfigError, match="not both"):
        fp8conf.precompile_joint(gm, config=fp8conf.CompileConfig(mode="regional"), mode="full")
    with pytest.raises(fp8conf.FP8ConfigError, match="cannot hold a CUDA graph"):
        fp8conf.precompile_joint(gm, config=fp8conf.CompileConfig(mode="full", cudagraph=True))
    with pytest.raises(fp8conf.FP8ConfigError, match="choose one of"):
        fp8conf.precompile_joint(gm, mode="fast")


def _small():
    return build_model(SPEC_A)  # (model, args)


def test_a_deep_model_precompiled_from_its_repeated_trace_loads_and_computes_its_step(tmp_path):
    """precompile_model(repeat=...) saves the step of the repeated trace (six blocks, four
    traced); loaded, it computes what the whole trace's graph computes."""
    from fp8conf.tools.example_models import build_stack

    model = build_stack(16, 6, "tensorwise", head=False)
    x, grad = torch.randn(32, 16, generator=torch.Generator().manual_seed(2)), torch.ones(32, 16)
    fp8conf.precompile_model(tmp_path / "deep.fp8", model, (x,), mechanism="regional", key=KEY, repeat="blocks")
    loaded = fp8conf.load_for_model(tmp_path / "deep.fp8", model, (x,), key=KEY)
    (out, grads) = loaded.run(model, (x,), (grad,))
    (want,), want_grads = fp8conf.run_joint(fp8conf.trace_joint(model, (x,)), model, (x,), (grad,))
    torch.testing.assert_close(out[0], want)
    assert grads.keys() == want_grads.keys()
    for name, value in want_grads.items():
        torch.testing.assert_close(grads[name], value, msg=lambda m, name=name: f"gradient of {name}: {m}")
