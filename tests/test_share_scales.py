"""Backward FP8 regions take the scales their forward computed (fp8conf/compile/share_scales.py):
after the regional cut no node of a backward region repeats one of its own region or a scale
of the forward, each takes one amax (its output gradient's), what the backward takes from a
forward region is never a cast tensor, and every region stays complete. On a Llama traced from
TorchAO's Float8Linear; that the cut graphs still compute the joint graph's values bit for bit
is tests/test_block_saves.py's."""

from __future__ import annotations

import functools

import torch

from fp8conf.compile.partition import partition_joint
from fp8conf.graph.regions import identify_fp8_regions
from fp8conf.graph.roles import is_fp8_dtype
from fp8conf.graph.trace import flat_graph_module
from llama_model import traced_llama  # tests/ is on sys.path (tests/conftest.py)


@functools.lru_cache(maxsize=None)
def _cut():
    _, _, gm = traced_llama(2)
    return gm, partition_joint(flat_graph_module(gm), keep_fp8_regions=True)


def _key(node):
    """Op, inputs (by name: the forward's appear in the backward as placeholders of that name)
    and arguments."""
    def plain(a):
        if isinstance(a, torch.fx.Node):
            return a.name
        if isinstance(a, (list, tuple)):
            return tuple(map(plain, a))
        return (type(a).__name__, a)

    return str(node.target), plain(node.args), plain(tuple(sorted(node.kwargs.items())))


def _operand_limit(region) -> int:
    """The fewest elements of an FP8 operand of the region's matmuls: a scale has fewer."""
    return min(a.meta["val"].numel() for c in region.compute_nodes for a in c.args[:2])


def _small(node, limit) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.numel() < limit and not is_fp8_dtype(value.dtype)


def _view_of_an_input(node) -> bool:
    """A view (the weight's transpose) of a graph input: it keeps no bytes of its own."""
    while node.op == "call_function":
        returns = node.target._schema.returns
        if not (len(returns) == 1 and returns[0].alias_info is not None):
            return False
        node = node.args[0]
    return node.op == "placeholder"


def test_a_backward_region_repeats_nothing_of_its_own_or_of_its_forwards_scales():
    _, parts = _cut()
    forward_nodes = {}
    for node in parts.forward.graph.nodes:
        if node.op == "call_function":
            forward_nodes.setdefault(_key(node), node)
    regions = [r for r in identify_fp8_regions(parts.backward) if r.pass_name == "backward"]
    assert regions
    for region in regions:
        limit = _operand_limit(region)
        seen = {}
        for node in region.nodes:
            key = _key(node)
            assert key not in seen, f"backward region {region.id}: '{node.name}' repeats '{seen[key].name}' ({node.target})"
            seen[key] = node
            twin = forward_nodes.get(key)
            assert not (twin is not None and _small(node, limit)), (
                f"backward region {region.id}: '{node.name}' ({node.target}) computes again the forward's '{twin.name}'")
        # The weight's and the input's amax (the input reshaped to 2-D here) are the forward's.
        amaxes = [n.name for n in region.nodes if n.target is torch.ops.aten.max.default]
        assert len(amaxes) == 1, f"backward region {region.id} takes {len(amaxes)} amaxes, not only its output gradient's: {amaxes}"


def test_the_backward_takes_scales_from_a_forward_region_never_a_cast_tensor():
    gm, parts = _cut()
    joint = flat_graph_module(gm)
    joint_nodes = {n.name: n for n in joint.graph.nodes}
    forward_region_nodes = {n.name: r for r in identify_fp8_regions(joint) if r.pass_name == "forward" for n in r.nodes}
    taken = 0
    for region in identify_fp8_regions(parts.backward):
        assert region.complete, f"{region.id}: {region.reason}"
        limit = _operand_limit(region)
        for node in region.nodes:
            for value in node.all_input_nodes:
                if value.name in forward_region_nodes and value not in region.nodes and not _view_of_an_input(joint_nodes[value.name]):
                    taken += 1
                    assert _small(value, limit), (
                        f"backward region {region.id}: '{node.name}' reads '{value.name}' of "
                        f"{forward_region_nodes[value.name].id}, {value.meta['val'].numel()} elements")
    assert taken, "no backward region takes a scale from its forward"
