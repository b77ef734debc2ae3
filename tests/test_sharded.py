"""Data-parallel FP8 steps: sharded weights gathered through functional collectives inside the
traced step (fp8conf.parallel), the passes across those collectives, and the all-gather check.

Structure is checked on graphs traced over torch's fake process group (one process, no data
moves); numerics in two gloo processes (marked slow)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.utils._pytree as pytree

import fp8conf
from fp8conf.graph.all_gathers import validate_weight_all_gathers
from fp8conf.graph.collectives import get_collective, is_collective
from fp8conf.graph.provenance import node_passes
from fp8conf.parallel import ParallelLayout, layout_of, shard_data_parallel

WORLD = 2


@pytest.fixture(scope="module")
def mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is initialized already in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        yield init_device_mesh("cpu", (WORLD,))
    finally:
        dist.destroy_process_group()


def _model(on: bool, recipe: str = "tensorwise"):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from fp8conf.tools.example_models import build_stack

    model = build_stack(32, 2, recipe=None, seed=0)
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), enable_fsdp_float8_all_gather=on)
    return convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn != "head")


def _traced(mesh, on: bool):
    model = shard_data_parallel(_model(on), mesh)
    x = torch.randn(8, 32, requires_grad=True)
    return model, fp8conf.trace_joint(model, (x,))


QUANTIZED = ("blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down")


@pytest.mark.parametrize("on", [True, False], ids=["float8_all_gather", "high_precision_all_gather"])
def test_every_collective_carries_the_parameter_it_moves_and_its_pass(mesh, on):
    model, gm = _traced(mesh, on)
    records = [get_collective(n) for n in gm.graph.nodes if get_collective(n) is not None]
    parameters = {fqn for fqn, _ in model.named_parameters()}
    gathers = {r.parameter: r for r in records if r.op == "all_gather"}
    scatters = {r.parameter: r for r in records if r.op == "reduce_scatter"}
    assert set(gathers) == parameters and set(scatters) == parameters  # each once: gathered once per call
    assert len([r for r in records if r.op == "all_gather"]) == len(parameters)
    assert all(r.pass_name == "forward" and r.moves == "parameter" for r in gathers.values())
    assert all(r.pass_name == "backward" and r.moves == "gradient" and not r.float8 for r in scatters.values())
    for fqn in QUANTIZED:
        weight = gathers[f"{fqn}.weight"]
        assert weight.module_fqn == fqn
        assert weight.float8 is on and weight.element_size == (1 if on else 4)
        assert weight.result_bytes == 32 * 128 * weight.element_size
    amax = [r for r in records if r.op == "all_reduce"]
    assert sorted(r.parameter for r in amax) == (sorted(f"{fqn}.weight" for fqn in QUANTIZED) if on else [])
    assert all(r.moves == "amax" and r.pass_name == "forward" for r in amax)
    # The gathers of a quantized module carry its provenance, as its other nodes do.
    for node in gm.graph.nodes:
        record = get_collective(node)
        if record is not None and record.module_fqn in QUANTIZED:
            assert fp8conf.get_provenance(node).module_fqn == record.module_fqn, node.name


@pytest.mark.parametrize("on", [True, False], ids=["float8_all_gather", "high_precision_all_gather"])
def test_validation_counts_fp8_compute_per_module_as_unsharded(mesh, on):
    _, gm = _traced(mesh, on)
    sharded = fp8conf.validate_fp8_graph(gm)
    plain = fp8conf.validate_fp8_graph(fp8conf.trace_joint(_model(on), (torch.randn(8, 32, requires_grad=True),)))
    assert sharded.compute_counts == plain.compute_counts and not sharded.findings
    assert set(sharded.compute_counts) == {(fqn, p) for fqn in QUANTIZED for p in ("forward", "backward")}


@pytest.mark.parametrize("on", [True, False], ids=["float8_all_gather", "high_precision_all_gather"])
def test_regions_never_span_a_collective(mesh, on):
    _, gm = _traced(mesh, on)
    regions = fp8conf.tag_fp8_regions(gm)  # strict: an incomplete region would raise
    assert len(regions) == 2 * len(QUANTIZED) and all(r.complete for r in regions)
    for region in regions:
        nodes = set(region.nodes)
        assert not any(is_collective(n) for n in nodes), region.id
        # Nothing upstream of a collective whose result the region reads is in the region.
        for node in nodes:
            for value in node.all_input_nodes:
                if is_collective(value):
                    assert not nodes & _ancestors(value), (region.id, value.name)


def _ancestors(node):
    found, stack = set(), list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n not in found:
            found.add(n)
            stack.extend(n.all_input_nodes)
    return found


def test_the_fp8_gather_lands_in_the_region_as_gathered_bytes(mesh):
    _, gm = _traced(mesh, True)
    regions = {r.id: r for r in fp8conf.identify_fp8_regions(gm)}
    forward = regions["blocks.0.up/forward/call0/0"]
    views = [n for n in forward.nodes if str(n.target) == "aten.view.dtype"]
    assert views and all(is_collective(v.args[0]) for v in views)  # uint8 from the gather, viewed as FP8
    assert fp8conf.op_roles(gm.graph)[views[0]] is fp8conf.OpRole.OTHER  # a dtype view is no cast


@pytest.mark.parametrize("on", [True, False], ids=["float8_all_gather", "high_precision_all_gather"])
def test_the_split_keeps_each_collective_on_its_side(mesh, on):
    _, gm = _traced(mesh, on)
    split = fp8conf.split_stage(gm)
    where = {}
    for part, callable_gm in split.parts.items():
        for node in callable_gm.graph.nodes:
            record = get_collective(node)
            if record is not None:
                where.setdefault((record.op, record.parameter), []).append(part)
    assert where, "collectives survive the split with their records"
    for (op, parameter), parts in where.items():
        assert len(parts) == 1, (op, parameter, parts)  # never duplicated across a cut
        expected = "forward" if op in ("all_gather", "all_reduce") else "backward_weight"
        assert parts[0] == expected, (op, parameter, parts)
    fwd_records = [get_collective(n) for n in gm.graph.nodes if get_collective(n) is not None]
    assert len(fwd_records) == sum(len(p) for p in where.values())
    # Where torch's export returns a sharded gradient's mesh (torch 2.13 does, 2.11 not), the joint
    # graph passes a primal through; the split takes it from the primals.
    flat, _ = pytree.tree_flatten(gm.graph.find_nodes(op="output")[0].args[0], is_leaf=lambda x: x is None)
    passed = [i for i, v in enumerate(flat) if isinstance(v, torch.fx.Node) and v.op == "placeholder"]
    assert [i for i, slot in enumerate(split.output_layout) if slot and slot[0] == "primal"] == passed


def test_the_signature_covers_float8_all_gather(mesh):
    on = fp8conf.QuantizationSignature.from_model(shard_data_parallel(_model(True), mesh))
    again = fp8conf.QuantizationSignature.from_model(shard_data_parallel(_model(True), mesh))
    off = fp8conf.QuantizationSignature.from_model(shard_data_parallel(_model(False), mesh))
    unsharded = fp8conf.QuantizationSignature.from_model(_model(True))
    assert on == again and on.sha256 == again.sha256
    assert len({on.sha256, off.sha256, unsharded.sha256}) == 3
    changed = {path for path, _, _ in on.diff(off)}
    assert {f"parallel.all_gather.{fqn}.weight" for fqn in QUANTIZED} <= changed
    assert "parallel" not in unsharded.to_dict() and on.to_dict()["parallel"]["kind"] == "data_parallel"
    assert fp8conf.QuantizationSignature.from_json(on.to_json()) == on
    assert "all-gathered as FP8" in on.summary()


@pytest.mark.parametrize("on", [True, False], ids=["float8_all_gather", "high_precision_all_gather"])
def test_weight_all_gathers_match_the_setting(mesh, on):
    _, gm = _traced(mesh, on)
    report = validate_weight_all_gathers(gm)
    kind = "float8" if on else "high_precision"
    assert report.gathers == {(fqn, kind): 1 for fqn in QUANTIZED} and report.ok


def test_a_high_precision_gather_with_float8_all_gather_on_is_an_error_naming_module_and_node(mesh):
    # The silent loss users report: float8 all-gather on, weights gathered in high precision.
    _, gm = _traced(mesh, False)
    with pytest.raises(fp8conf.WeightAllGatherError) as caught:
        validate_weight_all_gathers(gm, float8_all_gather=True)
    error = caught.value
    assert error.module_fqn == "blocks.0.up" and error.pass_name == "forward" and error.property_id == "DP-001"
    node = next(n for n in gm.graph.nodes if n.name == error.node_name)
    assert get_collective(node).parameter == "blocks.0.up.weight"
    assert "high precision" in str(error) and "blocks.0.up" in str(error) and error.node_name in str(error)
    assert len(error.findings) == len(QUANTIZED)


def test_an_fp8_gather_with_float8_all_gather_off_is_an_error(mesh):
    _, gm = _traced(mesh, True)
    with pytest.warns(fp8conf.FP8ValidationWarning, match="moves FP8 bytes although float8 all-gather is off"):
        report = validate_weight_all_gathers(gm, float8_all_gather=False, strict=False)
    assert {f.module_fqn for f in report.findings} == set(QUANTIZED)
    assert {f.property_id for f in report.findings} == {"DP-002"}  # the spec's rule for FP8 gathered with it off


def test_an_unannotated_gather_is_attributed_through_the_graph(mesh):
    # A graph whose gathers carry no record (another tracer's) is still checked.
    _, gm = _traced(mesh, False)
    for node in gm.graph.nodes:
        node.meta.pop("fp8conf_collective", None)
    with pytest.raises(fp8conf.WeightAllGatherError, match="blocks.0.up.weight"):
        validate_weight_all_gathers(gm, float8_all_gather=True)


def test_a_dropped_gather_is_reported(mesh):
    _, gm = _traced(mesh, True)
    layout = fp8conf.trace_info(gm).layout
    renamed = dataclasses.replace(layout, parameters=tuple(
        dataclasses.replace(p, fqn=p.fqn + "_elsewhere") if p.fqn == "blocks.1.down.weight" else p for p in layout.parameters
    ))
    gm.meta["fp8conf_trace"] = dataclasses.replace(fp8conf.trace_info(gm), layout=renamed)
    with pytest.raises(fp8conf.WeightAllGatherError, match="never all-gathered"):
        validate_weight_all_gathers(gm)


def test_the_layout_is_recorded_on_model_and_graph(mesh):
    model, gm = _traced(mesh, True)
    layout = layout_of(model)
    assert isinstance(layout, ParallelLayout) and layout.world_size == WORLD and layout.float8_all_gather
    assert fp8conf.trace_info(gm).layout == layout
    weight = model.blocks[0].up.weight  # outside forward: the shard, as under FSDP2
    assert weight.to_local().shape == (64, 32) and weight.shape == (128, 32)


def test_sharding_refuses_what_it_cannot_do(mesh):
    with pytest.raises(fp8conf.FP8ConfigError, match="'blocks.0.up'.*enable_fsdp_float8_all_gather=False"):
        shard_data_parallel(_model(False), mesh, float8_all_gather=True)
    odd = torch.nn.Sequential(torch.nn.Linear(8, 7))
    with pytest.raises(fp8conf.FP8ConfigError, match="'0.weight' of shape \\(7, 8\\)"):
        shard_data_parallel(odd, mesh)
    tied = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    tied[1].weight = tied[0].weight
    with pytest.raises(fp8conf.FP8ConfigError, match="'1.weight' is the same tensor as '0.weight'"):
        shard_data_parallel(tied, mesh)
    with pytest.raises(fp8conf.FP8ConfigError, match="no parallel layout"):
        validate_weight_all_gathers(fp8conf.trace_joint(_model(True), (torch.randn(8, 32),)))


@pytest.mark.slow
@pytest.mark.parametrize("on", [True, False], ids=["float8_all_gather", "high_precision_all_gather"])
def test_sharded_gradients_match_the_unsharded_step_over_gloo(on):
    from fp8conf.tools.sharded_check import launch

    check = launch(float8_all_gather=on, ranks=2, dim=32, blocks=2, tokens=16, repeats=1, compile="regional" if on else None)
    assert check.validated and check.traced_equals_eager and check.same_batch_bitwise, check.summary()
    assert check.compile is None or check.compiled_max_abs_diff <= 1e-4, check.summary()
    assert check.split_batch_error <= check.tolerance, check.summary()
    weights = 2 * 2 * 32 * 128  # four quantized weights per step
    assert check.all_gather_bytes_float8 == (weights if on else 0), check.summary()


def test_what_sharded_steps_do_not_support_yet_is_refused(mesh):
    model = shard_data_parallel(_model(True), mesh)
    with pytest.raises(fp8conf.FP8TraceError, match="of a sharded model: the copied blocks"):
        fp8conf.trace_joint(model, (torch.randn(8, 32),), repeat="blocks")
    gm = fp8conf.trace_joint(model, (torch.randn(8, 32),))
    from fp8conf.artifacts.envelope import describe_graph

    with pytest.raises(fp8conf.ArtifactError, match="parameter 'blocks.0.norm.weight' is a tensor subclass"):
        describe_graph(gm)
    # Named as what it is, before Inductor meets the process-group inputs.
    with pytest.raises(fp8conf.FP8ConfigError, match=r"sharded step \(\d+ collectives: .*all_gather.*fully compiled sharded step is not supported.*mode='regional'"):
        fp8conf.compile_joint(gm, mode="full")


@pytest.mark.parametrize(("recipe", "on", "emulate"), [
    ("rowwise", False, False), ("rowwise_with_gw_hp", False, False), ("tensorwise", True, True), ("tensorwise", False, True),
])
def test_other_recipes_and_emulation_trace_and_validate_sharded(mesh, recipe, on, emulate):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from fp8conf.tools.example_models import build_stack

    model = build_stack(32, 1, recipe=None, seed=0)
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), enable_fsdp_float8_all_gather=on, emulate=emulate)
    model = shard_data_parallel(convert_to_float8_training(model, config=config, module_filter_fn=lambda m, f: f != "head"), mesh)
    gm = fp8conf.trace_joint(model, (torch.randn(8, 32, requires_grad=True),))
    assert fp8conf.validate_fp8_graph(gm).ok
    assert validate_weight_all_gathers(gm).gathers == {(fqn, "float8" if on else "high_precision"): 1 for fqn in ("blocks.0.up", "blocks.0.down")}
    regions = fp8conf.tag_fp8_regions(gm)
    assert all(r.complete for r in regions) and len(regions) == (0 if emulate else 4)


def test_torchao_float8_tensor_parallel_hooks_carry_their_modules_provenance(mesh):
    # Float8ColwiseParallel casts the module's input to FP8 in a forward pre-hook, outside
    # forward: the cast belongs to the module's call, so its FP8 regions are complete.
    from torch.distributed.tensor.parallel import parallelize_module
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(32, 128, bias=False)
            self.down = torch.nn.Linear(128, 32, bias=False)

        def forward(self, x):
            return self.down(torch.relu(self.up(x)))

    model = convert_to_float8_training(MLP(), config=Float8LinearConfig.from_recipe_name("tensorwise"))
    parallelize_module(model, mesh, {"up": Float8ColwiseParallel(), "down": Float8RowwiseParallel()})
    gm = fp8conf.trace_joint(model, (torch.randn(16, 32, requires_grad=True),))
    assert fp8conf.validate_fp8_graph(gm).ok
    regions = fp8conf.tag_fp8_regions(gm)
    assert len(regions) == 4 and all(r.complete for r in regions)
    casts = [n for n, role in fp8conf.op_roles(gm.graph).items() if role is fp8conf.OpRole.CAST and node_passes(gm.graph)[n] == "forward"]
    assert casts and all(fp8conf.get_provenance(n) is not None for n in casts)
    assert len(model.up._forward_pre_hooks) == 1 and len(model.up._forward_hooks) == 1  # TP's own, nothing more
    records = [get_collective(n) for n in gm.graph.nodes if get_collective(n) is not None]
    assert records and all(r.parameter is None and r.moves is None for r in records)
    assert {"up", "down"} <= {r.module_fqn for r in records}


class _ReadsItsWeightUnderNoGradFirst(torch.nn.Linear):
    """A trainer's linear that computes its weight's scale under ``no_grad`` before using the
    weight in its matmul: the first read of the gathered weight is under ``no_grad``."""

    def forward(self, x):
        with torch.no_grad():
            scale = self.weight.abs().amax()
        return x @ (self.weight / scale).t()


def test_a_weight_first_read_under_no_grad_is_still_gathered_with_autograd(mesh):
    torch.manual_seed(0)
    model = torch.nn.Sequential(_ReadsItsWeightUnderNoGradFirst(32, 16, bias=False))
    shard_data_parallel(model, mesh)
    gm = fp8conf.trace_joint(model, (torch.randn(8, 32, requires_grad=True),))
    scatters = [n for n in gm.graph.nodes if "reduce_scatter" in str(n.target)]
    # The weight's gradient goes back to its shard through the gather's reduce-scatter.
    assert len(scatters) == 1 and get_collective(scatters[0]).parameter == "0.weight"
