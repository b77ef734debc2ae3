"""fp8conf's NVFP4 linear (``fp8conf.quantized.nvfp4``) and the suite's reading of NVFP4 matmuls
(``conformance.judge.block_scaled``): quantization, the swizzled layout (two independent implementations
checked against each other and against torch's Meta kernel), conversion, and the passes on traced
NVFP4 graphs, all on CPU, where torch has no NVFP4 kernel but traces them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fp8conf
from conformance.judge import block_scaled as suite
from fp8conf.errors import NVFP4ConversionError
from fp8conf.quantized.nvfp4 import (
    NVFP4Linear, convert_to_nvfp4_training, from_nvfp4, has_nvfp4, swizzle_block_scales, swizzled_scales_numel, to_nvfp4,
)

pytestmark = pytest.mark.skipif(not has_nvfp4(), reason=f"torch {torch.__version__} has no float4_e2m1fn_x2 or F.scaled_mm")


def _block(dim: int = 64):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(dim, 32), nn.ReLU(), nn.Linear(32, dim, bias=False), nn.Linear(dim, 32))


def test_values_on_the_e2m1_grid_round_trip_exactly_and_pack_the_first_element_low():
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    x = torch.cat([grid, -grid.flip(0)]).repeat(3, 2) * 2.0**-3  # every block's amax is 6 * 2**-3
    packed, block, glob = to_nvfp4(x)
    assert packed.dtype == torch.float4_e2m1fn_x2 and tuple(packed.shape) == (3, 16)
    assert torch.equal(from_nvfp4(packed, block, glob), x)
    # 0.5 * 2**-3 then 0.0: codes 1 (low nibble) and 0 (high nibble) -> byte 0x01 after the first byte's (0, 0.5).
    assert packed.view(torch.uint8)[0, 0].item() == (1 << 4) | 0


def test_elements_round_to_the_nearest_e2m1_value_of_their_block_scale():
    x = torch.tensor([[6.0, 2.6, 2.4, -0.7, 0.2] + [0.0] * 11])
    values = from_nvfp4(*to_nvfp4(x))
    assert values[0, :5].tolist() == [6.0, 3.0, 2.0, -0.5, 0.0]


def test_an_all_zero_tensor_quantizes_to_zeros_with_a_unit_global_scale():
    packed, block, glob = to_nvfp4(torch.zeros(4, 32))
    assert glob.item() == 1.0 and not from_nvfp4(packed, block, glob).any()


@pytest.mark.parametrize("rows,k", [(16, 32), (130, 96), (1, 16), (257, 160)])
def test_the_suite_reads_fp8conf_s_and_makefx_s_swizzled_scales_back_as_they_were(rows, k):
    # Three implementations of the layout written apart: fp8conf's (permuting tiles), makefx's
    # (index arithmetic) and the suite's reading of it.
    from conformance.backends.makefx_linear import _swizzled

    torch.manual_seed(rows)
    block = torch.rand(rows, k // 16).mul(400).add(0.1).to(torch.float8_e4m3fn)
    swizzled = swizzle_block_scales(block)
    assert swizzled.numel() == swizzled_scales_numel(rows, k) == suite.block_scales_numel(rows, k)
    assert torch.equal(suite.unswizzle(swizzled.float(), rows, k), block.float())
    assert torch.equal(_swizzled(block).view(torch.uint8), swizzled.view(torch.uint8))


def test_torchs_meta_kernel_takes_the_swizzled_size_and_refuses_another():
    fn = torch.nn.functional
    recipes = [fn.ScalingType.BlockWise1x16, fn.ScalingType.TensorWise]
    swizzles = [fn.SwizzleType.SWIZZLE_32_4_4, fn.SwizzleType.NO_SWIZZLE]
    with torch.device("meta"):
        a = torch.empty(48, 32, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)  # 48 rows, K = 64
        one = torch.empty((), dtype=torch.float32)

        def run(numel):
            scales = torch.empty(numel, dtype=torch.uint8).view(torch.float8_e4m3fn)
            return fn.scaled_mm(a, a.t(), [scales, one], recipes, [scales, one], recipes, swizzle_a=swizzles,
                                swizzle_b=swizzles, output_dtype=torch.bfloat16)

        assert run(suite.block_scales_numel(48, 64)).shape == (48, 48)
        with pytest.raises(RuntimeError):
            run(48 * 4)


def test_conversion_keeps_parameters_and_refuses_unaligned_linears_leaving_the_model_unchanged():
    model = _block()
    weight = model[0].weight
    convert_to_nvfp4_training(model, module_filter_fn=lambda m, fqn: fqn != "3")
    assert isinstance(model[0], NVFP4Linear) and model[0].weight is weight and type(model[3]) is nn.Linear
    assert fp8conf.find_quantized_modules(model)["0"].kind == "nvfp4_linear"
    odd = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 48))
    with pytest.raises(NVFP4ConversionError, match="'1' has out_features=48 not a multiple of 32") as info:
        convert_to_nvfp4_training(odd)
    assert info.value.module_fqn == "1" and all(type(m) is nn.Linear for m in odd)
    with pytest.raises(NVFP4ConversionError, match="recipe must be one of"):
        convert_to_nvfp4_training(_block(), recipe="nvfp8")


def test_the_passes_trace_attribute_count_and_split_nvfp4_matmuls_on_cpu():
    model = _block()
    convert_to_nvfp4_training(model, module_filter_fn=lambda m, fqn: fqn != "3")
    x = torch.randn(8, 64, requires_grad=True)
    gm = fp8conf.trace_joint(model, (x,))
    matmuls = [n for n in gm.graph.nodes if suite.matmul_format(n) is suite.NVFP4]
    assert len(matmuls) == 6 and all(not suite.layout_problems(n, suite.NVFP4) for n in matmuls)
    kinds = {(fp8conf.get_provenance(n).module_fqn, fp8conf.get_provenance(n).kind) for n in matmuls}
    assert kinds == {("0", "nvfp4_linear"), ("2", "nvfp4_linear")}
    report = fp8conf.validate_fp8_graph(gm, strict=True)
    assert report.compute_counts == {("0", "forward"): 1, ("0", "backward"): 2, ("2", "forward"): 1, ("2", "backward"): 2}
    split = fp8conf.split_stage(gm, strict=True)
    pieces = [split.forward, split.backward_input, split.backward_weight]
    assert [sum(suite.matmul_format(n) is suite.NVFP4 for n in p.graph.nodes) for p in pieces] == [2, 2, 2]


def test_the_emulated_recipe_computes_what_the_suite_reads_the_real_one_to_compute():
    real, emulated = _block(), _block()
    convert_to_nvfp4_training(real)
    convert_to_nvfp4_training(emulated, recipe="nvfp4_emulated")
    x = torch.randn(8, 64)
    grad_out = torch.randn(8, 32)
    steps = []
    for model, reading in ((real, suite.read_by_the_suite()), (emulated, None)):
        inp = x.clone().requires_grad_(True)
        if reading is not None:
            with reading as reads:
                out = model(inp)
                out.backward(grad_out)
            assert reads.count["NVFP4"] == reads.computed == 9  # 3 linears: forward, grad_input, grad_weight each
            assert max(o.error for o in reads.operands) < 0.15
        else:
            out = model(inp)
            out.backward(grad_out)
        steps.append((out.detach(), inp.grad, model[0].weight.grad))
    for got, want in zip(*steps):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_real_recipe_does_not_run_on_cpu_outside_the_suites_reading():
    model = _block()
    convert_to_nvfp4_training(model)
    with pytest.raises((RuntimeError, ValueError, NotImplementedError)):
        model(torch.randn(4, 64))


def test_a_compile_inductor_refuses_names_the_op_or_the_region():
    # Torch 2.13's Inductor does not lower _scaled_mm_v2 with swizzled scales: fp8conf's errors
    # say where, instead of Inductor's own from deep inside a full compile.
    model = _block()
    convert_to_nvfp4_training(model)
    gm = fp8conf.trace_joint(model, (torch.randn(8, 64, requires_grad=True),))
    try:
        fp8conf.compile_joint(gm, mode="full")
    except fp8conf.GraphCompileError as exc:
        assert exc.target == "aten._scaled_mm_v2.default" and exc.node_name.startswith("_scaled_mm_v2"), exc
        assert "mode='regional'" in str(exc)
    else:
        pytest.skip("this torch's Inductor compiles NVFP4 matmuls")
    with pytest.raises(fp8conf.RegionCompileError) as info:
        fp8conf.compile_joint(gm, mode="regional", strict=True, remainder="eager")
    assert info.value.module_fqn in {"0", "2", "3"}
