"""The second scaled-matmul API (``F.scaled_mm`` -> ``aten._scaled_mm_v2``, and the grouped one)
is FP8 compute like the first, its scales read from the ``scale_a`` / ``scale_b`` lists.

The graphs are traced from real calls of ``F.scaled_mm`` (tensorwise, which CPU runs); regions
are grown with a provenance given here, as a trainer with its own provenance gives it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import fp8conf
from conformance.draw.strategies import SCALED_MM_KIND, runnable_kinds
from fp8conf.graph.roles import OpRole, scale_operands

E4M3 = torch.float8_e4m3fn

# make_fx runs the step on real CPU tensors.
pytestmark = pytest.mark.skipif(
    SCALED_MM_KIND not in runnable_kinds(),
    reason=f"torch {torch.__version__} runs no F.scaled_mm on CPU (torch 2.11 has it with a CUDA kernel only)",
)


def _quantize(x):
    scale = torch.finfo(E4M3).max / x.abs().amax().clamp(min=1e-12).float()
    return (x * scale).clamp(-448, 448).to(E4M3), scale.reciprocal()


def _step(x, w):
    qx, sx = _quantize(x)
    qw, sw = _quantize(w)
    return F.scaled_mm(qx, qw.t(), sx, F.ScalingType.TensorWise, sw, F.ScalingType.TensorWise, output_dtype=torch.float32)


@dataclasses.dataclass(frozen=True)
class _Owner:
    module_fqn: str
    call: int = 0


def _traced():
    x, w = torch.randn(16, 32), torch.randn(16, 32)
    gm = make_fx(_step)(x, w)
    (mm,) = [n for n in gm.graph.nodes if n.op == "call_function" and "scaled_mm_v2" in str(n.target)]
    return gm, mm, (x, w)


def test_a_v2_scaled_matmul_of_fp8_operands_is_fp8_compute_and_reads_both_scale_lists():
    gm, mm, (x, w) = _traced()
    assert fp8conf.is_fp8_compute(mm)
    assert len(scale_operands(mm)) == 2 and all(isinstance(s, torch.fx.Node) for s in scale_operands(mm))
    roles = fp8conf.op_roles(gm.graph)
    assert any(role is OpRole.SCALE for role in roles.values())
    torch.testing.assert_close(gm(x, w), _step(x, w))


def test_a_v2_region_holds_its_scales_and_is_incomplete_when_one_is_made_elsewhere():
    gm, mm, _ = _traced()
    passes = {n: "forward" for n in gm.graph.nodes}
    owner = _Owner("linear")
    (region,) = fp8conf.identify_fp8_regions(gm, provenance_of=lambda n: owner if n.op == "call_function" else None, passes=passes)
    assert region.complete, region.reason
    assert set(scale_operands(mm)) <= set(region.nodes)
    # The scale of the first operand computed by another module: the region lacks part of its chain.
    outside = set(scale_operands(mm)[0].all_input_nodes) | {scale_operands(mm)[0]}
    other = _Owner("elsewhere")
    provenance = lambda n: None if n.op != "call_function" else other if n in outside else owner
    (region,) = [r for r in fp8conf.identify_fp8_regions(gm, provenance_of=provenance, passes=passes) if r.compute_nodes]
    assert not region.complete and "scale" in region.reason, region.reason
