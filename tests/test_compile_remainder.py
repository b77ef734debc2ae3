"""Regional compilation of the rest of the graph (compile_joint's ``remainder``): by default
(``"inductor"``) each FP8 region is compiled together with the nodes around it, in units that
hold whole regions of one repeated block, each structurally distinct unit once; with
``"pieces"`` the regions alone and the nodes between them in pieces; either way the result
matches the eager joint graph; ``remainder="eager"`` compiles exactly the tagged regions. On CPU,
on the block stack (LayerNorm, GELU, residual add)."""

from __future__ import annotations

import functools
import operator
import weakref

import pytest
import torch

import fp8conf
from fp8conf.compile.partition import partition_joint
from fp8conf.compile.region_compile import compile_regions
from fp8conf.graph.regions import tag_fp8_regions
from fp8conf.graph.provenance import get_block, repeated_block
from fp8conf.compile.remainder import blocks_from_regions, remainder_pieces
from fp8conf.graph.roles import is_fp8_dtype
from fp8conf.graph.trace import flat_graph_module
from stack_steps import DIM, TOKENS, assert_matches_eager, traced

# Per stack, four structurally distinct regions (up and down projection, forward and backward).
DISTINCT_REGIONS_PER_STACK = 4


def _tagged(gm) -> set[str]:
    return {n.name for r in fp8conf.tag_fp8_regions(flat_graph_module(gm)) if r.complete for n in r.nodes}


def _call_functions(gm) -> dict[str, torch.fx.Node]:
    return {n.name: n for n in gm.graph.nodes if n.op == "call_function"}


@pytest.fixture(scope="module")
def stack():
    """A two-block stack, its joint graph and that graph compiled regionally with its remainder."""
    model, x, gm = traced(2)
    return model, x, gm, fp8conf.compile_joint(gm, mode="regional")


def test_the_remainder_between_the_regions_is_compiled(stack):
    _, _, gm, compiled = stack
    nodes, tagged = _call_functions(gm), _tagged(gm)
    assert tagged < set(compiled.compiled_nodes), "every tagged region is compiled, and more"
    assert compiled.compiled_nodes | compiled.eager_nodes == set(nodes) and not compiled.compiled_nodes & compiled.eager_nodes
    # The norms' backward and the residual adds now run compiled.
    for op in ("native_layer_norm_backward", "add"):
        found = [name for name, n in nodes.items() if str(n.target).startswith(f"aten.{op}.")]
        assert found and set(found) <= compiled.compiled_nodes, f"{op}: {sorted(set(found) - compiled.compiled_nodes)} left eager"
    # What stays eager and computes stands alone between compiled calls (a forward GELU between
    # two regions): no eager op feeds another, which a fused kernel would have saved.
    computing = {n for name, n in nodes.items() if name in compiled.eager_nodes and _computes(n)}
    for node in computing:
        assert not computing & {*node.all_input_nodes, *node.users}, f"{node.name} is left eager next to another eager op"


def _computes(node) -> bool:
    returns = getattr(node.target, "_schema", None) and node.target._schema.returns
    return bool(returns) and not (len(returns) == 1 and returns[0].alias_info is not None)


def test_the_compiled_remainder_matches_eager_over_two_steps(stack):
    model, x, gm, compiled = stack
    for step in range(2):  # a shared compiled piece must not keep one call site's values
        assert_matches_eager(gm, model, x, compiled.fn, seed=step)


def test_each_distinct_unit_compiles_once_whatever_the_depth(inductor_calls):
    counts = {}
    for blocks in (3, 4):  # first, middle and last blocks differ; the middle ones are alike
        inductor_calls.clear()
        _, _, gm = traced(blocks)
        compiled = fp8conf.compile_joint(gm, mode="regional")
        assert len(inductor_calls) == compiled.inductor_compiles
        counts[blocks] = compiled.inductor_compiles
    assert counts[3] == counts[4], counts


def _call_sites(compiled) -> int:
    return sum(1 for graph in compiled.artifact for n in graph.graph.nodes if hasattr(n.target, "__wrapped__"))


def test_units_hold_whole_regions_of_one_block():
    _, _, gm = traced(3)
    parts = partition_joint(flat_graph_module(gm), keep_fp8_regions=True)
    for graph in (parts.forward, parts.backward):
        regions = [r for r in tag_fp8_regions(graph) if r.complete]
        blocks = {n: get_block(n) for n in graph.graph.nodes}
        assert {b for b in blocks.values() if b} == {"blocks.0", "blocks.1", "blocks.2"}, "trace_joint records each node's block"
        units = remainder_pieces(graph, regions=[r.nodes for r in regions], blocks=blocks)
        unit_of = {n: i for i, unit in enumerate(units) for n in unit}
        assert len(unit_of) == sum(map(len, units)), "a node in two units"
        for region in regions:
            homes = {unit_of.get(n) for n in region.nodes}
            assert len(homes) == 1 and None not in homes, f"region {region.id} split over units {homes}"
        for unit in units:
            known = {blocks[n] for n in unit if blocks[n] is not None}
            assert len(known) <= 1, f"a unit from {unit[0].name} spans blocks {sorted(known)}"
        assert len(units) < len(regions), "units hold several regions each"


def test_a_graph_without_blocks_takes_them_from_its_regions():
    _, _, gm = traced(3)
    parts = partition_joint(flat_graph_module(gm), keep_fp8_regions=True)
    graph = parts.forward
    regions = [r for r in tag_fp8_regions(graph) if r.complete]
    guessed = blocks_from_regions(graph, [r.nodes for r in regions], [repeated_block(r.module_fqn) for r in regions])
    recorded = {n: get_block(n) for n in graph.graph.nodes}
    for region in regions:
        assert {guessed[n] for n in region.nodes} == {recorded[region.compute_nodes[0]]}
    norms = [n for n in graph.graph.nodes if n.target == torch.ops.aten.native_layer_norm.default]
    assert [guessed[n] for n in norms] == [recorded[n] for n in norms] == ["blocks.0", "blocks.1", "blocks.2"]


def test_pieces_compile_each_region_alone_and_match_eager(stack, inductor_calls):
    model, x, gm, default = stack
    compiled = fp8conf.compile_joint(gm, mode="regional", remainder="pieces")
    complete = [r for r in compiled.regions if r.complete]
    assert _call_sites(compiled) > len(complete) > _call_sites(default)
    assert _tagged(gm) < set(compiled.compiled_nodes)
    assert_matches_eager(gm, model, x, compiled.fn, seed=0)


def test_repeated_blocks_are_named_up_to_the_first_index():
    assert repeated_block("layers.3.attention.wq") == "layers.3"
    assert repeated_block("blocks.0") == "blocks.0"
    assert repeated_block("output") == "output"
    assert repeated_block("encoder.proj") == "encoder.proj"


def test_an_eager_remainder_compiles_exactly_the_tagged_regions(inductor_calls):
    model, x, gm = traced(2)
    compiled = fp8conf.compile_joint(gm, mode="regional", remainder="eager")
    assert set(compiled.compiled_nodes) == _tagged(gm)
    assert len(inductor_calls) == compiled.inductor_compiles == DISTINCT_REGIONS_PER_STACK
    assert_matches_eager(gm, model, x, compiled.fn, seed=0)


def test_unknown_remainders_are_refused():
    _, _, gm = traced(1)
    with pytest.raises(fp8conf.FP8ConfigError, match="remainder='fused'"):
        fp8conf.compile_joint(gm, mode="regional", remainder="fused")


def test_pieces_hold_no_fp8_value_and_no_region_output_tuple():
    _, _, gm = traced(2)
    parts = partition_joint(flat_graph_module(gm))
    for graph in (parts.forward, parts.backward):
        found = tag_fp8_regions(graph)
        compile_regions(graph, [r for r in found if r.complete], {}, error=lambda region, exc: exc)
        pieces = remainder_pieces(graph)
        assert pieces
        for piece in pieces:
            for node in piece:
                values = node.meta["val"] if isinstance(node.meta["val"], tuple) else (node.meta["val"],)
                assert not any(is_fp8_dtype(v.dtype) for v in values), node.name
                if node.target is operator.getitem:
                    assert node.args[0] in piece, f"{node.name} picks from a tuple made outside its piece"
                else:
                    assert all(isinstance(i.meta.get("val"), torch.Tensor) for i in node.all_input_nodes), node.name


def test_nodes_kept_eager_stay_out_of_every_piece():
    _, _, gm = traced(2)
    flat = flat_graph_module(gm)
    everything = {n for piece in remainder_pieces(flat) for n in piece}
    kept = {n.name for n in everything if n.target == torch.ops.aten.gelu.default}
    assert kept
    assert not kept & {n.name for piece in remainder_pieces(flat, keep_eager=kept) for n in piece}


def test_the_regional_backward_frees_saved_values_as_it_goes(monkeypatch):
    """The backward graph takes its inputs boxed and hands each compiled call its inputs as one
    list, which the call empties: a saved value that only the first call reads is freed by the
    time that call returns, not held by the caller, the graph or the list until the whole
    backward returns."""
    from fp8conf.compile import region_compile

    roles, refs, dead_after_first, held = {}, [], [], set()
    make_call = region_compile.region_call

    def spying_region_call(compiled, fast=None):
        region = make_call(compiled, fast)
        boxed = region.boxed

        @functools.wraps(boxed)
        def spy(args):
            role = roles.get(spy)
            if role is not None:
                refs[:] = [weakref.ref(args[k]) for k in role if id(args[k]) not in held]
            out = boxed(args)
            if role is not None:
                dead_after_first.append((len(refs), sum(r() is None for r in refs)))
            return out

        region.boxed = spy
        return region

    monkeypatch.setattr(region_compile, "region_call", spying_region_call)
    model, x, gm = traced(3)
    compiled = fp8conf.compile_joint(gm, mode="regional")
    backward = compiled.artifact[1]
    first = next(n for n in backward.graph.nodes if n.op == "call_function" and hasattr(n.target, "__wrapped__"))
    (packed,) = first.args
    read_later = {i for n in backward.graph.nodes if n not in (first, packed) for i in n.all_input_nodes}
    only_first = [k for k, i in enumerate(packed.args) if i.op == "placeholder" and i not in read_later]
    assert only_first, "the first backward call reads saved values no later node reads"
    roles[first.target] = only_first
    primals, tangents = fp8conf.joint_signature(gm).feed(model, (x,), (torch.randn(TOKENS, DIM),))
    held.update(map(id, [*primals, *tangents]))  # the caller's own: parameters, batch, output gradient
    for _ in range(2):  # the first step calls through the artifact, the second through Inductor's code
        compiled.fn(primals, tangents)
    assert len(dead_after_first) == 2 and all(n and dead == n for n, dead in dead_after_first), \
        f"(saved values, freed when the first call returned) per step: {dead_after_first}"


def test_units_that_differ_only_in_the_values_leaving_them_compile_once(inductor_calls):
    """The partitioner may save other values of one block than of the others; two units that
    compute the same nodes and export different ones share one compile, and each call site still
    gets its own values."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fp8conf.compile.region_compile import cut_pieces

    def step(x, y):
        a1 = torch.sin(x) * 2 + 1  # the first unit's sum leaves it
        m2 = torch.sin(y) * 2
        a2 = m2 + 1  # the second's product leaves it too
        return torch.cos(a1), torch.cos(m2) * a2

    x, y = torch.randn(8, 16), torch.randn(8, 16)
    gm = make_fx(step, tracing_mode="fake")(x, y)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    by_name = {n.name: n for n in nodes}
    units = [[by_name["sin"], by_name["mul"], by_name["add"]], [by_name["sin_1"], by_name["mul_1"], by_name["add_1"]]]
    expected = step(x, y)

    def error(piece, exc):
        raise AssertionError(f"unit {piece} failed to compile") from exc

    fn = cut_pieces(gm, units, {}, error).bind()
    assert len(inductor_calls) == 1, f"{len(inductor_calls)} compiles for two units that differ only in their outputs"
    got = fn(x, y)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)


def test_equal_units_whose_independent_nodes_the_graph_orders_otherwise_compile_once(inductor_calls):
    """Two equal blocks, the second's independent branches traced the other way round (as torch
    2.11's joint graph orders a SwiGLU backward's two products in some blocks): one compile,
    and each call gets its own block's values."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fp8conf.compile.region_compile import cut_pieces

    def step(x, a1, b1, a2, b2):
        u1 = torch.sin(x * a1)  # first block: the product's branch first
        v1 = torch.cos(x + b1)
        h = u1 * v1 - b1
        v2 = torch.cos(h + b2)  # second block: the sum's branch first
        u2 = torch.sin(h * a2)
        return (u2 * v2 - b2,)

    args = [torch.randn(8, 16) for _ in range(5)]
    gm = make_fx(step, tracing_mode="fake")(*args)
    body = [n for n in gm.graph.nodes if n.op == "call_function"]
    units = [body[:6], body[6:]]
    assert [str(n.target) for n in units[0]] != [str(n.target) for n in units[1]]  # traced in other orders
    expected = step(*args)

    def error(piece, exc):
        raise AssertionError(f"unit {piece} failed to compile") from exc

    fn = cut_pieces(gm, units, {}, error).bind()
    assert len(inductor_calls) == 1, f"{len(inductor_calls)} compiles for two equal blocks"
    torch.testing.assert_close(fn(*args)[0], expected[0])


_ORDER_IN_A_PROCESS = """
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from fp8conf.compile.region_compile import cut_pieces

class Recorded:
    def submit(self, submodule, fake_inputs):
        print(submodule.code)
    def result(self, compiled):
        return compiled
    def close(self):
        pass

def block(x, a, b):
    return torch.sin(x * a) * torch.cos(x + b) - torch.tanh(b * 2) + torch.exp(a) - torch.relu(x)

gm = make_fx(block, tracing_mode="fake")(*[torch.randn(4, 8) for _ in range(3)])
cut_pieces(gm, [[n for n in gm.graph.nodes if n.op == "call_function"]], {}, lambda i, e: e, Recorded())
"""


def test_a_unit_is_put_in_the_same_order_in_every_process():
    """Each rank of a sharded step and each compile worker cuts its own units: their order may
    not depend on the process (string hashes differ from one to the next)."""
    import os
    import subprocess
    import sys

    codes = set()
    for seed in ("1", "2", "3"):
        done = subprocess.run([sys.executable, "-c", _ORDER_IN_A_PROCESS], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONHASHSEED": seed})
        assert done.returncode == 0, done.stderr[-2000:]
        codes.add(done.stdout)
    assert len(codes) == 1, "\n----\n".join(codes)


class _RMSNorm(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class _SwiGLUBlock(torch.nn.Module):
    """A Llama block's FFN half: its backward recomputes the norm and the SiLU product from
    values the forward saved."""

    def __init__(self, dim):
        super().__init__()
        self.norm = _RMSNorm(dim)
        self.w1, self.w2, self.w3 = (torch.nn.Linear(dim, 2 * dim, bias=False), torch.nn.Linear(2 * dim, dim, bias=False),
                                     torch.nn.Linear(dim, 2 * dim, bias=False))

    def forward(self, x):
        h = self.norm(x)
        return x + self.w2(torch.nn.functional.silu(self.w1(h)) * self.w3(h))


@functools.lru_cache(maxsize=None)
def _swiglu_stack(blocks):
    """``(model, x, joint graph)`` of a ``blocks``-block FP8 SwiGLU stack, traced once per depth."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_SwiGLUBlock(DIM) for _ in range(blocks)])
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    x = torch.randn(TOKENS, DIM, requires_grad=True)
    return model, x, fp8conf.trace_joint(model, (x,))


@pytest.mark.parametrize("build", [traced, _swiglu_stack], ids=["stack", "swiglu"])
def test_no_unit_feeds_only_another_unit_of_its_block(build):
    """What a block's backward recomputes from saved values (a norm's statistics, the SiLU
    product) joins the unit that uses it: apart it would be a call, a compile and a buffer of its
    own."""
    _, _, gm = build(3)
    parts = partition_joint(flat_graph_module(gm), keep_fp8_regions=True)
    for graph in (parts.forward, parts.backward):
        regions = [r for r in tag_fp8_regions(graph) if r.complete]
        blocks = {n: get_block(n) for n in graph.graph.nodes}
        units = remainder_pieces(graph, regions=[r.nodes for r in regions], blocks=blocks)
        unit_of = {n: i for i, unit in enumerate(units) for n in unit}
        for unit in units:
            inside = set(unit)
            homes = {unit_of.get(u) for n in unit for u in n.users if u not in inside}
            if len(homes) == 1 and None not in homes:
                (home,) = homes
                block = {blocks[n] for n in unit if blocks[n] is not None}
                assert block != {blocks[n] for n in units[home] if blocks[n] is not None}, (
                    f"unit of {unit[0].name} ({len(unit)} nodes, block {block}) feeds only the unit of {units[home][0].name}")


@pytest.mark.slow
def test_a_swiglu_stack_compiles_as_many_units_at_any_depth_and_matches_eager(inductor_calls):
    counts = {}
    for blocks in (3, 4):
        inductor_calls.clear()
        model, x, gm = _swiglu_stack(blocks)
        compiled = fp8conf.compile_joint(gm, mode="regional")
        counts[blocks] = len(inductor_calls)
        assert_matches_eager(gm, model, x, compiled.fn, seed=0)
    assert counts[3] == counts[4], counts


def _attention_step(dropout_p):
    """A hand-built graph of CUDA's flash attention, forward and backward, on fake tensors (no
    GPU needed to trace it): its results hold ``None`` (sequence offsets) and numbers (maximum
    lengths) beside the tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(q, k, v):
        out = torch.ops.aten._scaled_dot_product_flash_attention(q * 2, k, v, dropout_p, True)
        grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            out[0].sin(), q, k, v, out[0], out[1], out[2], out[3], out[4], out[5], dropout_p, True, out[6], out[7])
        return grads[0].cos()

    with FakeTensorMode():
        q = torch.empty(1, 2, 16, 16, device="cuda", dtype=torch.bfloat16)
        return make_fx(step, tracing_mode="fake")(q, q, q)


def test_attention_without_dropout_joins_the_piece_around_it():
    gm = _attention_step(0.0)
    pieces = remainder_pieces(gm)
    attention = [n for n in gm.graph.nodes if "scaled_dot_product" in str(n.target)]
    assert len(attention) == 2
    assert len(pieces) == 1 and set(attention) <= set(pieces[0]), [[n.name for n in p] for p in pieces]
    inside = set(pieces[0])
    for node in pieces[0]:  # a piece can be cut out: nothing outside reads what it made but the output
        assert all(u in inside or u.op == "output" for u in node.users), node.name
        if node.target is operator.getitem and not isinstance(node.meta.get("val"), torch.Tensor):
            assert not node.users, f"{node.name} hands a number out of the piece"


def test_attention_with_dropout_stays_eager():
    """It draws random numbers, which Inductor would draw otherwise."""
    gm = _attention_step(0.1)
    everything = {n for piece in remainder_pieces(gm) for n in piece}
    seeded = [n for n in gm.graph.nodes if n.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())]
    assert seeded and not everything & set(seeded)


@pytest.mark.parametrize("device, compiled", [("cuda", True), ("cpu", False)])
def test_a_lone_embedding_backward_is_compiled_on_cuda_only(device, compiled):
    """Its eager CUDA kernel sorts the indices and reads back how many differ, holding up every
    launch after it; Inductor makes it a scatter-add. On CPU one op alone gains nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    def backward(grad, indices):
        return torch.ops.aten.embedding_dense_backward(grad, indices, 64, -1, False)

    with FakeTensorMode():
        grad = torch.empty(4, 16, 8, device=device)
        indices = torch.zeros(4, 16, dtype=torch.long, device=device)
        gm = make_fx(backward, tracing_mode="fake")(grad, indices)
    pieces = remainder_pieces(gm)
    held = [n.name for piece in pieces for n in piece if n.target is torch.ops.aten.embedding_dense_backward.default]
    assert bool(held) == compiled, [[n.name for n in p] for p in pieces]
