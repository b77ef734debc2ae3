"""Tests of ``fp8conf.quantized.mx``: MX quantization, :class:`MXLinear` against ``nn.Linear``, the converter,
``torch.compile`` on CPU Inductor, and a record of how torchao's own emulated MXFP8 linear fares
under CPU Inductor. CUDA tests are marked ``fp8_gpu`` and skip without a device.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torchao
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fp8conf.quantized.mx import (
    RECIPES,
    SCALE_ROUNDINGS,
    MXArgumentError,
    MXConversionError,
    MXLinear,
    convert_to_mx_training,
    default_scale_dtype,
    from_mx,
    to_mx,
)
import fp8conf
from fp8conf import torch_internals

#: The recipes whose matmuls run on CPU and on sm90 (the swizzled one runs on sm100 only; its
#: tests below read it through the suite).
RUNNABLE = tuple(r for r in RECIPES if r != "mxfp8_swizzled")

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
E4M3 = torch.float8_e4m3fn


def _varied_blocks(rows=16, cols=256, seed=0):
    """Random data whose 32-element blocks span magnitudes 2**-40 .. 2**40."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols // 32, 32, generator=g)
    x = x * torch.exp2(torch.randint(-40, 41, (rows, cols // 32, 1), generator=g).float())
    return x.reshape(rows, cols)


def _reference_to_mx(x, scale_rounding):
    """OCP MX quantization written with float64 log2, independent of fp8conf's bit math."""
    blocks = x.to(torch.float64).reshape(*x.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    if scale_rounding == "floor":
        exponent = torch.floor(torch.log2(amax)) - 8
    else:
        exponent = torch.ceil(torch.log2(amax / 448.0))
    exponent = exponent.clamp(-127, 127)
    elements = (blocks / torch.exp2(exponent)).clamp(-448, 448).to(torch.float32).to(E4M3)
    return elements.reshape(x.shape), (exponent + 127).squeeze(-1).to(torch.uint8)


def _rel(got, ref):
    return float((got.float() - ref.float()).norm() / ref.float().norm())


# --- to_mx / from_mx --------------------------------------------------------------------------------


@pytest.mark.parametrize("scale_rounding", SCALE_ROUNDINGS)
def test_to_mx_matches_float64_reference(scale_rounding):
    x = _varied_blocks()
    elements, scales = to_mx(x, scale_rounding=scale_rounding)
    ref_elements, ref_scales = _reference_to_mx(x, scale_rounding)
    assert elements.dtype == E4M3 and scales.dtype == torch.uint8 and scales.shape == (16, 8)
    assert torch.equal(scales, ref_scales)
    assert torch.equal(elements.view(torch.uint8), ref_elements.view(torch.uint8))


def test_floor_saturates_where_rup_does_not():
    x = torch.zeros(1, 32)
    x[0, 0] = 480.0  # floor(log2(480)) = 8, so floor picks scale 1 and 480 clamps to 448
    floor_elements, floor_scales = to_mx(x, scale_rounding="floor")
    rup_elements, rup_scales = to_mx(x, scale_rounding="rup")
    assert floor_scales.item() == 127 and floor_elements.float()[0, 0].item() == 448.0
    assert rup_scales.item() == 128 and rup_elements.float()[0, 0].item() == 240.0
    x[0, 0] = 448.0  # exactly representable at scale 1: rup must not round up
    assert to_mx(x, scale_rounding="rup")[1].item() == 127


def test_rup_keeps_every_block_within_e4m3_range():
    x = _varied_blocks(seed=1)
    elements, scales = to_mx(x, scale_rounding="rup")
    amax = x.reshape(16, 8, 32).abs().amax(-1).double()
    scale = torch.exp2(scales.double() - 127)
    assert bool((amax / scale <= 448).all())
    # and it is the smallest such power of two
    assert bool((amax / (scale / 2) > 448).all())


def test_rup_dequantizes_within_e4m3_rounding():
    x = _varied_blocks(seed=2)
    elements, scales = to_mx(x, scale_rounding="rup")
    back = from_mx(elements, scales)
    scale = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=1)
    # e4m3: relative error <= 2**-4 for normals, absolute <= 2**-10 (in scale units) for subnormals
    assert bool(((back - x).abs() <= 2**-4 * x.abs() + 2**-10 * scale).all())


def test_zero_block_gets_byte_0_and_stays_zero():
    x = torch.randn(2, 64)
    x[1, 32:] = 0.0
    elements, scales = to_mx(x)
    assert scales[1, 1].item() == 0
    assert bool((elements.float()[1, 32:] == 0).all())
    assert bool((from_mx(elements, scales)[1, 32:] == 0).all())


def test_extreme_magnitudes_clamp_to_valid_bytes():
    x = torch.zeros(1, 96)
    x[0, 0] = 1e-40  # float32 subnormal: floor exponent < -127, clamps to byte 0
    x[0, 32] = 3e38  # near float32 max: byte 127 + 127 - 8 = 246
    x[0, 64] = 1.0  # floor(log2(1)) - 8 = -8: byte 119
    elements, scales = to_mx(x)
    assert scales.tolist() == [[0, 246, 119]]
    back = from_mx(elements, scales)
    torch.testing.assert_close(back[0, [0, 32, 64]], x[0, [0, 32, 64]], rtol=2**-4, atol=0)


def test_non_finite_block_gets_nan_byte():
    x = torch.randn(1, 96)
    x[0, 3] = float("inf")
    x[0, 40] = float("nan")
    elements, scales = to_mx(x)
    assert scales[0].tolist()[:2] == [255, 255] and scales[0, 2].item() != 255
    back = from_mx(elements, scales)
    assert bool(back[0, :64].isnan().all()) and not bool(back[0, 64:].isnan().any())


def test_byte_0_dequantizes_to_a_positive_number():
    elements = torch.full((1, 32), 448.0).to(E4M3)
    back = from_mx(elements, torch.zeros(1, 1, dtype=torch.uint8))
    assert bool((back == 448.0 * 2.0**-127).all()) and back.min().item() > 0


def test_to_mx_keeps_leading_dims_and_dtype():
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    elements, scales = to_mx(x)
    assert elements.shape == (2, 3, 64) and scales.shape == (2, 3, 2)
    assert from_mx(elements, scales, dtype=torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        ({"x": torch.randn(2, 48)}, "x"),
        ({"x": torch.ones(2, 32, dtype=torch.int32)}, "x"),
        ({"x": torch.randn(2, 32), "scale_rounding": "ceil"}, "scale_rounding"),
        ({"x": torch.randn(2, 32), "block_size": 0}, "block_size"),
    ],
)
def test_to_mx_errors_name_the_argument(kwargs, argument):
    with pytest.raises(ValueError, match=f"`{argument}`") as info:
        to_mx(**kwargs)
    assert isinstance(info.value, MXArgumentError) and info.value.argument == argument


# --- MXLinear ---------------------------------------------------------------------------------------


class _OpCalls(TorchDispatchMode):
    """Records the operand dtypes of every fp8conf::scaled_mm_e8m0 call."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.fp8conf.scaled_mm_e8m0.default:
            self.calls.append((args[0].dtype, args[1].dtype))
        return func(*args, **(kwargs or {}))


def _pair(recipe, scale_rounding="floor", in_features=64, out_features=96, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    ref = nn.Linear(in_features, out_features, dtype=dtype)
    mx = MXLinear(in_features, out_features, dtype=dtype, recipe=recipe, scale_rounding=scale_rounding)
    mx.load_state_dict(ref.state_dict())
    return ref, mx


def _forward_backward(module, x, grad_out, linear=None):
    """Output and the grads of input, weight and bias (of ``linear``, default ``module``)."""
    linear = module if linear is None else linear
    x = x.detach().clone().requires_grad_(True)
    linear.zero_grad(set_to_none=True)
    out = module(x)
    out.backward(grad_out)
    return out.detach(), x.grad, linear.weight.grad, linear.bias.grad


def test_mxlinear_attributes():
    m = MXLinear(32, 64, recipe="mxfp8_emulated", scale_rounding="rup")
    assert MXLinear.quant_kind == "mxfp8_linear" and m.quant_kind == "mxfp8_linear"
    assert (m.recipe, m.emulate, m.block_size, m.scale_rounding) == ("mxfp8_emulated", True, 32, "rup")
    assert MXLinear(32, 64).emulate is False and isinstance(m, nn.Linear)


@pytest.mark.parametrize("scale_rounding", SCALE_ROUNDINGS)
@pytest.mark.parametrize("recipe", RUNNABLE)
def test_mxlinear_close_to_nn_linear(recipe, scale_rounding):
    ref, mx = _pair(recipe, scale_rounding)
    x = torch.randn(2, 16, 64)
    grad_out = torch.randn(2, 16, 96)
    want = _forward_backward(ref, x, grad_out)
    with _OpCalls() as calls:
        got = _forward_backward(mx, x, grad_out)
    for name, g, w in zip(("output", "grad_input", "grad_weight"), got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert _rel(g, w) < 0.08, f"{name}: relative error {_rel(g, w):.4f}"
    torch.testing.assert_close(got[3], want[3])  # the bias is added in high precision
    # forward, grad_input and grad_weight each issue one FP8 op; the emulated recipe none
    expected = [] if recipe == "mxfp8_emulated" else [(E4M3, E4M3)] * 3
    assert calls.calls == expected


def test_recipes_agree_within_rounding():
    x = torch.randn(4, 8, 64)
    grad_out = torch.randn(4, 8, 96)
    _, real = _pair("mxfp8")
    _, emulated = _pair("mxfp8_emulated")
    for g, w in zip(_forward_backward(real, x, grad_out), _forward_backward(emulated, x, grad_out)):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_batch_not_multiple_of_32_is_padded_exactly():
    # M = 15: grad_weight contracts over M, zero-padded to 32 (zeros add nothing)
    ref, mx = _pair("mxfp8")
    x = torch.randn(3, 5, 64)
    grad_out = torch.randn(3, 5, 96)
    got = _forward_backward(mx, x, grad_out)
    want = _forward_backward(ref, x, grad_out)
    assert [t.shape for t in got] == [t.shape for t in want]
    assert all(_rel(g, w) < 0.08 for g, w in zip(got[:3], want[:3]))


def test_bfloat16_module_keeps_bfloat16():
    _, mx = _pair("mxfp8", dtype=torch.bfloat16)
    out, grad_x, grad_w, _ = _forward_backward(mx, torch.randn(32, 64, dtype=torch.bfloat16),
                                               torch.randn(32, 96, dtype=torch.bfloat16))
    assert out.dtype == grad_x.dtype == grad_w.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        ({"in_features": 48, "out_features": 64}, "in_features"),
        ({"in_features": 64, "out_features": 40}, "out_features"),
        ({"in_features": 64, "out_features": 64, "recipe": "mxfp4"}, "recipe"),
        ({"in_features": 64, "out_features": 64, "scale_rounding": "even"}, "scale_rounding"),
    ],
)
def test_mxlinear_constructor_errors(kwargs, argument):
    with pytest.raises(ValueError, match=argument) as info:
        MXLinear(**kwargs)
    assert info.value.argument == argument


def test_mxlinear_rejects_wrong_input():
    with pytest.raises(ValueError, match="`input`"):
        MXLinear(64, 32)(torch.randn(4, 32))


# --- conversion -------------------------------------------------------------------------------------


def _model():
    torch.manual_seed(1)
    return nn.Sequential(
        nn.Linear(64, 64),
        nn.ReLU(),
        nn.Sequential(nn.Linear(64, 32, bias=False)),
        nn.Linear(32, 10),
    )


def test_convert_swaps_linears_in_place_sharing_parameters():
    model = _model()
    params = {name: p for name, p in model.named_parameters()}
    seen = []

    def keep_all_but_head(module, fqn):
        seen.append((type(module), fqn))
        return fqn != "3"

    x = torch.randn(32, 64)
    with torch.no_grad():
        before = model(x)
    out = convert_to_mx_training(model, recipe="mxfp8_emulated", module_filter_fn=keep_all_but_head,
                                 scale_rounding="rup")
    assert out is model
    assert isinstance(model[0], MXLinear) and isinstance(model[2][0], MXLinear)
    assert type(model[3]) is nn.Linear
    assert (model[0].recipe, model[0].emulate, model[0].scale_rounding) == ("mxfp8_emulated", True, "rup")
    assert all(p is params[name] for name, p in model.named_parameters())
    assert model[2][0].bias is None
    assert (nn.Linear, "2.0") in seen and (nn.Linear, "3") in seen
    with torch.no_grad():
        assert _rel(model(x), before) < 0.08


def test_convert_rejects_bad_features_naming_the_fqn_and_changes_nothing():
    model = _model()
    with pytest.raises(ValueError, match=r"'3'.*out_features=10") as info:
        convert_to_mx_training(model)
    assert isinstance(info.value, MXConversionError) and info.value.module_fqn == "3"
    assert not any(isinstance(m, MXLinear) for m in model.modules())


def test_convert_root_linear_and_shared_linear():
    root = nn.Linear(32, 32)
    new = convert_to_mx_training(root)
    assert isinstance(new, MXLinear) and new.weight is root.weight
    shared = nn.Linear(32, 32)
    model = nn.ModuleDict({"a": shared, "b": shared})
    convert_to_mx_training(model)
    assert isinstance(model["a"], MXLinear) and model["a"] is model["b"]


def test_convert_rejects_unknown_recipe():
    with pytest.raises(ValueError, match="`recipe`") as info:
        convert_to_mx_training(_model(), recipe="nvfp4")
    assert info.value.argument == "recipe"


def test_from_float():
    linear = nn.Linear(64, 32)
    mx = MXLinear.from_float(linear, recipe="mxfp8_emulated")
    assert mx.weight is linear.weight and mx.bias is linear.bias and mx.emulate
    assert mx.weight.device.type == "cpu"


# --- torch.compile ----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RUNNABLE)
def test_compile_inductor_forward_backward_matches_eager(recipe):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    torch.manual_seed(2)
    model = nn.Sequential(MXLinear(64, 32, recipe=recipe), nn.ReLU())
    x = torch.randn(2, 16, 64)
    grad_out = torch.randn(2, 16, 32)
    eager = _forward_backward(model, x, grad_out, linear=model[0])
    counter = CompileCounterWithBackend("inductor")
    compiled_model = torch.compile(model, backend=counter, fullgraph=True)
    compiled = _forward_backward(compiled_model, x, grad_out, linear=model[0])
    assert counter.frame_count == 1
    for g, w in zip(compiled, eager):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


# --- the dtype scales travel in ----------------------------------------------------------------------


def test_default_scale_dtype_follows_what_inductor_compiles(caplog):
    native = torch_internals.inductor_lowers_e8m0()
    assert default_scale_dtype() == (torch.float8_e8m0fnu if native.found else torch.uint8)
    assert MXLinear(32, 32).scale_dtype == default_scale_dtype()
    assert "scale_dtype=" in repr(MXLinear(32, 32))
    if not native.found:
        assert native.reason


def test_to_mx_scales_are_the_same_bytes_in_either_dtype():
    x = _varied_blocks()
    elements, as_bytes = to_mx(x)
    elements_e8m0, as_e8m0 = to_mx(x, scale_dtype=torch.float8_e8m0fnu)
    assert as_bytes.dtype == torch.uint8 and as_e8m0.dtype == torch.float8_e8m0fnu
    assert torch.equal(as_e8m0.view(torch.uint8), as_bytes) and torch.equal(elements_e8m0.view(torch.uint8), elements.view(torch.uint8))
    assert torch.equal(from_mx(elements, as_e8m0), from_mx(elements, as_bytes))
    with pytest.raises(MXArgumentError, match="scale_dtype"):
        to_mx(x, scale_dtype=torch.float32)


@pytest.mark.parametrize("recipe", RUNNABLE)
def test_mxlinear_scale_dtypes_agree_bitwise(recipe):
    torch.manual_seed(4)
    base = nn.Linear(64, 32)
    x = torch.randn(2, 16, 64)
    grad_out = torch.randn(2, 16, 32)
    results = []
    for scale_dtype in (torch.uint8, torch.float8_e8m0fnu):
        model = MXLinear.from_float(base, recipe=recipe, scale_dtype=scale_dtype)
        results.append(_forward_backward(model, x, grad_out, linear=model))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_compile_with_e8m0_scales_where_inductor_compiles_them():
    """Where Inductor compiles e8m0, MXLinear with float8_e8m0fnu scales compiles in one graph,
    equals its uint8 twin compiled bitwise and eager within the compiled-uint8 test's tolerance;
    where it does not, the compile aborts, which is why those torch releases carry the scales as
    uint8 (and say so)."""
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1))
    grad_out = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(2))
    runs = {}
    for scale_dtype in (torch.uint8, torch.float8_e8m0fnu):
        torch._dynamo.reset()
        torch.manual_seed(2)
        model = nn.Sequential(MXLinear(64, 32, scale_dtype=scale_dtype), nn.ReLU())
        compiled_model = torch.compile(model, backend="inductor", fullgraph=True)
        if scale_dtype == torch.float8_e8m0fnu and not torch_internals.inductor_lowers_e8m0().found:
            with pytest.raises(Exception, match="float8_e8m0fnu"):
                _forward_backward(compiled_model, x, grad_out, linear=model[0])
            return
        runs[scale_dtype] = (_forward_backward(model, x, grad_out, linear=model[0]),
                             _forward_backward(compiled_model, x, grad_out, linear=model[0]))
    (eager, compiled_bytes), (_, compiled_e8m0) = runs[torch.uint8], runs[torch.float8_e8m0fnu]
    for native, as_bytes, reference in zip(compiled_e8m0, compiled_bytes, eager):
        assert torch.equal(native, as_bytes)
        torch.testing.assert_close(native, reference, rtol=1e-5, atol=1e-6)


def _torchao_mx_training():
    """torchao 0.18's MX training API, or a skip naming why it cannot be imported here."""
    # Check numpy first: a failed torchao import leaves half-imported modules behind, so a second
    # attempt can get past the import and fail later, inside quantize_.
    pytest.importorskip("numpy", reason="torchao.prototype.mx_formats imports numpy")
    try:
        from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.quantization import quantize_
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference
    except ImportError as exc:  # torchao.prototype.mx_formats imports numpy
        pytest.skip(f"torchao MX training API not importable: {exc!r}")
    return MXFP8TrainingOpConfig, MXFP8TrainingRecipe, ScaleCalculationMode, quantize_, KernelPreference


def _torchao_linear(config_fn):
    """A one-linear model converted by torchao (`quantize_` + MXFP8TrainingOpConfig)."""
    config, _, _, quantize_, _ = _torchao_mx_training()
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(64, 64))
    try:
        quantize_(model, config_fn(), filter_fn=lambda module, fqn: isinstance(module, nn.Linear))
    except AssertionError as exc:
        # torchao 0.17 refuses MX training on a released torch ("install the latest torch nightly").
        if "nightly" not in str(exc):
            raise
        pytest.skip(f"torchao {torchao.__version__} cannot convert for MX training on torch {torch.__version__}: {exc}")
    return model


def _cpu_inductor_has_e8m0() -> bool:
    from torch._inductor.codegen.cpp_utils import DTYPE_TO_CPP

    return hasattr(torch, "float8_e8m0fnu") and torch.float8_e8m0fnu in DTYPE_TO_CPP


def test_record_torchao_emulated_mxfp8_floor_on_cpu_inductor():
    """Recorded behaviour: torchao's emulated MXFP8 linear runs eagerly; with FLOOR scales its
    fused kernel bitcasts through ``torch.float8_e8m0fnu``. Where CPU Inductor has no C++ type
    for it (torch 2.13, torchao 0.18) compiling aborts, which is why fp8conf's MXLinear keeps e8m0
    out of generated code; where it has one (torch 2.14) the compiled step matches eager."""
    config, _, modes, _, kernel = _torchao_mx_training()
    model = _torchao_linear(lambda: config(kernel_preference=kernel.EMULATED,
                                           scale_calculation_mode=modes.FLOOR, out_dtype=torch.float32))
    x = torch.randn(32, 64, requires_grad=True)
    model(x).sum().backward()  # eager works
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    if _cpu_inductor_has_e8m0():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-2, atol=1e-2)
        return
    with pytest.raises(Exception, match=r"float8_e8m0fnu missing from torch\._inductor\.codegen\.cpp\.DTYPE_TO_CPP") as info:
        compiled(x).sum().backward()
    assert type(info.value).__name__ == "InductorError"


def test_record_torchao_emulated_mxfp8_rceil_recipe_compiles_on_cpu_inductor():
    """Recorded behaviour: torchao's named emulated recipe (RCEIL scales) does compile on CPU."""
    config, recipes, _, _, _ = _torchao_mx_training()
    model = _torchao_linear(lambda: config.from_recipe(recipes.MXFP8_EMULATED_RCEIL))
    x = torch.randn(32, 64)
    torch._dynamo.reset()
    out = torch.compile(model, backend="inductor", fullgraph=True)(x)
    torch.testing.assert_close(out, model(x), rtol=1e-2, atol=1e-2)


# --- CUDA -------------------------------------------------------------------------------------------


@pytest.mark.fp8_gpu
@requires_cuda
@pytest.mark.parametrize("recipe", RUNNABLE)
def test_cuda_mxlinear_close_to_nn_linear(recipe):
    ref, mx = _pair(recipe, dtype=torch.bfloat16)
    ref, mx = ref.cuda(), mx.cuda()
    x = torch.randn(4, 32, 64, device="cuda", dtype=torch.bfloat16)
    grad_out = torch.randn(4, 32, 96, device="cuda", dtype=torch.bfloat16)
    got = _forward_backward(mx, x, grad_out)
    want = _forward_backward(ref, x, grad_out)
    for g, w in zip(got[:3], want[:3]):
        assert g.device.type == "cuda" and g.dtype == torch.bfloat16 and _rel(g, w) < 0.08


@pytest.mark.fp8_gpu
@requires_cuda
def test_cuda_recipes_agree():
    x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    grad_out = torch.randn(64, 96, device="cuda", dtype=torch.bfloat16)
    real = _forward_backward(_pair("mxfp8", dtype=torch.bfloat16)[1].cuda(), x, grad_out)
    emulated = _forward_backward(_pair("mxfp8_emulated", dtype=torch.bfloat16)[1].cuda(), x, grad_out)
    for g, w in zip(real, emulated):
        # both accumulate in float32; cuBLAS (sm100) may sum in another order: allow 1 bf16 ulp
        torch.testing.assert_close(g, w, rtol=2**-7, atol=1e-3 * float(w.abs().max()) + math.ulp(0.0))


# --- MXFP8 on F.scaled_mm with swizzled e8m0 scales (recipe mxfp8_swizzled) --------------------------

_needs_v2 = pytest.mark.skipif(not hasattr(torch.nn.functional, "scaled_mm"), reason="torch has no F.scaled_mm")


def _swizzled_block(dim: int = 64):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(dim, 32), nn.ReLU(), nn.Linear(32, dim, bias=False), nn.Linear(dim, 32))


@_needs_v2
@pytest.mark.parametrize("rows, k", [(16, 32), (144, 160), (256, 64)])
def test_the_suites_reading_of_swizzled_e8m0_scales_inverts_fp8confs_layout_and_torch_takes_its_size(rows, k):
    from conformance.judge import block_scaled
    from fp8conf.quantized.ops.e8m0 import to_cublas_blocked

    torch.manual_seed(rows)
    scales = torch.randint(100, 150, (rows, k // 32), dtype=torch.uint8)
    swizzled = to_cublas_blocked(scales)
    assert swizzled.numel() == block_scaled.block_scales_numel(rows, k, 32)
    assert torch.equal(block_scaled.unswizzle(swizzled, rows, k, 32), scales)
    fn = torch.nn.functional
    block, swizzle = fn.ScalingType.BlockWise1x32, fn.SwizzleType.SWIZZLE_32_4_4
    with torch.device("meta"):
        a = torch.empty(rows, k, dtype=torch.float8_e4m3fn)

        def run(numel):
            s = torch.empty(numel, dtype=torch.uint8).view(torch.float8_e8m0fnu)
            return fn.scaled_mm(a, a.t(), s, block, s, block, swizzle_a=swizzle, swizzle_b=swizzle, output_dtype=torch.bfloat16)

        assert run(swizzled.numel()).shape == (rows, rows)
        with pytest.raises(RuntimeError):
            run(rows * (k // 32))


@_needs_v2
def test_swizzled_mx_linears_trace_attribute_count_and_split_on_cpu():
    from conformance.judge import block_scaled

    model = _swizzled_block()
    convert_to_mx_training(model, recipe="mxfp8_swizzled", module_filter_fn=lambda m, fqn: fqn != "3")
    gm = fp8conf.trace_joint(model, (torch.randn(8, 64, requires_grad=True),))
    matmuls = [n for n in gm.graph.nodes if block_scaled.matmul_format(n) is block_scaled.MXFP8]
    assert len(matmuls) == 6 and all(not block_scaled.layout_problems(n, block_scaled.MXFP8) for n in matmuls)
    assert {(fp8conf.get_provenance(n).module_fqn, fp8conf.get_provenance(n).recipe) for n in matmuls} == {
        ("0", "mxfp8_swizzled"), ("2", "mxfp8_swizzled")}
    report = fp8conf.validate_fp8_graph(gm, strict=True)
    assert report.compute_counts == {("0", "forward"): 1, ("0", "backward"): 2, ("2", "forward"): 1, ("2", "backward"): 2}
    split = fp8conf.split_stage(gm, strict=True)
    pieces = [split.forward, split.backward_input, split.backward_weight]
    assert [sum(block_scaled.matmul_format(n) is block_scaled.MXFP8 for n in p.graph.nodes) for p in pieces] == [2, 2, 2]


@_needs_v2
def test_the_swizzled_recipe_computes_what_the_emulated_one_does_by_the_suites_reading():
    from conformance.judge import block_scaled

    real, emulated = _swizzled_block(), _swizzled_block()
    convert_to_mx_training(real, recipe="mxfp8_swizzled")
    convert_to_mx_training(emulated, recipe="mxfp8_emulated")
    x, grad_out = torch.randn(8, 64), torch.randn(8, 32)
    steps = []
    for model, reading in ((real, block_scaled.read_by_the_suite()), (emulated, None)):
        inp = x.clone().requires_grad_(True)
        with reading or contextlib.nullcontext() as reads:
            out = model(inp)
            out.backward(grad_out)
        if reading is not None:
            assert reads.count["MXFP8"] == reads.computed == 9 and not reads.problems
            assert max(o.error for o in reads.operands) < 0.06
        steps.append((out.detach(), inp.grad, model[0].weight.grad))
    for got, want in zip(*steps):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@_needs_v2
def test_a_swizzled_mx_matmul_with_row_major_scales_is_refused_by_the_suites_reading():
    from conformance.judge import block_scaled

    fn = torch.nn.functional
    a = torch.randn(16, 32).to(torch.float8_e4m3fn)
    scales = torch.full((16, 1), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    block = fn.ScalingType.BlockWise1x32
    with pytest.raises(block_scaled.LayoutUnreadable, match=r"scale swizzles are \[0\], expected \[1\]"):
        with block_scaled.read_by_the_suite():
            fn.scaled_mm(a, a.t(), scales, block, scales, block, swizzle_a=fn.SwizzleType.NO_SWIZZLE,
                         swizzle_b=fn.SwizzleType.NO_SWIZZLE, output_dtype=torch.bfloat16)


@_needs_v2
def test_the_trainers_own_mx_linears_quantize_and_swizzle_as_fp8conf_and_the_suite_read_it():
    # Three implementations written apart: the worked example's (index arithmetic), fp8conf's
    # (permuted tiles) and the suite's reading.
    import trainer_mx

    from conformance.judge import block_scaled
    from fp8conf.quantized.ops.e8m0 import to_cublas_blocked

    torch.manual_seed(5)
    x = torch.randn(200, 96) * torch.logspace(-3, 3, 96)
    data, scales = trainer_mx.quantize(x)
    ours_data, ours_scales = to_mx(x)
    assert torch.equal(data.view(torch.uint8), ours_data.view(torch.uint8)) and torch.equal(scales, ours_scales)
    swizzled = trainer_mx.swizzle(scales)
    assert torch.equal(swizzled.view(torch.uint8), to_cublas_blocked(scales))
    assert torch.equal(block_scaled.unswizzle(swizzled.view(torch.uint8), 200, 96, 32), scales)
    # And the makefx trainer's, a fourth (exponents off torch.frexp).
    from conformance.backends.makefx_linear import _swizzled, _to_mx

    makefx_data, makefx_scales = _to_mx(x)
    assert torch.equal(makefx_data.view(torch.uint8), data.view(torch.uint8))
    assert torch.equal(makefx_scales.view(torch.uint8), scales)
    assert torch.equal(_swizzled(makefx_scales).view(torch.uint8), swizzled.view(torch.uint8))
