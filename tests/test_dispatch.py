"""The suite's observation of what runs eagerly (conformance/observe/dispatch.py), on small real graphs."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from conformance.observe.dispatch import DispatchCounter, always_generated, dispatches_per_node, equal_computations, observed

aten = torch.ops.aten


def _step(x, w):
    y = torch.nn.functional.linear(x, w).relu()
    scale = 448.0 / y.abs().amax().clamp(min=1e-12)
    return (y * scale).to(torch.float8_e4m3fn), y.abs()


def test_the_counter_sees_each_overload_and_the_casts_to_fp8_while_active():
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    counter = DispatchCounter()
    with counter:
        _step(x, w)
    _step(x, w)  # not counted: the counter is no longer active
    assert counter.counts[aten.abs.default] == 2 and counter.counts[aten.relu.default] == 1
    assert counter.fp8_casts == 1


def test_observed_counts_only_the_wrapped_callable():
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    wrapped, counter = observed(_step)
    torch.relu(x)
    wrapped(x, w)
    assert counter.counts[aten.relu.default] == 1 and counter.fp8_casts == 1


def test_each_node_dispatches_its_own_op_or_what_its_composite_op_decomposes_into():
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    gm = make_fx(_step)(x, w)
    # A node calling the composite aten.linear: eager, it dispatches what linear decomposes into.
    composite = torch.fx.symbolic_trace(lambda x, w: aten.linear.default(x, w).relu())
    per_node = dispatches_per_node(lambda fn: fn(x, w), gm)
    abs_nodes = [n for n in gm.graph.nodes if n.target == aten.abs.default]
    assert len(abs_nodes) == 2 and all(per_node[n] == {aten.abs.default: 1} for n in abs_nodes)
    linear = next(n for n in composite.graph.nodes if n.target == aten.linear.default)
    decomposed = dispatches_per_node(lambda fn: fn(x, w), composite)[linear]
    assert aten.linear.default not in decomposed and sum(decomposed.values()) >= 2, decomposed


def test_equal_computations_share_a_class_and_side_effects_keep_their_own():
    def f(x):
        a, b = x.abs(), x.abs()
        c, d = a + 1, b + 1  # equal once a and b are
        x.add_(1)
        x.add_(1)
        return c, d, torch.rand(2), torch.rand(2)

    gm = make_fx(f)(torch.randn(3))
    classes = equal_computations(gm)
    by_target = {}
    for node, number in classes.items():
        by_target.setdefault(str(node.target), []).append(number)
    assert len(set(by_target["aten.abs.default"])) == 1 and len(set(by_target["aten.add.Tensor"])) == 1
    assert len(set(by_target["aten.add_.Tensor"])) == 2  # mutations are never merged
    assert len(set(by_target["aten.rand.default"])) == 2  # nor random draws


def test_always_generated_means_a_pointwise_op_inductor_lowers_and_never_falls_back_on():
    assert always_generated(aten.abs.default) and always_generated(aten.clamp.default)  # lowered; decomposed
    assert not always_generated(aten.mm.default)  # an extern kernel
    assert not always_generated(aten._to_copy.default)  # not tagged pointwise
    assert not always_generated(aten.digamma.default)  # pointwise, but a fallback kernel
