"""Tensor-parallel FP8 steps: TorchAO's Float8ColwiseParallel / Float8RowwiseParallel applied by
fp8conf.parallel.shard_tensor_parallel, traced, validated, tagged and split, and the plan in the
quantization signature.

Structure is checked on graphs traced over torch's fake process group (one process, as rank 0
and rank 1); numerics in two gloo processes (marked slow)."""

from __future__ import annotations

import pytest
import torch

import fp8conf
from fp8conf.graph.collectives import get_collective, is_collective
from fp8conf.parallel import layout_of, shard_tensor_parallel

WORLD = 2
PLAN = {"up": "colwise", "down": "rowwise"}


@pytest.fixture(params=[0, 1], ids=["rank0", "rank1"])
def mesh(request):
    """A 2-rank mesh over torch's fake process group, as each rank (one, where a test says so)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is initialized already in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=request.param, world_size=WORLD)
    try:
        yield init_device_mesh("cpu", (WORLD,))
    finally:
        dist.destroy_process_group()


class MLP(torch.nn.Module):
    def __init__(self, bias=False):
        super().__init__()
        self.up = torch.nn.Linear(32, 64, bias=bias)
        self.down = torch.nn.Linear(64, 32, bias=bias)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _model(recipe="tensorwise", bias=False, quantized=("up", "down")):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    return convert_to_float8_training(
        MLP(bias), config=Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=lambda m, fqn: fqn in quantized
    )


# What does not depend on the rank is checked as rank 0 only.
_rank0_only = pytest.mark.parametrize("mesh", [0], ids=["rank0"], indirect=True)


def _traced(mesh, **kwargs):
    model = shard_tensor_parallel(_model(**kwargs), mesh, PLAN)
    return model, fp8conf.trace_joint(model, (torch.randn(16, 32, requires_grad=True),))


def test_a_tensor_parallel_step_validates_with_the_unsharded_counts_on_each_rank(mesh):
    _, gm = _traced(mesh, bias=True)
    sharded = fp8conf.validate_fp8_graph(gm)
    plain = fp8conf.validate_fp8_graph(fp8conf.trace_joint(_model(bias=True), (torch.randn(16, 32, requires_grad=True),)))
    assert sharded.compute_counts == plain.compute_counts and not sharded.findings
    # Each rank computes on its shard: up's forward matmul gives 64 / 2 features, down's takes 64 / 2.
    forward = [n for n in gm.graph.nodes if "_scaled_mm" in str(n.target) and fp8conf.node_passes(gm.graph)[n] == "forward"]
    shapes = {fp8conf.get_provenance(n).module_fqn: (tuple(n.args[0].meta["val"].shape), tuple(n.meta["val"].shape)) for n in forward}
    assert shapes == {"up": ((16, 32), (16, 32)), "down": ((16, 32), (16, 32))}
    assert {str(n.args[1].meta["val"].dtype) for n in forward} == {"torch.float8_e4m3fn"}


@_rank0_only
def test_the_layout_records_the_plan(mesh):
    model, gm = _traced(mesh)
    layout = layout_of(model)
    assert layout.kind == "tensor_parallel" and layout.world_size == WORLD
    assert dict(layout.plan) == {"up": "float8_colwise", "down": "float8_rowwise"}
    assert fp8conf.trace_info(gm).layout == layout
    assert model.up.weight.to_local().shape == (32, 32) and model.down.weight.to_local().shape == (32, 32)


@_rank0_only
def test_regions_are_complete_and_hold_no_collective(mesh):
    _, gm = _traced(mesh)
    regions = fp8conf.tag_fp8_regions(gm)
    assert len(regions) == 4 and all(r.complete for r in regions)
    for region in regions:
        assert not any(is_collective(n) for n in region.nodes), region.id
    records = [get_collective(n) for n in gm.graph.nodes if get_collective(n) is not None]
    # The rowwise output's sum over ranks, forward, and the colwise input gradient's, backward.
    assert any(r.op == "all_reduce" and r.pass_name == "forward" and r.module_fqn == "down" and r.element_size == 4 for r in records)
    assert any(r.op == "all_reduce" and r.pass_name == "backward" and r.module_fqn == "up" and r.element_size == 4 for r in records)


@_rank0_only
def test_the_split_keeps_each_collective_on_its_side(mesh):
    _, gm = _traced(mesh)
    passes = fp8conf.node_passes(gm.graph)
    before = {n.name: passes[n] for n in gm.graph.nodes if get_collective(n) is not None}
    split = fp8conf.split_stage(gm)
    where = {}
    for part, callable_gm in split.parts.items():
        for node in callable_gm.graph.nodes:
            if get_collective(node) is not None:
                where.setdefault(node.name, []).append(part)
    assert sorted(where) == sorted(before)  # each collective once: none dropped, none duplicated
    for name, parts in where.items():
        assert len(parts) == 1, (name, parts)
        # Forward collectives in forward; backward ones in dI, since the input gradient needs them.
        assert parts[0] == ("forward" if before[name] == "forward" else "backward_input"), (name, parts)
    computes = {part: sum(1 for n in g.graph.nodes if "_scaled_mm" in str(n.target)) for part, g in split.parts.items()}
    assert computes == {"forward": 2, "backward_input": 2, "backward_weight": 2}


@_rank0_only
def test_the_signature_covers_the_plan(mesh):
    fp8 = fp8conf.QuantizationSignature.from_model(shard_tensor_parallel(_model(), mesh, PLAN))
    again = fp8conf.QuantizationSignature.from_model(shard_tensor_parallel(_model(), mesh, PLAN))
    swapped = fp8conf.QuantizationSignature.from_model(shard_tensor_parallel(_model(), mesh, {"up": "colwise"}))
    unsharded = fp8conf.QuantizationSignature.from_model(_model())
    assert fp8 == again and len({fp8.sha256, swapped.sha256, unsharded.sha256}) == 3
    assert fp8.to_dict()["parallel"] == {"kind": "tensor_parallel", "plan": {"up": "float8_colwise", "down": "float8_rowwise"}}
    assert {path for path, _, _ in fp8.diff(swapped)} == {"parallel.plan.down"}
    assert fp8conf.QuantizationSignature.from_json(fp8.to_json()) == fp8
    assert "2 module(s) sharded, 2 of them with FP8 styles" in fp8.summary()
    plain_down = shard_tensor_parallel(_model(quantized=("up",)), mesh, PLAN)
    assert dict(layout_of(plain_down).plan) == {"up": "float8_colwise", "down": "rowwise"}


@_rank0_only
def test_plans_it_cannot_shard_are_refused(mesh):
    with pytest.raises(fp8conf.FP8ConfigError, match="'down' is float8_linear with recipe 'rowwise'.*tensorwise"):
        shard_tensor_parallel(_model(recipe="rowwise"), mesh, PLAN)
    with pytest.raises(fp8conf.FP8ConfigError, match="names 'mid', which is no module"):
        shard_tensor_parallel(_model(), mesh, {"mid": "colwise"})
    with pytest.raises(fp8conf.FP8ConfigError, match="plan\\['up'\\] is 'sequence'"):
        shard_tensor_parallel(_model(), mesh, {"up": "sequence"})
    odd = torch.nn.Sequential(torch.nn.Linear(8, 7))
    with pytest.raises(fp8conf.FP8ConfigError, match="'0' \\(colwise\\) splits 7 features over 2 ranks"):
        shard_tensor_parallel(odd, mesh, {"0": "colwise"})
    sharded = shard_tensor_parallel(_model(), mesh, PLAN)
    with pytest.raises(fp8conf.FP8ConfigError, match="sharded already"):
        shard_tensor_parallel(sharded, mesh, PLAN)


@pytest.mark.slow
def test_tensor_parallel_numerics_match_the_unsharded_step_over_gloo():
    from fp8conf.tools.tensor_parallel_check import BIAS_TOLERANCE, COMPILED_TOLERANCE, TOLERANCE, launch

    check = launch(ranks=2, dim=32, hidden=64, tokens=16, compile="regional")
    assert check.ok, check.summary()
    assert check.compiled_max_abs_diff <= COMPILED_TOLERANCE, check.summary()
    assert check.errors["up.weight"] <= TOLERANCE and check.errors["output"] <= TOLERANCE, check.summary()
    assert check.errors["down.bias"] <= BIAS_TOLERANCE, check.summary()
