"""No raw exception from the public API: every name in ``fp8conf.__all__`` meets bad input.

For each public function (and each public class's constructors) the table gives calls with one
argument wrong: of the wrong type, of the wrong shape, or lacking the metadata fp8conf needs.
Each must raise an :class:`fp8conf.FP8Error` (never an ``AttributeError``, ``IndexError`` or
an assertion from torch) whose message names the function or the argument. Names that take no
input (constants, the error tree, value types) are listed with the reason; a name in ``__all__``
that is in neither list fails the coverage test, so a new public function arrives with its row.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import fp8conf
from stack_steps import DIM, TOKENS, traced

#: Public names with no input to get wrong, and why.
NO_INPUT = {
    "PROVENANCE_META_KEY": "a constant",
    "OpRole": "an enum of role names",
    "JointSignature": "a value type that traced graphs carry; read with joint_signature(gm)",
    "TraceInfo": "a value type that traced graphs carry; read with trace_info(gm)",
    "Provenance": "a value type read from nodes with get_provenance(node)",
    "CallRecord": "a value type inside TraceInfo",
    "ValidationReport": "a value type validate_fp8_graph returns",
    "Finding": "a value type inside ValidationReport",
    "Region": "a value type identify_fp8_regions returns",
    "CompiledJoint": "a value type compile_joint returns",
    "StageSplit": "a value type split_stage returns",
    "PrecompiledJoint": "a value type load_artifact returns",
    "QuantizedModule": "a typing Protocol a module satisfies; nothing calls it with arguments",
    "CollectiveRecord": "a value type read from nodes with get_collective(node)",
    "WeightGatherReport": "a value type validate_weight_all_gathers returns",
}


def _model():
    model, _, _ = traced(1)
    return model


def _gm():
    return traced(1)[2]


def _x():
    return traced(1)[1]


def _grad():
    return torch.randn(TOKENS, DIM)


def _node():
    return next(iter(_gm().graph.nodes))


def _signature():
    return fp8conf.QuantizationSignature.from_model(_model())


def _untraced():
    """A graph with none of the metadata tracing records: no signature, no trace info, no meta."""
    return torch.fx.symbolic_trace(torch.nn.Linear(DIM, DIM))


#: name -> [(label, call)], each call with one argument wrong.
BAD_CALLS = {
    "find_quantized_modules": [("model=None", lambda: fp8conf.find_quantized_modules(None))],
    "QuantizationConfig": [("kind=''", lambda: fp8conf.QuantizationConfig("", "rowwise", False)),
                           ("emulate='no'", lambda: fp8conf.QuantizationConfig("k", "rowwise", "no")),
                           ("matmuls=0", lambda: fp8conf.QuantizationConfig("k", "rowwise", False, matmuls=0)),
                           ("settings=[1]", lambda: fp8conf.QuantizationConfig("k", "rowwise", False, settings=[1]))],
    "register_quantized_module": [("module_class=3", lambda: fp8conf.register_quantized_module(3, lambda m: None)),
                                  ("undotted name", lambda: fp8conf.register_quantized_module("Linear", lambda m: None)),
                                  ("describe=None", lambda: fp8conf.register_quantized_module(torch.nn.Linear, None))],
    "register_compute_op": [("op='mm'", lambda: fp8conf.register_compute_op("mm")),
                            ("operands=(1, 1)", lambda: fp8conf.register_compute_op(torch.ops.aten._scaled_mm.default, operands=(1, 1))),
                            ("scales=[3]", lambda: fp8conf.register_compute_op(torch.ops.aten._scaled_mm.default, scales=[3]))],
    "MXLinear": [("from_float(None)", lambda: fp8conf.MXLinear.from_float(None)),
                 ("from_float(Conv1d)", lambda: fp8conf.MXLinear.from_float(torch.nn.Conv1d(2, 2, 1)))],
    "convert_to_mx_training": [("model='x'", lambda: fp8conf.convert_to_mx_training("x"))],
    "ScaledMMLinear": [("from_float(None)", lambda: fp8conf.ScaledMMLinear.from_float(None)),
                       ("in_features=24", lambda: fp8conf.ScaledMMLinear(24, 16))],
    "convert_to_scaled_mm_training": [("model='x'", lambda: fp8conf.convert_to_scaled_mm_training("x"))],
    "NVFP4Linear": [("from_float(None)", lambda: fp8conf.NVFP4Linear.from_float(None)),
                    ("in_features=48", lambda: fp8conf.NVFP4Linear(48, 32)),
                    ("recipe='nvfp8'", lambda: fp8conf.NVFP4Linear(32, 32, recipe="nvfp8"))],
    "convert_to_nvfp4_training": [("model='x'", lambda: fp8conf.convert_to_nvfp4_training("x"))],
    "Float8GroupedExperts": [("weight=None", lambda: fp8conf.Float8GroupedExperts(None)),
                             ("weight 2-d", lambda: fp8conf.Float8GroupedExperts(torch.nn.Parameter(torch.randn(4, 4))))],
    "convert_to_float8_grouped_experts": [("model=3", lambda: fp8conf.convert_to_float8_grouped_experts(3))],
    "trace_joint": [("model=None", lambda: fp8conf.trace_joint(None, (_x(),))),
                    ("args of the wrong shape", lambda: fp8conf.trace_joint(_model(), (torch.randn(TOKENS, DIM + 3),)))],
    "run_joint": [("gm=model", lambda: fp8conf.run_joint(_model(), _model(), (_x(),), (_grad(),))),
                  ("model=None", lambda: fp8conf.run_joint(_gm(), None, (_x(),), (_grad(),))),
                  ("no grad_outputs", lambda: fp8conf.run_joint(_gm(), _model(), (_x(),), ())),
                  ("tangent float", lambda: fp8conf.run_joint(_gm(), _model(), (_x(),), (1.0,))),
                  ("tangent of the wrong shape", lambda: fp8conf.run_joint(_gm(), _model(), (_x(),), (torch.randn(2),))),
                  ("untraced gm", lambda: fp8conf.run_joint(_untraced(), _model(), (_x(),), (_grad(),)))],
    "joint_signature": [("gm=model", lambda: fp8conf.joint_signature(_model()))],
    "trace_info": [("gm=None", lambda: fp8conf.trace_info(None))],
    "copy_graph_module": [("gm=graph", lambda: fp8conf.copy_graph_module(_gm().graph))],
    "get_provenance": [("node=None", lambda: fp8conf.get_provenance(None))],
    "node_passes": [("graph=gm", lambda: fp8conf.node_passes(_gm()))],
    "classify_node": [("node='x'", lambda: fp8conf.classify_node("x"))],
    "is_fp8_compute": [("node=gm", lambda: fp8conf.is_fp8_compute(_gm()))],
    "op_roles": [("graph=None", lambda: fp8conf.op_roles(None))],
    "validate_fp8_graph": [("gm=model", lambda: fp8conf.validate_fp8_graph(_model())),
                           ("untraced gm", lambda: fp8conf.validate_fp8_graph(_untraced()))],
    "get_collective": [("node=None", lambda: fp8conf.get_collective(None))],
    "validate_weight_all_gathers": [("gm=model", lambda: fp8conf.validate_weight_all_gathers(_model())),
                                    ("unsharded gm, no setting", lambda: fp8conf.validate_weight_all_gathers(_gm()))],
    "identify_fp8_regions": [("gm=None", lambda: fp8conf.identify_fp8_regions(None))],
    "tag_fp8_regions": [("gm=model", lambda: fp8conf.tag_fp8_regions(_model()))],
    "compile_joint": [("gm=model", lambda: fp8conf.compile_joint(_model())),
                      ("mode='fast'", lambda: fp8conf.compile_joint(_gm(), mode="fast"))],
    "CompileConfig": [("mode='fast'", lambda: fp8conf.CompileConfig(mode="fast")),
                      ("workers=-1", lambda: fp8conf.CompileConfig(workers=-1)),
                      ("workers=2**70", lambda: fp8conf.CompileConfig(workers=2**70)),
                      ("unknown field", lambda: fp8conf.CompileConfig(bogus=1)),
                      ("unknown field in replace", lambda: __import__("dataclasses").replace(fp8conf.CompileConfig(), bogus=1)),
                      ("too many positional", lambda: fp8conf.CompileConfig(*["regional"] * 12)),
                      ("strict='yes'", lambda: fp8conf.CompileConfig(strict="yes")),
                      ("config and keywords", lambda: fp8conf.compile_joint(_gm(), fp8conf.CompileConfig(), mode="full")),
                      ("config of another type", lambda: fp8conf.compile_joint(_gm(), {"mode": "full"}))],
    "split_stage": [("gm=model", lambda: fp8conf.split_stage(_model())),
                    ("untraced gm", lambda: fp8conf.split_stage(_untraced()))],
    "compile_split": [("split=gm", lambda: fp8conf.compile_split(_gm()))],
    "QuantizationSignature": [("from_model(None)", lambda: fp8conf.QuantizationSignature.from_model(None)),
                              ("from_json('{')", lambda: fp8conf.QuantizationSignature.from_json("{"))],
    "precompile_joint": [("gm=None", lambda: fp8conf.precompile_joint(None))],
    "save_artifact": [("path=None", lambda: fp8conf.save_artifact(None, _gm(), _signature(), unsigned=True))],
    "load_artifact": [("path=None", lambda: fp8conf.load_artifact(None, _signature())),
                      ("expected_signature=None", lambda: fp8conf.load_artifact("a.fp8", None))],
    "read_header": [("path=None", lambda: fp8conf.read_header(None))],
    "precompile_model": [("path=3", lambda: fp8conf.precompile_model(3, _model(), (_x(),))),
                         ("model=None", lambda: fp8conf.precompile_model("a.fp8", None, (_x(),)))],
    "load_for_model": [("path=None", lambda: fp8conf.load_for_model(None, _model())),
                       ("model=None", lambda: fp8conf.load_for_model("a.fp8", None))],
}


def test_every_public_name_has_bad_inputs_or_a_reason_it_takes_none():
    errors = {name for name in fp8conf.__all__ if inspect.isclass(getattr(fp8conf, name)) and issubclass(getattr(fp8conf, name), BaseException)}
    missing = set(fp8conf.__all__) - errors - set(NO_INPUT) - set(BAD_CALLS)
    assert not missing, f"public names without a bad-input row: {sorted(missing)}"
    assert not (set(NO_INPUT) | set(BAD_CALLS)) - set(fp8conf.__all__), "rows for names no longer public"


@pytest.mark.parametrize("name, label, call", [(n, label, c) for n, calls in BAD_CALLS.items() for label, c in calls],
                         ids=[f"{n}-{label}" for n, calls in BAD_CALLS.items() for label, _ in calls])
def test_bad_input_raises_a_typed_error_naming_what(name, label, call, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the artifact rows name relative paths
    try:
        call()
    except fp8conf.FP8Error as exc:
        message = str(exc)
        assert message.strip(), f"{name}({label}): an empty message"
        return
    except Exception as exc:  # noqa: BLE001 - the point of the test
        pytest.fail(f"{name}({label}) raised a raw {type(exc).__name__}: {str(exc)[:300]}")
    pytest.fail(f"{name}({label}) accepted bad input")


@pytest.mark.parametrize("name, call, words", [
    ("compile_joint", lambda: fp8conf.compile_joint(_model()), ["compile_joint(gm=...)", "torch.fx.GraphModule", "got a BlockStack", "trace_joint"]),
    ("node_passes", lambda: fp8conf.node_passes(_gm()), ["node_passes(graph=...)", "gm.graph"]),
    ("load_artifact", lambda: fp8conf.load_artifact(None, _signature()), ["load_artifact(path=...)", "file path", "got None"]),
])
def test_a_wrong_type_names_the_function_the_argument_and_what_to_pass(name, call, words):
    with pytest.raises(fp8conf.FP8ConfigError) as caught:
        call()
    assert all(w in str(caught.value) for w in words), str(caught.value)


def test_one_compile_config_reaches_every_part_of_a_split():
    import dataclasses

    config = fp8conf.CompileConfig(mode="regional", remainder="eager")
    split = fp8conf.split_stage(_gm())
    fns = fp8conf.compile_split(split, config)
    assert {fn.mode for fn in fns.values()} == {"regional"}
    assert dataclasses.replace(config, mode="full").mode == "full"
    with pytest.raises(fp8conf.FP8ConfigError, match="not both"):
        fp8conf.compile_split(split, config, strict=False)


def test_a_field_the_mode_does_not_read_is_logged_when_compiling(caplog):
    import logging

    config = fp8conf.CompileConfig(mode="full", workers=1, remainder="eager", strict=False)
    assert config.ignored_by_mode() == ("remainder='eager'", "workers=1")
    assert fp8conf.CompileConfig(mode="regional", workers=1).ignored_by_mode() == ()
    graph = torch.fx.Graph()
    graph.output(())
    with caplog.at_level(logging.WARNING, logger="fp8conf"):
        fp8conf.compile_joint(torch.fx.GraphModule(torch.nn.Module(), graph), config)
    assert "compile_joint(mode='full') ignores remainder='eager', workers=1" in caplog.text
