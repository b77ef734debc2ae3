"""Every scaled matmul torch has is low-precision compute when its two matrix operands are FP8 or
packed FP4, whatever the API: hand-built graphs, for the ops the CPU cannot trace (NVFP4 operands)
and the releases that lack them (the weight-gradient accumulation ``_scaled_addmm_``)."""

from __future__ import annotations

import pytest
import torch

import fp8conf
from fp8conf.graph.provenance import unattributed_fp8_compute
from fp8conf.graph.roles import compute_format, matrix_operands, op_roles, scale_operands

FP4 = getattr(torch, "float4_e2m1fn_x2", None)
E4M3, E8M0 = torch.float8_e4m3fn, getattr(torch, "float8_e8m0fnu", torch.uint8)


class _Named:
    """A call target named like an aten overload this torch lacks (fp8conf matches by name)."""

    def __init__(self, name: str):
        self.name = name
        self.__name__ = self.__qualname__ = name.rsplit(".", 2)[-2]

    def __call__(self, *args, **kwargs):  # never run: the graphs are only read
        raise NotImplementedError(self.name)

    def __str__(self) -> str:
        return self.name


def _graph(values: dict):
    graph = torch.fx.Graph()
    with torch._subclasses.FakeTensorMode():
        made = {name: make() for name, make in values.items()}
    nodes = {}
    for name, value in made.items():
        nodes[name] = graph.placeholder(name)
        nodes[name].meta["val"] = value
    return graph, nodes


@pytest.mark.skipif(FP4 is None, reason="this torch has no float4_e2m1fn_x2")
def test_packed_fp4_operands_with_e4m3_block_scales_are_float4_compute():
    graph, n = _graph({
        "a": lambda: torch.empty(32, 32, dtype=torch.uint8).view(FP4),
        "b": lambda: torch.empty(32, 32, dtype=torch.uint8).view(FP4),
        "sa": lambda: torch.empty(32, 4, dtype=E4M3),
        "sb": lambda: torch.empty(32, 4, dtype=E4M3),
        "g": lambda: torch.empty((), dtype=torch.float32),
    })
    mm = graph.call_function(torch.ops.aten._scaled_mm_v2.default, (n["a"], n["b"], [n["sa"], n["g"]], [4, 0], [0], [n["sb"], n["g"]], [4, 0], [0], None, torch.bfloat16))
    mm.meta["val"] = torch.empty(32, 32, dtype=torch.bfloat16, device="meta")
    assert fp8conf.is_fp8_compute(mm) and compute_format(mm) == "float4"
    assert fp8conf.classify_node(mm) is fp8conf.OpRole.COMPUTE
    assert fp8conf.classify_node(n["a"]) is fp8conf.OpRole.INPUT_BOUNDARY
    assert scale_operands(mm) == [n["sa"], n["g"], n["sb"], n["g"]]
    # Without provenance it is named like any FP8 compute (VAL-003), with its format.
    (finding,) = unattributed_fp8_compute(graph, {node: "forward" for node in graph.nodes})
    assert finding.property_id == "VAL-003" and "float4 operands" in finding.message


def test_the_weight_gradient_accumulation_reads_its_operands_after_the_accumulator():
    graph, n = _graph({
        "acc": lambda: torch.empty(16, 32, dtype=torch.bfloat16),
        "a": lambda: torch.empty(16, 64, dtype=E4M3),
        "b": lambda: torch.empty(64, 32, dtype=E4M3),
        "sa": lambda: torch.empty(16, 1),
        "sb": lambda: torch.empty(1, 32),
    })
    op = getattr(torch.ops.aten, "_scaled_addmm_", None)
    target = op.default if op is not None else _Named("aten._scaled_addmm_.default")
    fused = graph.call_function(target, (n["acc"], n["a"], n["b"], n["sa"], n["sb"]))
    assert matrix_operands(fused) == (n["a"], n["b"])
    assert fp8conf.is_fp8_compute(fused) and compute_format(fused) == "float8"
    assert scale_operands(fused) == [n["sa"], n["sb"]]
    # The accumulator is high precision and the operands FP8: read at the wrong positions (the
    # first API's), the op would be taken for high-precision compute and left out of every pass.
    assert op_roles(graph)[fused] is fp8conf.OpRole.COMPUTE


def test_mixed_or_high_precision_operands_are_not_low_precision_compute():
    graph, n = _graph({
        "a": lambda: torch.empty(16, 32, dtype=E4M3),
        "b": lambda: torch.empty(32, 16, dtype=torch.bfloat16),
        "s": lambda: torch.empty(()),
    })
    mm = graph.call_function(torch.ops.aten._scaled_mm.default, (n["a"], n["b"], n["s"], n["s"]))
    assert compute_format(mm) is None and not fp8conf.is_fp8_compute(mm)


def _trainer_scaled_addmm():
    """``fp8conf_tests::scaled_addmm_(acc, a, b, scale_a, scale_b)``: a trainer's own in-place
    weight-gradient accumulation, ``acc += (a * scale_a) @ (b * scale_b)``, defined once."""
    try:
        return torch.ops.fp8conf_tests.scaled_addmm_.default
    except (AttributeError, RuntimeError):
        pass

    @torch.library.custom_op("fp8conf_tests::scaled_addmm_", mutates_args=("acc",))
    def scaled_addmm_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor) -> None:
        acc.add_(((a.float() * scale_a) @ (b.float() * scale_b)).to(acc.dtype))

    return torch.ops.fp8conf_tests.scaled_addmm_.default


def test_a_trainers_own_op_is_compute_once_registered_and_the_suite_holds_it_to_its_declaration(monkeypatch):
    from conformance.api import TORCH_COMPUTE_OPS, ComputeOp
    from fp8conf.graph import roles

    # The registration is process-wide: made in copies of fp8conf's tables, dropped after the test.
    monkeypatch.setattr(roles, "_OPERANDS", dict(roles._OPERANDS))
    monkeypatch.setattr(roles, "_REGISTERED", dict(roles._REGISTERED))
    monkeypatch.setattr(roles, "_ENTRY_OF_TARGET", {})  # what it learns of the test's op goes with them
    from conformance.observe.graphs import Fp8Ops, declared_on_high_precision, is_fp8_compute, undeclared_low_precision_compute

    op = _trainer_scaled_addmm()
    graph, n = _graph({
        "acc": lambda: torch.empty(16, 32, dtype=torch.bfloat16),
        "a": lambda: torch.empty(16, 64, dtype=E4M3),
        "b": lambda: torch.empty(64, 32, dtype=E4M3),
        "sa": lambda: torch.empty(16, 1),
        "sb": lambda: torch.empty(1, 32),
        "ha": lambda: torch.empty(16, 64, dtype=torch.bfloat16),
    })
    fused = graph.call_function(op, (n["acc"], n["a"], n["b"], n["sa"], n["sb"]))
    fused.meta["val"] = torch.empty(16, 32, dtype=torch.bfloat16, device="meta")  # as a functionalized accumulation returns
    on_high = graph.call_function(op, (n["acc"], n["ha"], n["ha"], n["sa"], n["sb"]))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert not fp8conf.is_fp8_compute(fused)  # an op fp8conf does not know
    fp8conf.register_compute_op(torch.ops.fp8conf_tests.scaled_addmm_, operands=(1, 2), scales=((3, "scale_a"), (4, "scale_b")))
    assert fp8conf.is_fp8_compute(fused) and scale_operands(fused) == [n["sa"], n["sb"]]
    assert op_roles(graph)[fused] is fp8conf.OpRole.COMPUTE and not fp8conf.is_fp8_compute(on_high)
    # The suite finds the low-precision compute by dtypes whatever is declared; declared (by its
    # name, with the positions fp8conf was given), it is compute, and its call on high-precision
    # operands is named.
    assert undeclared_low_precision_compute(gm, Fp8Ops(TORCH_COMPUTE_OPS)) == [fused]
    declared = Fp8Ops(TORCH_COMPUTE_OPS + (ComputeOp("fp8conf_tests::scaled_addmm_", (1, 2), (3, 4)),))
    assert undeclared_low_precision_compute(gm, declared) == [] and is_fp8_compute(fused, declared)
    assert declared_on_high_precision(gm, declared) == [on_high]
    # The reference adapter declares what fp8conf was given.
    from conformance.backends.reference import ReferenceBackend

    assert ComputeOp(op, (1, 2), (3, 4)) in ReferenceBackend().fp8_compute_ops()
