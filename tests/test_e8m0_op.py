"""Tests of ``fp8conf::scaled_mm_e8m0``: numerics against a float64 reference, the E8M0 edge bytes,
opcheck, ``torch.compile`` on CPU Inductor, argument errors, cuBLAS's scale layout, and CUDA runs
(marked ``fp8_gpu`` / ``fp8_sm100``; they skip without a device).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8conf.quantized.ops.e8m0 import (
    MXArgumentError,
    e8m0_to_float32,
    scaled_mm_e8m0,
    to_cublas_blocked,
    uses_cublas,
)

OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
E4M3 = torch.float8_e4m3fn

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
requires_sm100 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (10, 0),
    reason="needs a CUDA device of compute capability >= 10.0 (cuBLAS MX kernels)",
)


# --- helpers --------------------------------------------------------------------------------------


def _pow2_table() -> torch.Tensor:
    """2**(b - 127) for every byte in float64 (where 2**-127 is a normal number), NaN for 255."""
    return torch.tensor([2.0 ** (b - 127) for b in range(255)] + [math.nan], dtype=torch.float64)


def reference_mm(a, b, a_scale, b_scale):
    """Straightforward dequantize-then-matmul in float64; also returns |A| @ |B| for tolerances."""
    table = _pow2_table()
    sa = table[a_scale.cpu().long()].repeat_interleave(32, dim=1)  # (M, K)
    sb = table[b_scale.cpu().long()].repeat_interleave(32, dim=1).t()  # (K, N)
    a_hp = a.cpu().to(torch.float64) * sa
    b_hp = b.cpu().to(torch.float64) * sb
    return a_hp @ b_hp, a_hp.abs() @ b_hp.abs()


def assert_matches_reference(out, a, b, a_scale, b_scale):
    """Within float32 accumulation error plus one rounding to ``out``'s dtype."""
    ref, abs_prod = reference_mm(a, b, a_scale, b_scale)
    finfo = torch.finfo(out.dtype)
    got = out.cpu().to(torch.float64)
    tol = finfo.eps * ref.abs() + 1e-5 * abs_prod + finfo.tiny * finfo.eps
    assert torch.equal(got.isnan(), ref.isnan())
    err = (got - ref).abs().nan_to_num(0.0)
    assert bool((err <= tol.nan_to_num(0.0)).all()), f"max excess {(err - tol).max().item()}"


def make_operands(m, k, n, *, seed=0, byte_range=(120, 135), device="cpu"):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g).to(E4M3)
    b = torch.randn(k, n, generator=g).to(E4M3)
    lo, hi = byte_range
    a_scale = torch.randint(lo, hi + 1, (m, k // 32), generator=g, dtype=torch.uint8)
    b_scale = torch.randint(lo, hi + 1, (n, k // 32), generator=g, dtype=torch.uint8)
    return tuple(t.to(device) for t in (a, b, a_scale, b_scale))


def _single_block(a_value, a_byte, b_byte, out_dtype=torch.float32, device="cpu"):
    """1 x 32 @ 32 x 1 with a[0, 0] = a_value, b[0, 0] = 1 and zeros elsewhere."""
    a = torch.zeros(1, 32)
    a[0, 0] = a_value
    b = torch.zeros(32, 1)
    b[0, 0] = 1.0
    a_scale = torch.tensor([[a_byte]], dtype=torch.uint8)
    b_scale = torch.tensor([[b_byte]], dtype=torch.uint8)
    args = (a.to(E4M3), b.to(E4M3), a_scale, b_scale)
    return scaled_mm_e8m0(*(t.to(device) for t in args), out_dtype=out_dtype)


# --- E8M0 decoding ----------------------------------------------------------------------------------


def test_e8m0_to_float32_every_byte():
    got = e8m0_to_float32(torch.arange(256, dtype=torch.int32).to(torch.uint8))
    assert got.dtype == torch.float32
    assert torch.equal(got[:255], _pow2_table()[:255].to(torch.float32))
    assert got[255].isnan()
    # byte 0 is the float32 subnormal 2**-127, not flushed
    assert got[0].item() == 2.0**-127 and 0 < got[0].item() < torch.finfo(torch.float32).tiny
    assert got[1].item() == torch.finfo(torch.float32).tiny  # 2**-126
    assert got[127].item() == 1.0 and got[254].item() == 2.0**127
    # agrees with torch's own e8m0 -> float32 conversion (255 is NaN in both)
    torch_view = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e8m0fnu).float()
    assert torch.equal(torch_view[:255], got[:255]) and torch_view[255].isnan()


# --- numerics ---------------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    m=st.integers(1, 40),
    k_blocks=st.integers(1, 4),
    n=st.integers(1, 40),
    out_dtype=st.sampled_from(OUT_DTYPES),
    seed=st.integers(0, 2**16),
)
def test_matches_reference_random_shapes(m, k_blocks, n, out_dtype, seed):
    # fp16 overflows/underflows outside a narrow scale range; fp32/bf16 take the wide range.
    byte_range = (123, 130) if out_dtype is torch.float16 else (90, 160)
    a, b, a_scale, b_scale = make_operands(m, 32 * k_blocks, n, seed=seed, byte_range=byte_range)
    out = scaled_mm_e8m0(a, b, a_scale, b_scale, out_dtype=out_dtype)
    assert out.shape == (m, n) and out.dtype == out_dtype
    assert_matches_reference(out, a, b, a_scale, b_scale)


def test_transposed_b_operand():
    a, b, a_scale, b_scale = make_operands(16, 96, 24, seed=3)
    b_t_view = b.t().contiguous().t()  # column-major (K, N), as weight_fp8.t() would be
    out = scaled_mm_e8m0(a, b_t_view, a_scale, b_scale, out_dtype=torch.float32)
    assert torch.equal(out, scaled_mm_e8m0(a, b, a_scale, b_scale, out_dtype=torch.float32))


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_byte_255_poisons_every_output_using_the_block(out_dtype):
    a, b, a_scale, b_scale = make_operands(6, 64, 40, seed=1, byte_range=(126, 128))
    a_scale[1, 0] = 255
    a = a.float()
    a[1, :32] = 0.0  # NaN * 0 is still NaN: the poisoned block's values do not matter
    a = a.to(E4M3)
    b_scale[5, 1] = 255
    out = scaled_mm_e8m0(a, b, a_scale, b_scale, out_dtype=out_dtype)
    expected_nan = torch.zeros(6, 40, dtype=torch.bool)
    expected_nan[1, :] = True
    expected_nan[:, 5] = True
    assert torch.equal(out.isnan(), expected_nan)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_byte_0_is_2_pow_minus_127_never_zero(out_dtype):
    out = _single_block(448.0, a_byte=0, b_byte=127, out_dtype=out_dtype)
    # 448 * 2**-127 = 1.75 * 2**-119: normal in float32 and bfloat16, so exactly representable
    assert out.item() == 448.0 * 2.0**-127 > 0.0


def test_byte_0_survives_flush_denormal():
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        out = _single_block(448.0, a_byte=0, b_byte=127)
    finally:
        torch.set_flush_denormal(False)
    assert out.item() == 448.0 * 2.0**-127


def test_byte_1_and_byte_127():
    assert _single_block(1.0, a_byte=1, b_byte=127).item() == 2.0**-126
    a, b, _, _ = make_operands(8, 64, 16, seed=2)
    ones_a = torch.full((8, 2), 127, dtype=torch.uint8)
    ones_b = torch.full((16, 2), 127, dtype=torch.uint8)
    out = scaled_mm_e8m0(a, b, ones_a, ones_b, out_dtype=torch.float32)
    assert torch.equal(out, a.float() @ b.float())


@pytest.mark.parametrize("big, small", [(254, 0), (253, 1)])
def test_extreme_bytes_cancel(big, small):
    # 2**127 * 2**-127 and 2**126 * 2**-126 are exactly 1: the extremes neither overflow nor flush.
    g = torch.Generator().manual_seed(4)
    a = (torch.rand(8, 64, generator=g) * 2 - 1).to(E4M3)  # |a| <= 1, so a * 2**127 is finite
    b = torch.randn(64, 16, generator=g).to(E4M3)
    a_scale = torch.full((8, 2), big, dtype=torch.uint8)
    b_scale = torch.full((16, 2), small, dtype=torch.uint8)
    out = scaled_mm_e8m0(a, b, a_scale, b_scale, out_dtype=torch.float32)
    assert torch.equal(out, a.float() @ b.float())


# --- registration -----------------------------------------------------------------------------------


def _allclose_fp8_as_bytes(original):
    # opcheck's test_schema checks inputs for mutation with torch.allclose, which CPU torch does
    # not implement for float8 ("mul_cpu_reduced_float"); for a mutation check, equal bytes is
    # the intended meaning, so compare float8 tensors bit for bit and defer the rest.
    def allclose(lhs, rhs, *args, **kwargs):
        if lhs.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            return torch.equal(lhs.view(torch.uint8), rhs.view(torch.uint8))
        return original(lhs, rhs, *args, **kwargs)

    return allclose


@pytest.mark.parametrize("m, k, n, out_dtype", [(32, 64, 32, torch.bfloat16), (5, 96, 17, torch.float32)])
def test_opcheck(m, k, n, out_dtype, monkeypatch):
    a, b, a_scale, b_scale = make_operands(m, k, n, seed=5)
    monkeypatch.setattr(torch, "allclose", _allclose_fp8_as_bytes(torch.allclose))
    results = torch.library.opcheck(
        torch.ops.fp8conf.scaled_mm_e8m0.default, (a, b, a_scale, b_scale, out_dtype)
    )
    assert set(results.values()) == {"SUCCESS"} and len(results) == 4


def test_fake_kernel_shape_dtype_device():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a = torch.empty(48, 64, dtype=E4M3)
        b = torch.empty(64, 80, dtype=E4M3)
        out = scaled_mm_e8m0(
            a, b, torch.empty(48, 2, dtype=torch.uint8), torch.empty(80, 2, dtype=torch.uint8), torch.float16
        )
        assert out.shape == (48, 80) and out.dtype == torch.float16 and out.device == a.device


def _op_in_a_graph(a, b, a_scale, b_scale):
    return torch.relu(scaled_mm_e8m0(a, b, a_scale, b_scale, out_dtype=torch.float32) * 2.0 + 1.0)


def test_compile_inductor_fullgraph_matches_eager():
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    args = make_operands(64, 128, 48, seed=6, byte_range=(100, 150))
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(_op_in_a_graph, backend=counter, fullgraph=True)
    out, sources = run_and_get_code(compiled, *args)
    assert counter.frame_count == 1  # one graph: no graph break
    torch.testing.assert_close(out, _op_in_a_graph(*args), rtol=0, atol=0)
    code = "\n".join(sources)
    # one opaque extern call; e8m0 never reaches the generated code
    assert code.count("torch.ops.fp8conf.scaled_mm_e8m0.default(") == 1
    assert "e8m0fnu" not in code and "Float8_e8m0" not in code


def test_no_graph_break():
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(_op_in_a_graph)(*make_operands(32, 64, 32, seed=7))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


# --- argument errors --------------------------------------------------------------------------------


def _bad_args(case):
    a, b, a_scale, b_scale = make_operands(4, 64, 16, seed=8)
    out_dtype = torch.bfloat16
    if case == "a_float32":
        a = a.float()
    elif case == "b_bfloat16":
        b = b.to(torch.bfloat16)
    elif case == "a_e5m2":
        a = a.float().to(torch.float8_e5m2)
    elif case == "a_3d":
        a = a.unsqueeze(0)
    elif case == "k_mismatch":
        b = torch.zeros(96, 16).to(E4M3)
    elif case == "k_not_multiple_of_32":
        a, b = torch.zeros(4, 48).to(E4M3), torch.zeros(48, 16).to(E4M3)
        a_scale, b_scale = a_scale[:, :1], b_scale[:, :1]
    elif case == "a_scale_float":
        a_scale = a_scale.float()
    elif case == "a_scale_shape":
        a_scale = torch.full((4, 3), 127, dtype=torch.uint8)
    elif case == "b_scale_transposed":
        b_scale = b_scale.t()
    elif case == "b_scale_int8":
        b_scale = b_scale.to(torch.int8)
    elif case == "out_float8":
        out_dtype = E4M3
    elif case == "out_int32":
        out_dtype = torch.int32
    elif case == "out_not_dtype":
        out_dtype = "bfloat16"
    return a, b, a_scale, b_scale, out_dtype


ERROR_CASES = [
    ("a_float32", "a", "float8_e4m3fn"),
    ("b_bfloat16", "b", "float8_e4m3fn"),
    ("a_e5m2", "a", "float8_e4m3fn"),
    ("a_3d", "a", "2-D"),
    ("k_mismatch", "b", "rows"),
    ("k_not_multiple_of_32", "a", "multiple of 32"),
    ("a_scale_float", "a_scale", "uint8"),
    ("a_scale_shape", "a_scale", r"shape \(4, 2\)"),
    ("b_scale_transposed", "b_scale", r"shape \(16, 2\)"),
    ("b_scale_int8", "b_scale", "uint8"),
    ("out_float8", "out_dtype", "one of"),
    ("out_int32", "out_dtype", "one of"),
    ("out_not_dtype", "out_dtype", "torch.dtype"),
]


@pytest.mark.parametrize("case, argument, detail", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_errors_name_the_argument(case, argument, detail):
    with pytest.raises(ValueError, match=detail) as info:
        scaled_mm_e8m0(*_bad_args(case))
    assert isinstance(info.value, MXArgumentError)
    assert info.value.argument == argument
    assert f"argument `{argument}`" in str(info.value)


@pytest.mark.parametrize("which", ["a_scale", "b_scale", "both"])
def test_e8m0_scales_are_read_as_their_bytes(which):
    """float8_e8m0fnu scales are views of the same bytes (bytes 0 and 255 included), never values."""
    torch.manual_seed(5)
    a = (torch.randn(16, 64) * 50).to(E4M3)
    b = (torch.randn(64, 16) * 50).to(E4M3)
    a_scale = torch.tensor([0, 1, 127, 255] * 8, dtype=torch.uint8).reshape(16, 2)
    b_scale = torch.tensor([120, 127, 134, 140] * 8, dtype=torch.uint8).reshape(16, 2)
    expected = scaled_mm_e8m0(a, b, a_scale, b_scale, torch.float32)
    a_in = a_scale.view(torch.float8_e8m0fnu) if which in ("a_scale", "both") else a_scale
    b_in = b_scale.view(torch.float8_e8m0fnu) if which in ("b_scale", "both") else b_scale
    out = scaled_mm_e8m0(a, b, a_in, b_in, torch.float32)
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)
    assert expected.isnan().any() and (expected[0] != 0).any()


def test_errors_fire_under_compile():
    torch._dynamo.reset()
    a, b, a_scale, b_scale, _ = _bad_args("a_scale_shape")
    compiled = torch.compile(_op_in_a_graph, backend="inductor", fullgraph=True)
    # Dynamo wraps the fake kernel's error in its TorchRuntimeError, keeping the message.
    with pytest.raises(Exception, match=r"argument `a_scale` must have shape \(4, 2\)"):
        compiled(a, b, a_scale, b_scale)


# --- cuBLAS scale layout (pure tensor code: checked on CPU) -----------------------------------------


def _cublas_offset(r, c, cols):
    """Byte offset of scale (r, c) in cuBLAS's block-scaling layout, from its documented tiling."""
    tiles_per_row = -(-cols // 4)
    tile = (r // 128) * tiles_per_row + c // 4
    return tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


@pytest.mark.parametrize("rows, cols", [(1, 1), (128, 4), (130, 5), (256, 8), (33, 12)])
def test_to_cublas_blocked_layout(rows, cols):
    scale = torch.randint(0, 255, (rows, cols), dtype=torch.uint8, generator=torch.Generator().manual_seed(9))
    blocked = to_cublas_blocked(scale)
    padded_size = (-(-rows // 128) * 128) * (-(-cols // 4) * 4)
    assert blocked.shape == (padded_size,) and blocked.dtype == torch.uint8
    expected = torch.zeros(padded_size, dtype=torch.uint8)
    for r in range(rows):
        for c in range(cols):
            expected[_cublas_offset(r, c, cols)] = scale[r, c]
    assert torch.equal(blocked, expected)


def test_to_cublas_blocked_matches_torchao():
    # torchao.prototype.mx_formats needs numpy, which not every environment has
    pytest.importorskip("numpy", reason="torchao.prototype.mx_formats imports numpy")
    to_blocked = pytest.importorskip("torchao.prototype.mx_formats.utils").to_blocked

    scale = torch.randint(0, 255, (200, 7), dtype=torch.uint8, generator=torch.Generator().manual_seed(10))
    assert torch.equal(to_cublas_blocked(scale), to_blocked(scale))


# --- CUDA -------------------------------------------------------------------------------------------


@pytest.mark.fp8_gpu
@requires_cuda
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("m, k, n", [(1, 32, 16), (130, 160, 48), (256, 512, 128), (7, 64, 9)])
def test_cuda_matches_reference(m, k, n, out_dtype):
    byte_range = (123, 130) if out_dtype is torch.float16 else (100, 150)
    args = make_operands(m, k, n, seed=11, byte_range=byte_range, device="cuda")
    out = scaled_mm_e8m0(*args, out_dtype=out_dtype)
    assert out.device.type == "cuda" and out.dtype == out_dtype
    assert_matches_reference(out, *args)


@pytest.mark.fp8_gpu
@requires_cuda
def test_cuda_special_bytes():
    out = _single_block(448.0, a_byte=0, b_byte=127, out_dtype=torch.bfloat16, device="cuda")
    assert out.item() == 448.0 * 2.0**-127
    a, b, a_scale, b_scale = make_operands(128, 64, 32, seed=12, device="cuda")
    a_scale[3, 1] = 255
    b_scale[7, 0] = 255
    nan = scaled_mm_e8m0(a, b, a_scale, b_scale, out_dtype=torch.bfloat16).isnan()
    assert nan[3].all() and nan[:, 7].all() and int(nan.sum()) == 32 + 128 - 1


@pytest.mark.fp8_gpu
@requires_cuda
def test_cuda_below_sm100_uses_emulation():
    if torch.cuda.get_device_capability() >= (10, 0):
        pytest.skip("device has cuBLAS MX kernels")
    a, b, _, _ = make_operands(32, 64, 32, device="cuda")
    assert not uses_cublas(a, b, torch.bfloat16)


@pytest.mark.fp8_gpu
@pytest.mark.fp8_sm100
@requires_sm100
@pytest.mark.parametrize("m, k, n", [(1, 32, 16), (130, 160, 48), (256, 512, 128), (1025, 128, 96)])
def test_sm100_cublas_matches_emulation(m, k, n):
    from fp8conf.quantized.ops.e8m0 import emulated_scaled_mm_e8m0

    args = make_operands(m, k, n, seed=13, byte_range=(100, 150), device="cuda")
    assert uses_cublas(args[0], args[1], torch.bfloat16)
    out = scaled_mm_e8m0(*args, out_dtype=torch.bfloat16)
    assert_matches_reference(out, *args)
    emulated = emulated_scaled_mm_e8m0(*args, out_dtype=torch.float32)
    torch.testing.assert_close(out.float(), emulated, rtol=2**-7, atol=1e-5 * float(emulated.abs().max()))
