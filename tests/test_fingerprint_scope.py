"""What a backend declares about its fingerprint, and what the FPR rules then hold it to.

* ``Backend.fingerprint_scope``: a ``"whole_step"`` fingerprint may change with structure,
  registration order and unrelated job settings; a ``"quantization"`` one may not. Both change
  with every quantization input and agree across builds and processes.
* Versions are simulated where every reader sees them: ``__version__`` and the installed
  package metadata (``conformance.draw.versions``).
* ``Backend.expressible_config_fields`` and ``UnsupportedConfig``: config-field changes are drawn
  from what a backend's jobs can express; refusing an inexpressible one is ``not_supported``,
  refusing a model converted from named recipes a failure.

The suite runs are real ``pytest --fp8-backend=...`` subprocesses (``test_mutants.run_suite``).
"""

from __future__ import annotations

import importlib.metadata
import sys

import pytest
from hypothesis import given, settings
from packaging.version import Version

from conformance.api import FINGERPRINT_SCOPES, Backend, UnsupportedConfig
from conformance.backends.makefx import MakeFxBackend
from conformance.backends.reference import ReferenceBackend
from conformance.judge.fingerprint_scopes import SCOPE_PROMISES
from conformance.draw.fingerprints import (
    CONFIG_FIELDS,
    STRUCTURE_KINDS,
    UNRELATED_KINDS,
    Variant,
    drawable_config_fields,
    quantization_changes,
)
from conformance.draw.models import LayerSpec, ModelSpec, build_model
from conformance.draw.versions import current_version, other_version, simulated_versions
from test_mutants import run_suite

SPEC = ModelSpec(in_features=16, layers=(LayerSpec(width=16, recipe="rowwise"), LayerSpec(width=32, recipe=None)))


# --- the contract ---------------------------------------------------------------------------------


def test_the_default_scope_is_quantization_and_every_field_is_expressible():
    assert Backend.fingerprint_scope == "quantization" and Backend.expressible_config_fields is None
    assert ReferenceBackend.fingerprint_scope == "quantization" and ReferenceBackend.expressible_config_fields is None
    assert MakeFxBackend.fingerprint_scope == "whole_step" and MakeFxBackend.expressible_config_fields == frozenset()
    assert set(SCOPE_PROMISES) == set(FINGERPRINT_SCOPES)


def test_an_unknown_scope_or_a_malformed_field_set_is_refused_when_the_backend_is_defined():
    with pytest.raises(TypeError, match="fingerprint_scope is 'graph'"):
        type("GraphScope", (ReferenceBackend,), {"fingerprint_scope": "graph"})
    with pytest.raises(TypeError, match="expressible_config_fields"):
        type("OneString", (ReferenceBackend,), {"expressible_config_fields": "pad_inner_dim"})


def test_only_a_whole_step_scope_relaxes_invariance_and_every_scope_stays_sensitive():
    quantization, whole_step = SCOPE_PROMISES["quantization"], SCOPE_PROMISES["whole_step"]
    assert all(vars(quantization).values()), quantization
    assert not any(vars(whole_step).values()), whole_step
    # Structure is what a whole-step key may cover; mode, flags, values and plain attributes not.
    assert set(STRUCTURE_KINDS) == {"unrelated_buffers", "model_around"} and set(STRUCTURE_KINDS) < set(UNRELATED_KINDS)


def test_a_whole_step_scope_passes_the_structure_rules_its_key_breaks_for_a_quantization_scope(tmp_path):
    # The same key, declared whole_step, passes FPR-002 and FPR-003 (with notes saying what was
    # not compared); declared quantization it fails them (mutants FingerprintCovers*).
    statuses, out = run_suite("mutants.contract:WholeStepReference", ["FPR-002", "FPR-003"], tmp_path)
    for property_id, words in (("FPR-002", "reverse registration order"), ("FPR-003", "structure changes")):
        row = statuses[property_id]
        assert row["status"] == "pass", out[-3000:]
        assert any(words in note and "whole_step" in note for note in row.get("notes", ())), row


# --- versions ------------------------------------------------------------------------------------------


def _seen(name: str) -> set[str]:
    module = sys.modules[name]
    return {
        str(module.__version__),
        importlib.metadata.version(name),
        importlib.metadata.distribution(name).version,
        importlib.metadata.metadata(name)["Version"],
    }


@pytest.mark.parametrize("name", ["torch", "torchao"])
@pytest.mark.parametrize("how", ["local", "post"])
def test_a_simulated_version_is_what_every_reader_sees_until_the_block_ends(name, how):
    importlib.import_module(name)
    before = _seen(name)
    finders = list(sys.meta_path)
    version = other_version(current_version(name), how)
    assert Version(version) != Version(current_version(name))  # a valid version, another one
    with simulated_versions({name: version}):
        assert _seen(name) == {version}
        assert importlib.metadata.version(name.upper()) == version  # names are normalized
        assert importlib.metadata.version("pytest") == pytest.__version__  # other packages untouched
    assert _seen(name) == before and sys.meta_path == finders


def test_a_simulated_version_is_undone_when_the_block_raises():
    import torchao

    before, finders = _seen("torchao"), list(sys.meta_path)
    with pytest.raises(RuntimeError, match="inside"):
        with Variant(SPEC, versions=(("torchao", "9.9.9"),)).patched():
            assert importlib.metadata.version("torchao") == "9.9.9" == torchao.__version__
            raise RuntimeError("inside")
    assert _seen("torchao") == before and sys.meta_path == finders


def test_a_backend_that_reads_package_metadata_sees_the_simulated_version(monkeypatch):
    # makefx keys its artifacts with importlib.metadata's versions: patching __version__ alone,
    # as the suite once did, leaves its key unchanged; the simulation changes it.
    import torchao

    backend = MakeFxBackend()
    model, _ = build_model(SPEC)
    key = backend.fingerprint(model)
    version = other_version(current_version("torchao"), "post")
    monkeypatch.setattr(torchao, "__version__", version)
    assert backend.fingerprint(model) == key
    monkeypatch.undo()
    with simulated_versions({"torchao": version}):
        assert backend.fingerprint(model) != key
    assert backend.fingerprint(model) == key


# --- expressible changes and refusals --------------------------------------------------------------------


def test_drawable_config_fields_follow_the_declared_paths():
    assert drawable_config_fields(None) == tuple(CONFIG_FIELDS)
    assert drawable_config_fields(frozenset()) == ()
    assert drawable_config_fields({"pad_inner_dim"}) == ("pad_inner_dim",)
    # Paired fields flip together, so both must be expressible.
    assert "input target_dtype" not in drawable_config_fields({"cast_config_input.target_dtype"})
    both = {"cast_config_input.target_dtype", "cast_config_input_for_grad_weight.target_dtype"}
    assert drawable_config_fields(both) == ("input target_dtype",)


@settings(max_examples=10, database=None)
@given(change=quantization_changes("config_field", fields=("pad_inner_dim",)))
def test_config_changes_flip_only_the_expressible_fields(change):
    assert [name for _, name in change.after.config_fields] == ["pad_inner_dim"]


def test_makefx_refuses_a_config_that_is_none_of_the_named_recipes():
    backend = MakeFxBackend()
    named, _ = Variant(SPEC).build()
    backend.fingerprint(named)
    custom, _ = Variant(SPEC, config_fields=((0, "pad_inner_dim"),)).build()
    for method in (backend.fingerprint, backend.quantization_signature):
        with pytest.raises(UnsupportedConfig, match="layers.0"):
            method(custom)


def test_a_refused_inexpressible_change_is_not_supported_never_a_failure(tmp_path):
    statuses, out = run_suite("mutants.contract:RefusesCustomConfigs", ["FPR-001", "FPR-005"], tmp_path)
    # FPR-001 also enumerates every field, every recipe change and emulate flip, every version change.
    for property_id, passed, refused in (("FPR-001", 9, 3), ("FPR-005", 7, 2)):
        row = statuses[property_id]
        assert row["status"] == "pass", out[-3000:]
        assert row["outcomes"] == {"pass": passed, "not_supported": refused}, row
        assert any("UnsupportedConfig" in note for note in row.get("notes", ())), row


def test_a_refused_undeclared_field_leaves_the_declared_ones_checked(tmp_path):
    # Its jobs express pad_inner_dim: other fields' changes are refused (a right answer, noted),
    # and the changes of pad_inner_dim are still drawn and checked, so FPR-001 passes, not skips.
    statuses, out = run_suite("mutants.contract:ExpressesPadInnerDimOnly", ["FPR-001"], tmp_path)
    row = statuses["FPR-001"]
    assert row["status"] == "pass", out[-3000:]
    assert row["outcomes"] == {"pass": 12}, row  # nine drawn kinds and the enumerations of every field, every recipe and every version
    assert any("expressible_config_fields ['pad_inner_dim']" in note for note in row.get("notes", ())), row
