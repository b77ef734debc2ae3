"""Equal blocks cut alike by the regional partition (fp8conf/compile/block_saves.py): every block
of a Llama saves and recomputes the same values, the first one (fed by the embedding) included,
so that one block's backward compiles once; the result still matches the eager joint graph."""

from __future__ import annotations

import collections

import pytest
import torch

import fp8conf
from fp8conf.compile.assemble import _with_convention, run_partitioned
from fp8conf.compile.partition import partition_joint
from fp8conf.graph.provenance import get_block
from fp8conf.graph.roles import is_fp8_compute
from fp8conf.graph.trace import flat_graph_module
from llama_model import traced_llama as _traced  # tests/ is on sys.path (tests/conftest.py)


def _cut_by_block(flat, parts) -> dict[str, tuple[frozenset, frozenset]]:
    """For each block, the places (index among the block's forward ops) of the values its
    backward takes saved and of those it recomputes."""
    places, counts = {}, collections.Counter()
    for node in flat.graph.nodes:
        if node.op == "call_function" and node.meta.get("partitioner_tag") != "is_backward" and get_block(node):
            places[node.name] = (get_block(node), counts[get_block(node)])
            counts[get_block(node)] += 1
    saved, recomputed = collections.defaultdict(set), collections.defaultdict(set)
    for node in parts.backward.graph.nodes:
        if node.name not in places:
            continue
        block, i = places[node.name]
        if node.op == "placeholder":
            saved[block].add(i)
        elif node.meta.get("partitioner_tag") != "is_backward":
            recomputed[block].add(i)
    return {block: (frozenset(saved[block]), frozenset(recomputed[block])) for block in counts}


@pytest.mark.parametrize("blocks", [2, 3])
def test_every_block_of_a_llama_saves_and_recomputes_the_same_values(blocks):
    _, _, gm = _traced(blocks)
    flat = flat_graph_module(gm)
    cut = _cut_by_block(flat, partition_joint(flat, keep_fp8_regions=True))
    assert len(cut) == blocks
    first, *others = cut.items()
    for block, pattern in others:
        assert pattern == first[1], (
            f"{block} saves {sorted(pattern[0])} and recomputes {sorted(pattern[1])}; {first[0]} saves "
            f"{sorted(first[1][0])} and recomputes {sorted(first[1][1])} (places among each block's forward ops)")


def _assert_step_matches_eager(gm, model, args, fn, *, rtol, atol):
    """``fn``'s logits and gradients against the eager joint graph's, for one output gradient."""
    torch.manual_seed(1)
    grad = (torch.randn_like(model(*args)),)
    (out_e,), grads_e = fp8conf.run_joint(gm, model, args, grad)
    (out_c,), grads_c = fp8conf.run_joint(gm, model, args, grad, fn=fn)
    torch.testing.assert_close(out_c, out_e, rtol=rtol, atol=atol)
    assert grads_c.keys() == grads_e.keys()
    for name in grads_e:
        torch.testing.assert_close(grads_c[name], grads_e[name], rtol=rtol, atol=atol, msg=lambda m: f"grad of {name}: {m}")


def test_the_aligned_cut_run_eagerly_gives_the_joint_graphs_results_bit_for_bit():
    """The rewritten graphs themselves, before any compiler: the value handed over is the one the
    backward recomputed, so nothing may change by a bit."""
    model, args, gm = _traced(3)
    parts = partition_joint(flat_graph_module(gm), keep_fp8_regions=True)
    fn = _with_convention(gm, run_partitioned(parts, parts.forward, parts.backward))
    _assert_step_matches_eager(gm, model, args, fn, rtol=0, atol=0)


def _backward_units_with_block_nodes(graphs) -> list[torch.fx.GraphModule]:
    """The compiled units that hold an FP8 matmul of a block's backward."""
    return [g for g in graphs
            if any(n.meta.get("partitioner_tag") == "is_backward" and is_fp8_compute(n) and (get_block(n) or "").startswith("layers.")
                   for n in g.graph.nodes)]


def test_one_blocks_backward_compiles_once_with_its_attention_and_matches_eager(inductor_calls):
    model, args, gm = _traced(3)
    compiled = fp8conf.compile_joint(gm, mode="regional")
    units = _backward_units_with_block_nodes(inductor_calls)
    assert len(units) == 1, f"{len(units)} backward units of the blocks compiled: {[len(u.graph.nodes) for u in units]} nodes"
    # SDPA without dropout draws nothing: it is compiled with the block around it, forward and
    # backward, instead of cutting each into two units.
    attention = {str(n.target) for g in inductor_calls for n in g.graph.nodes if "scaled_dot_product" in str(n.target)}
    assert len(attention) == 2, f"attention ops in the compiled units: {sorted(attention)}"
    _assert_step_matches_eager(gm, model, args, compiled.fn, rtol=1e-3, atol=1e-5)
