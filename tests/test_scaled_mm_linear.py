"""fp8conf's linear on torch's second scaled-matmul API (``fp8conf.quantized.scaled_mm``):
conversion, numerics against float32, and the passes (trace, provenance, validation, regions,
split, compile) on graphs whose FP8 compute is ``aten._scaled_mm_v2``, all on CPU, where torch
runs tensorwise and rowwise ``F.scaled_mm``."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

import fp8conf
from conformance.draw.strategies import SCALED_MM_KIND, runnable_kinds
from fp8conf.errors import FP8ValidationError, ScaledMMConversionError
from fp8conf.quantized.scaled_mm import ScaledMMLinear, convert_to_scaled_mm_training, has_scaled_mm_v2

pytestmark = pytest.mark.skipif(not has_scaled_mm_v2(), reason=f"torch {torch.__version__} has no F.scaled_mm (2.12 and newer)")
#: Tests that run the linears' matmuls on CPU tensors.
runs_on_cpu = pytest.mark.skipif(
    SCALED_MM_KIND not in runnable_kinds(),
    reason=f"torch {torch.__version__} runs no F.scaled_mm on CPU (torch 2.11 has it with a CUDA kernel only)",
)

RECIPES = ("tensorwise", "rowwise")
V2 = "aten._scaled_mm_v2.default"


class _Block(nn.Module):
    def __init__(self, dim: int = 32):
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim, bias=False)
        self.head = nn.Linear(dim, 16)

    def forward(self, x):
        return self.head(x + self.down(torch.relu(self.up(x))))


def _model(recipe: str, seed: int = 0):
    torch.manual_seed(seed)
    model = _Block()
    convert_to_scaled_mm_training(model, recipe=recipe, module_filter_fn=lambda m, fqn: fqn != "head")
    x = torch.randn(4, 8, 32, requires_grad=True)
    return model, x


def _v2_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target) == V2]


def test_conversion_swaps_plain_linears_keeps_their_parameters_and_names_the_kind():
    torch.manual_seed(0)
    model = _Block()
    weight = model.up.weight
    convert_to_scaled_mm_training(model, recipe="rowwise", module_filter_fn=lambda m, fqn: fqn != "head")
    assert isinstance(model.up, ScaledMMLinear) and model.up.weight is weight
    assert type(model.head) is nn.Linear
    found = fp8conf.find_quantized_modules(model)
    assert {fqn: (c.kind, c.recipe, c.emulate) for fqn, c in found.items()} == {
        "up": ("float8_scaled_mm_linear", "rowwise", False),
        "down": ("float8_scaled_mm_linear", "rowwise", False),
    }


def test_conversion_refuses_what_fp8_matmuls_cannot_take_naming_the_module_and_changes_nothing():
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 24))
    with pytest.raises(ScaledMMConversionError, match=r"linear '1' has out_features=24 not a multiple of 16") as info:
        convert_to_scaled_mm_training(model)
    assert info.value.module_fqn == "1"
    assert type(model[0]) is nn.Linear  # checked before any swap
    with pytest.raises(ScaledMMConversionError, match="recipe must be one of"):
        convert_to_scaled_mm_training(model, recipe="mxfp8")


def _dequantized(t: torch.Tensor, recipe: str) -> torch.Tensor:
    """``t`` (R, C) as the FP8 matmul sees it: quantized along C with power-of-two scales,
    computed here from their definition (448 / amax, rounded down to a power of two)."""
    amax = t.abs().amax() if recipe == "tensorwise" else t.abs().amax(dim=-1, keepdim=True)
    scale = torch.exp2(torch.floor(torch.log2(448.0 / amax.double().clamp(min=1e-12))))
    return (t.double() * scale).clamp(-448, 448).to(torch.float8_e4m3fn).double() / scale


@runs_on_cpu
@pytest.mark.parametrize("recipe", RECIPES)
def test_each_of_the_three_matmuls_is_the_product_of_its_operands_quantized_along_its_contraction_dim(recipe):
    torch.manual_seed(0)
    linear = ScaledMMLinear.from_float(nn.Linear(32, 48, bias=False), recipe=recipe)
    x = torch.randn(24, 32, requires_grad=True)  # 24 tokens: the weight gradient's dim is padded to 32
    grad = torch.randn(24, 48)
    out = linear(x)
    out.backward(grad)
    w = linear.weight.detach()
    expected = {
        "output": _dequantized(x.detach(), recipe) @ _dequantized(w, recipe).t(),
        "grad_input": _dequantized(grad, recipe) @ _dequantized(w.t().contiguous(), recipe).t(),
        "grad_weight": _dequantized(grad.t().contiguous(), recipe) @ _dequantized(x.detach().t().contiguous(), recipe).t(),
    }
    got = {"output": out, "grad_input": x.grad, "grad_weight": linear.weight.grad}
    for name in expected:
        torch.testing.assert_close(got[name].double(), expected[name], rtol=1e-5, atol=1e-5, msg=name)
    # and FP8 really ran: the float32 product differs
    assert not torch.allclose(out, x.detach() @ w.t(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_joint_graph_holds_three_v2_fp8_matmuls_per_module_with_provenance_and_validates(recipe):
    model, x = _model(recipe)
    gm = fp8conf.trace_joint(model, (x,))
    nodes = _v2_nodes(gm)
    assert nodes and all(fp8conf.is_fp8_compute(n) for n in nodes)
    owners = collections.Counter((p.module_fqn, p.kind, p.recipe) for p in map(fp8conf.get_provenance, nodes))
    assert owners == {
        ("up", "float8_scaled_mm_linear", recipe): 3,
        ("down", "float8_scaled_mm_linear", recipe): 3,
    }
    report = fp8conf.validate_fp8_graph(gm)
    assert report.ok, report.summary
    passes = fp8conf.node_passes(gm.graph)
    assert collections.Counter(passes[n] for n in nodes) == {"forward": 2, "backward": 4}


def test_a_v2_matmul_lost_to_a_high_precision_one_is_a_validation_failure_naming_the_module():
    model, x = _model("tensorwise")
    gm = fp8conf.trace_joint(model, (x,))
    lost = next(n for n in _v2_nodes(gm) if fp8conf.get_provenance(n).module_fqn == "down")
    a, b = lost.args[0], lost.args[1]
    with gm.graph.inserting_before(lost):
        mm = gm.graph.call_function(torch.ops.aten.mm.default, (
            gm.graph.call_function(torch.ops.aten._to_copy.default, (a,), {"dtype": torch.float32}),
            gm.graph.call_function(torch.ops.aten._to_copy.default, (b,), {"dtype": torch.float32}),
        ))
    mm.meta = dict(lost.meta)
    lost.replace_all_uses_with(mm)
    gm.graph.erase_node(lost)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    with pytest.raises(FP8ValidationError, match="down"):
        fp8conf.validate_fp8_graph(gm, strict=True)


@pytest.mark.parametrize("recipe", RECIPES)
def test_regions_are_complete_and_the_split_puts_each_backward_matmul_where_it_belongs(recipe):
    model, x = _model(recipe)
    gm = fp8conf.trace_joint(model, (x,))
    regions = [r for r in fp8conf.identify_fp8_regions(gm) if r.compute_nodes]
    assert regions and all(r.complete for r in regions), [r.reason for r in regions if not r.complete]
    assert {n for r in regions for n in r.compute_nodes} == set(_v2_nodes(gm))
    split = fp8conf.split_stage(gm)
    counts = {
        part: collections.Counter(fp8conf.get_provenance(n).module_fqn for n in _v2_nodes(getattr(split, part)))
        for part in ("forward", "backward_input", "backward_weight")
    }
    # x requires grad, so both grad_inputs are needed: one matmul per module in each part.
    assert counts == {
        "forward": {"up": 1, "down": 1},
        "backward_input": {"up": 1, "down": 1},
        "backward_weight": {"up": 1, "down": 1},
    }, counts


@runs_on_cpu
@pytest.mark.parametrize("mode", ["regional", "full"])
def test_compiled_steps_run_the_v2_matmuls_and_match_the_eager_step(mode):
    model, x = _model("rowwise")
    gm = fp8conf.trace_joint(model, (x,))
    grad = (torch.randn(4, 8, 16),)
    (out, ), grads = fp8conf.run_joint(gm, model, (x,), grad)
    compiled = fp8conf.compile_joint(gm, fp8conf.CompileConfig(mode=mode))
    assert sum(compiled.fallbacks.values()) == 0 if isinstance(compiled.fallbacks, dict) else not compiled.fallbacks
    (out_c, ), grads_c = fp8conf.run_joint(gm, model, (x,), grad, fn=compiled.fn)
    # Powers of two scales make the compiled quantization byte-exact; the matmuls' accumulation
    # order may differ.
    torch.testing.assert_close(out_c, out, rtol=1e-2, atol=1e-2)
    assert grads_c.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(grads_c[name], grads[name], rtol=1e-2, atol=1e-2, msg=name)
