"""fp8conf.artifacts.signature and fp8conf.artifacts.store: the quantization signature, artifacts, the CLI."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fp8conf
from conformance.draw.fingerprints import reordered
from conformance.draw.models import LayerSpec, ModelSpec, build_model
from fp8conf import ArtifactError, ArtifactIntegrityError, FingerprintMismatchError, QuantizationSignature
from fp8conf.artifacts import store
from fp8conf.compile import units as units_stage
from fp8conf.artifacts.signature import ABSENT
from fingerprint_models import SPEC_A, SPEC_B

ROOT = Path(__file__).resolve().parent.parent
MIXED = ModelSpec(
    in_features=16,
    layers=(
        LayerSpec(width=16, recipe="tensorwise", bias=True, adapter=True),
        LayerSpec(width=32, recipe=None),
        LayerSpec(width=32, recipe="rowwise_with_gw_hp", emulate=True),
    ),
)


def sig(spec=MIXED, *, strict=True, model=None) -> QuantizationSignature:
    if model is None:
        model, _ = build_model(spec)
    return QuantizationSignature.from_model(model, strict=strict)


def with_config(model, fqn, **fields):
    module = model.get_submodule(fqn)
    module.config = dataclasses.replace(module.config, **fields)
    return model


#: The key this module's artifacts are signed with (the environment's key for the tests below).
KEY = bytes(range(32))


@pytest.fixture(autouse=True)
def _artifact_key(monkeypatch):
    monkeypatch.delenv("FP8CONF_ARTIFACT_KEY_FILE", raising=False)
    monkeypatch.setenv("FP8CONF_ARTIFACT_KEY", KEY.hex())


def _env(**extra):
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path, FP8CONF_ARTIFACT_KEY=KEY.hex(), **extra)


# --- the signature ------------------------------------------------------------------------------


def test_signature_names_every_quantized_module_and_its_numerics():
    s = sig()
    doc = json.loads(s.to_json())
    assert sorted(doc) == ["modules", "schema", "strict", "versions"]
    assert sorted(doc["modules"]) == ["layers.0", "layers.0.adapter", "layers.2"]
    assert doc["versions"] == {"torch": str(torch.__version__), "torchao": __import__("torchao").__version__}
    assert doc["strict"] is True
    layer0, layer2 = doc["modules"]["layers.0"], doc["modules"]["layers.2"]
    assert (layer0["kind"], layer0["recipe"], layer0["emulate"]) == ("float8_linear", "tensorwise", False)
    assert (layer2["recipe"], layer2["emulate"]) == ("rowwise_with_gw_hp", True)
    config = layer0["config"]
    for role in ("input", "weight", "grad_output", "input_for_grad_weight", "weight_for_grad_input", "grad_output_for_grad_weight"):
        assert set(config[f"cast_config_{role}"]) == {"scaling_type", "scaling_granularity", "target_dtype"}
    assert config["cast_config_input"] == {"scaling_type": "dynamic", "scaling_granularity": "tensorwise", "target_dtype": "torch.float8_e4m3fn"}
    assert config["gemm_config_output"] == {"use_fast_accum": True}
    assert {"round_scales_to_power_of_2", "pad_inner_dim"} <= set(config)
    assert "emulate" not in config  # a field of its own, not repeated
    assert layer2["config"]["cast_config_input_for_grad_weight"]["scaling_type"] == "disabled"


def test_signature_holds_nothing_unrelated_to_quantization():
    text = sig().to_json()
    for unrelated in ('"weight"', ".weight", "bias", "training", "requires_grad", "shape", "layers.1", "DrawnModel", "0x"):
        assert unrelated not in text, unrelated
    model, _ = build_model(MIXED)
    before = QuantizationSignature.from_model(model)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
        p.data.mul_(3)
    model.register_buffer("step", torch.tensor(7))
    model.layers[0].note = "unrelated"
    assert QuantizationSignature.from_model(model) == before


def test_json_is_canonical_and_round_trips():
    s = sig()
    text = s.to_json()
    assert text == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    assert QuantizationSignature.from_json(text) == s
    assert QuantizationSignature.from_json(s.to_json(indent=2)) == s
    assert s.sha256 == hashlib.sha256(text.encode()).hexdigest() == s.fingerprint
    assert len(s.sha256) == 64


def test_fingerprint_ignores_registration_and_dict_order():
    fresh, _ = build_model(MIXED)
    assert sig(model=reordered(fresh, MIXED)).sha256 == sig().sha256
    shuffled = QuantizationSignature(tuple(reversed(sig().modules)), True, sig().torch_version, sig().torchao_version)
    assert shuffled == sig() and shuffled.sha256 == sig().sha256


@pytest.mark.slow
def test_fingerprint_is_the_same_under_any_pythonhashseed():
    code = textwrap.dedent(
        """
        import warnings; warnings.simplefilter("ignore")
        from conformance.draw.models import build_model
        from fingerprint_models import SPEC_A
        from fp8conf import QuantizationSignature
        print("SHA", QuantizationSignature.from_model(build_model(SPEC_A)[0]).sha256)
        """
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=_env(PYTHONHASHSEED=seed), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        for seed in ("0", "1", "12345")
    ]
    digests = set()
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        digests.add(next(line.split()[1] for line in out.splitlines() if line.startswith("SHA ")))
    assert digests == {sig(SPEC_A).sha256}


@pytest.mark.parametrize(
    "change",
    [
        ("recipe", lambda m: setattr(m.layers[0], "config", __import__("torchao").float8.Float8LinearConfig.from_recipe_name("rowwise")) or m),
        ("round_scales_to_power_of_2", lambda m: with_config(m, "layers.0", round_scales_to_power_of_2=not m.layers[0].config.round_scales_to_power_of_2)),
        ("pad_inner_dim", lambda m: with_config(m, "layers.0", pad_inner_dim=True)),
        ("use_fast_accum", lambda m: with_config(m, "layers.0", gemm_config_output=dataclasses.replace(m.layers[0].config.gemm_config_output, use_fast_accum=False))),
        ("emulate", lambda m: with_config(m, "layers.0.adapter", emulate=True)),
    ],
    ids=lambda c: c[0],
)
def test_every_numerics_field_changes_the_fingerprint(change):
    field, mutate = change
    model, _ = build_model(MIXED)
    assert sig(model=mutate(model)).sha256 != sig().sha256
    assert any(field in path for path, _, _ in sig().diff(sig(model=model)))


def test_recipe_emulate_strict_and_versions_change_the_fingerprint(monkeypatch):
    base = sig()
    rowwise = dataclasses.replace(MIXED, layers=(dataclasses.replace(MIXED.layers[0], recipe="rowwise"),) + MIXED.layers[1:])
    assert sig(rowwise).sha256 != base.sha256
    emulated = dataclasses.replace(MIXED, layers=(dataclasses.replace(MIXED.layers[0], emulate=True),) + MIXED.layers[1:])
    assert sig(emulated).sha256 != base.sha256
    assert sig(strict=False).sha256 != base.sha256
    import torchao

    monkeypatch.setattr(torchao, "__version__", "0.99.0")
    assert sig().sha256 != base.sha256
    assert sig().diff(base) == [("versions.torchao", "0.99.0", base.torchao_version)]


def test_diff_is_field_by_field():
    a = sig()
    b = sig(dataclasses.replace(MIXED, layers=(dataclasses.replace(MIXED.layers[0], recipe="rowwise", adapter=False),) + MIXED.layers[1:]), strict=False)
    differences = a.diff(b)
    paths = [p for p, _, _ in differences]
    assert paths == sorted(paths)
    assert ("modules[layers.0].recipe", "tensorwise", "rowwise") in differences
    assert ("modules[layers.0].config.cast_config_input.scaling_granularity", "tensorwise", "axiswise") in differences
    assert ("strict", True, False) in differences
    absent = [d for d in differences if d[0] == "modules[layers.0.adapter]"]
    assert len(absent) == 1 and absent[0][2] is ABSENT and absent[0][1]["recipe"] == "tensorwise"
    assert not any(p.startswith("modules[layers.2]") for p in paths)
    assert a.diff(sig()) == []


class _FakeMX(torch.nn.Linear):
    """An MX module of someone else's, declared through the quantized-module protocol (a mapping:
    no import of fp8conf), with the settings the signature keys on."""

    def __init__(self, scale_rounding="floor", recipe="mxfp8"):
        super().__init__(32, 32)
        self.recipe, self.emulate, self.scale_rounding = recipe, recipe == "mxfp8_emulated", scale_rounding

    def fp8_quantization(self):
        return {"kind": "mxfp8_linear", "recipe": self.recipe, "emulate": self.emulate,
                "settings": {"block_size": 32, "scale_rounding": self.scale_rounding}}


def test_mx_modules_sign_block_size_and_scale_rounding():
    model = torch.nn.Sequential(_FakeMX())
    s = QuantizationSignature.from_model(model)
    entry = json.loads(s.to_json())["modules"]["0"]
    assert entry == {"kind": "mxfp8_linear", "recipe": "mxfp8", "emulate": False, "config": {"block_size": 32, "scale_rounding": "floor"}}
    assert QuantizationSignature.from_model(torch.nn.Sequential(_FakeMX("rup"))).diff(s) == [("modules[0].config.scale_rounding", "rup", "floor")]
    assert QuantizationSignature.from_model(torch.nn.Sequential(_FakeMX(recipe="mxfp8_emulated"))).sha256 != s.sha256


# --- artifacts ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """SPEC_A's training step compiled once: its artifact and what the compiled graph computed."""
    model, args = build_model(SPEC_A)
    gm = fp8conf.trace_joint(model, args)
    compiled = fp8conf.precompile_joint(gm)
    grad_outputs = (torch.randn(SPEC_A.batch, SPEC_A.layers[-1].width, generator=torch.Generator().manual_seed(1)),)
    outputs, grads = compiled.run(model, args, grad_outputs)
    path = tmp_path_factory.mktemp("artifact") / "a.fp8"
    header = fp8conf.save_artifact(path, compiled, QuantizationSignature.from_model(model), key=KEY)
    torch.save({"state": model.state_dict(), "args": args, "grad_outputs": grad_outputs, "outputs": outputs, "grads": grads}, path.with_suffix(".pt"))
    return path, header, model, args, grad_outputs, outputs, grads


def _same(a, b) -> bool:
    return torch.equal(a, b) and a.dtype == b.dtype


def test_save_then_load_in_process_reproduces_the_outputs(saved):
    path, header, model, args, grad_outputs, outputs, grads = saved
    assert header.mechanism == "standalone_compile" and header.fingerprint == sig(SPEC_A).sha256
    loaded = fp8conf.load_for_model(path, build_model(SPEC_A)[0])
    assert loaded.signature == sig(SPEC_A)
    out, got = loaded.run(model, args, grad_outputs)
    assert all(_same(a, b) for a, b in zip(out, outputs)) and sorted(got) == sorted(grads)
    assert all(_same(got[k], grads[k]) for k in grads)
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".fp8conf-artifact-")]  # atomic write


@pytest.mark.slow
def test_round_trip_in_a_fresh_process_is_bitwise(saved, tmp_path):
    """A new interpreter with an empty Inductor cache loads the artifact and reproduces the outputs
    of the compiled graph that was saved, bit for bit."""
    path = saved[0]
    code = textwrap.dedent(
        f"""
        import warnings; warnings.simplefilter("ignore")
        import torch, fp8conf
        from conformance.draw.models import build_model
        from fingerprint_models import SPEC_A
        data = torch.load({str(path.with_suffix(".pt"))!r})
        model, _ = build_model(SPEC_A)
        model.load_state_dict(data["state"])
        loaded = fp8conf.load_for_model({str(path)!r}, model)
        outputs, grads = loaded.run(model, data["args"], data["grad_outputs"])
        same = all(torch.equal(a, b) for a, b in zip(outputs, data["outputs"])) and len(outputs) == len(data["outputs"])
        same = same and sorted(grads) == sorted(data["grads"]) and all(torch.equal(grads[k], data["grads"][k]) for k in grads)
        print("BITWISE" if same else "DIFFERENT", loaded.mechanism)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=_env(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor-cache")),
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "BITWISE standalone_compile" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_loading_under_another_fingerprint_names_the_fields_and_never_deserializes(saved, monkeypatch):
    path = saved[0]

    def never(*a, **k):
        raise AssertionError("the payload of a mismatched artifact was deserialized")

    monkeypatch.setattr(store, "_load_standalone", never)
    monkeypatch.setattr(store, "_load_pickled_graph", never)
    with pytest.raises(FingerprintMismatchError) as info:
        fp8conf.load_for_model(path, build_model(SPEC_B)[0])
    exc = info.value
    assert "modules[layers.0].recipe" in exc.fields and "modules[layers.2].emulate" in exc.fields
    assert "modules[layers.0].recipe: 'tensorwise' (artifact) -> 'rowwise' (current)" in str(exc)
    # The change as a person made it comes first, once; the fields it touched follow.
    summary, fields = str(exc).split("Fields that differ", 1)
    assert "  layers.0: recipe tensorwise \u2192 rowwise\n" in summary and "layers.2, layers.2.adapter: emulate True \u2192 False" in summary
    assert summary.count("tensorwise") == 1 and "modules[" not in summary
    assert exc.artifact_fingerprint == sig(SPEC_A).sha256 and exc.current_fingerprint == sig(SPEC_B).sha256
    with pytest.raises(FingerprintMismatchError, match="strict"):
        fp8conf.load_for_model(path, build_model(SPEC_A)[0], strict=False)
    import torch as torch_module

    monkeypatch.setattr(torch_module, "__version__", "2.99.0")
    with pytest.raises(FingerprintMismatchError, match=r"versions\.torch: '[^']+' \(artifact\) -> '2\.99\.0'"):
        fp8conf.load_for_model(path, build_model(SPEC_A)[0])


def _corrupt(saved, tmp_path, edit) -> Path:
    data = bytearray(saved[0].read_bytes())
    target = tmp_path / "bad.fp8"
    target.write_bytes(bytes(edit(data)))
    return target


@pytest.mark.parametrize(
    "edit, error, message",
    [
        (lambda d: d[: len(d) // 2], ArtifactIntegrityError, "truncated, corrupt or altered"),
        (lambda d: d[:20], ArtifactIntegrityError, "truncated"),
        (lambda d: d[:-100] + bytes([d[-100] ^ 0xFF]) + d[-99:], ArtifactIntegrityError, "digest does not match"),
        (lambda d: b"NOT-AN-ARTIFACT" + d, ArtifactError, "not an fp8conf artifact"),
        (lambda d: d + b"junk", ArtifactIntegrityError, "digest does not match"),
        (lambda d: d.replace(b'"tensorwise"', b'"tensorwiSe"', 1), ArtifactIntegrityError, "digest does not match"),
        (lambda d: d.replace(b"FP8CONF-ARTIFACT/3\n", b"FP8CONF-ARTIFACT/9\n", 1), ArtifactError, "format version 9"),
        (lambda d: d.replace(b"FP8CONF-ARTIFACT/3\n", b"FP8CONF-ARTIFACT\n", 1), ArtifactError, "format version 1"),
        (lambda d: d.replace(b"FP8CONF-ARTIFACT/3\n", b"FP8CONF-ARTIFACT/2\n", 1), ArtifactError, "format version 2; this fp8conf reads version 3"),
        (lambda d: d[:25] + b"x" + d[26:], ArtifactIntegrityError, "digest does not match"),
    ],
    ids=["half", "header-cut", "payload-bit", "magic", "trailing", "tampered-signature", "format", "format-1", "format-2", "header-json"],
)
def test_corrupt_or_truncated_artifacts_raise_a_clear_error(saved, tmp_path, edit, error, message):
    bad = _corrupt(saved, tmp_path, edit)
    with pytest.raises(error, match=message) as info:
        fp8conf.load_for_model(bad, build_model(SPEC_A)[0])
    assert info.value.path == str(bad)


def test_a_missing_artifact_is_an_artifact_error(tmp_path):
    with pytest.raises(ArtifactError, match="cannot read"):
        fp8conf.load_artifact(tmp_path / "nope.fp8", sig(SPEC_A))


def test_stale_inputs_are_refused_at_call_time(saved):
    path, *_ = saved
    loaded = fp8conf.load_for_model(path, build_model(SPEC_A)[0])
    wider = dataclasses.replace(SPEC_A, batch=8)
    model, args = build_model(wider)
    with pytest.raises(ArtifactError, match="stale"):
        loaded.run(model, args, (torch.ones(8, 32),))


def test_save_refuses_a_signature_of_another_model(tmp_path):
    model, args = build_model(SPEC_A)
    gm = fp8conf.trace_joint(model, args)
    with pytest.raises(ArtifactError, match="does not describe the traced graph"):
        fp8conf.save_artifact(tmp_path / "x.fp8", gm, sig(SPEC_B), mechanism="graph_pickler", key=KEY)
    assert not (tmp_path / "x.fp8").exists()


def test_graph_pickler_mechanism_and_auto_fallback(saved, tmp_path, monkeypatch):
    _, _, model, args, grad_outputs, outputs, grads = saved
    gm = fp8conf.trace_joint(model, args)
    signature = QuantizationSignature.from_model(model)

    def broken(*a, **k):
        raise RuntimeError("inductor cannot compile this graph")

    real_compile = units_stage._standalone_compile
    monkeypatch.setattr(units_stage, "_standalone_compile", broken)
    with pytest.warns(UserWarning, match="standalone_compile failed"):
        header = fp8conf.save_artifact(tmp_path / "p.fp8", gm, signature)
    assert header.mechanism == "graph_pickler" and "inductor cannot compile" in header.note
    with pytest.raises(ArtifactError, match="standalone_compile"):
        fp8conf.save_artifact(tmp_path / "q.fp8", gm, signature, mechanism="standalone_compile")
    monkeypatch.setattr(units_stage, "_standalone_compile", real_compile)
    loaded = fp8conf.load_artifact(tmp_path / "p.fp8", signature)
    assert loaded.mechanism == "graph_pickler"
    out, got = loaded.run(model, args, grad_outputs)
    assert all(_same(a, b) for a, b in zip(out, outputs)) and all(_same(got[k], grads[k]) for k in grads)


# --- the CLI --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_diff_prints_a_readable_field_diff(saved):
    path = saved[0]
    proc = subprocess.run(
        [sys.executable, "-m", "fp8conf.tools.cli", "precompile", "diff", str(path), "--model", "fingerprint_models:model_b"],
        env=_env(), capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"--- artifact {path} (standalone_compile)  fingerprint {sig(SPEC_A).sha256[:16]}")
    assert lines[1].startswith("+++ model fingerprint_models:model_b (strict=True)  fingerprint")
    assert '  modules[layers.0].recipe: "tensorwise" -> "rowwise"' in lines
    assert "  modules[layers.2].emulate: true -> false" in lines
    assert '  modules[layers.0].config.cast_config_input.scaling_granularity: "tensorwise" -> "axiswise"' in lines
    assert lines[2] == "changed: layers.0: recipe tensorwise \u2192 rowwise"
    assert lines[4].endswith("fields differ:")


def test_cli_load_show_and_diff_in_process(saved, tmp_path, capsys):
    from fp8conf.tools.cli import main

    path = saved[0]
    assert main(["precompile", "diff", str(path), "--model", "fingerprint_models:model_a"]) == 0
    assert "the signatures are identical" in capsys.readouterr().out
    assert main(["precompile", "load", str(path), "--model", "fingerprint_models:model_a", "--run"]) == 0
    out = capsys.readouterr().out
    assert "parameter, buffer and input shapes match the current model" in out and "ran it: 1 output(s)" in out
    assert main(["precompile", "load", str(path), "--model", "fingerprint_models:model_b"]) == 1
    err = capsys.readouterr().err
    assert "fingerprint mismatch" in err and "modules[layers.0].recipe" in err
    assert main(["precompile", "show", str(path), "--json"]) == 0
    (tmp_path / "sig.json").write_text(capsys.readouterr().out)
    assert main(["precompile", "diff", str(tmp_path / "sig.json"), str(path)]) == 0
    capsys.readouterr()
    assert main(["precompile", "diff", str(path), "--model", "fingerprint_models:model_a", "--no-strict", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["differences"] == [{"field": "strict", "left": True, "right": False}]
    bad = tmp_path / "cut.fp8"
    bad.write_bytes(path.read_bytes()[:100])
    assert main(["precompile", "load", str(bad), "--model", "fingerprint_models:model_a"]) == 3
    assert "truncated" in capsys.readouterr().err


def test_cli_save_writes_an_artifact_that_loads(tmp_path, capsys):
    from fp8conf.tools.cli import main

    out = tmp_path / "cli.fp8"
    assert main(["precompile", "save", "--model", "fingerprint_models:model_a", "--out", str(out), "--mechanism", "graph_pickler"]) == 0
    assert "saved" in capsys.readouterr().out
    header = fp8conf.read_header(out)
    assert header.mechanism == "graph_pickler" and header.signature == sig(SPEC_A)
