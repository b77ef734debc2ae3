"""compile_joint's two cold-start and memory levers: structurally identical FP8 regions compile
once, and joint graphs are cut into forward and backward by torch's min-cut partitioner first.
Both are checked against the eager joint graph on CPU."""

from __future__ import annotations


import pytest
import torch

import fp8conf
from fp8conf.compile.partition import partition_joint
from fp8conf.graph.regions import identify_fp8_regions
from fp8conf.graph.trace import flat_graph_module
from fp8conf.tools.example_models import build_stack
from stack_steps import DIM, TOKENS, assert_matches_eager, traced

# Per MLP block, four structurally distinct regions: up and down projection (different shapes),
# forward and backward. Block 0's input needs a gradient like every other block's.
DISTINCT_REGIONS_PER_STACK = 4


@pytest.mark.parametrize("blocks", [2, 4])
def test_identical_regions_compile_once_whatever_the_depth(blocks, inductor_calls):
    model, x, gm = traced(blocks)
    compiled = fp8conf.compile_joint(gm, mode="regional", remainder="eager")
    complete = [r for r in compiled.regions if r.complete]
    assert len(complete) == 4 * blocks  # two linears per block, forward and backward
    assert len(inductor_calls) == compiled.inductor_compiles == DISTINCT_REGIONS_PER_STACK
    for step in range(2):  # a shared compiled region must not keep one call site's values
        assert_matches_eager(gm, model, x, compiled.fn, seed=step)


def test_regions_of_other_shapes_are_not_shared(inductor_calls):
    # A stack whose blocks differ in width: same op sequence, other shapes, so nothing is shared.
    model = torch.nn.Sequential(torch.nn.Linear(32, 64, bias=False), torch.nn.Linear(64, 48, bias=False))
    from torchao.float8 import convert_to_float8_training

    convert_to_float8_training(model)
    x = torch.randn(TOKENS, 32, requires_grad=True)
    gm = fp8conf.trace_joint(model, (x,))
    compiled = fp8conf.compile_joint(gm, mode="regional", remainder="eager")
    assert len(inductor_calls) == compiled.inductor_compiles == len([r for r in compiled.regions if r.complete]) == 4


def test_partitioned_graphs_hold_the_joint_graphs_regions_whole():
    _, _, gm = traced(2)
    joint = {r.id: {n.name for n in r.nodes} for r in identify_fp8_regions(flat_graph_module(gm))}
    parts = partition_joint(flat_graph_module(gm))
    assert parts is not None
    forward = {r.id: {n.name for n in r.nodes} for r in identify_fp8_regions(parts.forward)}
    backward = {r.id: {n.name for n in r.nodes} for r in identify_fp8_regions(parts.backward)}
    assert all("/forward/" in rid for rid in forward) and all("/backward/" in rid for rid in backward)
    # Less what the backward takes from its forward or computes once (fp8conf/compile/share_scales.py).
    assert forward | backward == {rid: names - parts.merged.keys() for rid, names in joint.items()}
    for rid, names in joint.items():
        for name in names & parts.merged.keys():
            twin = parts.merged[name]
            assert "/backward/" in rid and (twin in backward[rid] or twin in forward[rid.replace("/backward/", "/forward/")]), (rid, name, twin)
    assert all(r.complete for g in (parts.forward, parts.backward) for r in identify_fp8_regions(g))


def test_partitioned_regional_compiles_exactly_the_tagged_regions():
    model, x, gm = traced(2)
    probe = flat_graph_module(gm)
    tagged = {n.name for r in fp8conf.tag_fp8_regions(probe) if r.complete for n in r.nodes}
    compiled = fp8conf.compile_joint(gm, mode="regional", remainder="eager")
    assert set(compiled.compiled_nodes) == tagged
    assert compiled.compiled_nodes | compiled.eager_nodes == {n.name for n in gm.graph.nodes if n.op == "call_function"}
    assert_matches_eager(gm, model, x, compiled.fn, seed=0)


def test_partitioned_regional_equals_the_unpartitioned_one():
    model, x, gm = traced(2)
    torch.manual_seed(3)
    args, grad = (torch.randn_like(x).requires_grad_(),), (torch.randn(TOKENS, DIM),)
    one = fp8conf.run_joint(gm, model, args, grad, fn=fp8conf.compile_joint(gm, mode="regional", partition=False, remainder="eager").fn)
    two = fp8conf.run_joint(gm, model, args, grad, fn=fp8conf.compile_joint(gm, mode="regional", remainder="eager").fn)
    # Same compiled regions, same eager remainder, only cut in two: the same arithmetic.
    assert torch.equal(one[0][0], two[0][0])
    assert all(torch.equal(one[1][k], two[1][k]) for k in one[1])


def test_full_compiles_forward_and_backward_through_the_partitioner(inductor_calls):
    model, x, gm = traced(2)
    compiled = fp8conf.compile_joint(gm, mode="full")
    assert len(inductor_calls) == compiled.inductor_compiles == 2
    forward, backward = compiled.artifact
    assert inductor_calls[0].graph.find_nodes(op="placeholder")[0].name.startswith("primals")
    assert any(p.name.startswith("tangents") for p in inductor_calls[1].graph.find_nodes(op="placeholder"))
    for step in range(2):
        assert_matches_eager(gm, model, x, compiled.fn, seed=step)


def test_graphs_without_tangents_are_compiled_whole(inductor_calls):
    # A GraphPP forward callable has no tangents: there is no backward to cut off.
    _, _, gm = traced(1)
    forward = fp8conf.split_stage(gm).parts["forward"]
    assert partition_joint(flat_graph_module(forward)) is None
    compiled = fp8conf.compile_joint(forward, mode="full")
    assert len(inductor_calls) == compiled.inductor_compiles == 1


class _RecordsCollector(torch.nn.Module):
    """A quantized block whose forward records whether Python's garbage collector is enabled."""

    def __init__(self, fail=False):
        super().__init__()
        self.block, self.fail, self.seen = build_stack(DIM, 1), fail, []

    def forward(self, x):
        import gc

        self.seen.append(gc.isenabled())
        if self.fail:
            raise RuntimeError("the model failed")
        return self.block(x)


def test_tracing_and_compiling_pause_the_collector_and_restore_it(monkeypatch):
    """The collector is off while the graph is traced and compiled, and as it was found after,
    a failed trace or compile included."""
    import gc

    import fp8conf.compile.plan as plan_stage
    from fp8conf.errors import FP8TraceError

    assert gc.isenabled()
    model, x = _RecordsCollector(), torch.randn(TOKENS, DIM, requires_grad=True)
    gm = fp8conf.trace_joint(model, (x,))
    assert model.seen and not any(model.seen) and gc.isenabled()
    seen = []

    def first_step_of_compiling(graph):
        seen.append(gc.isenabled())
        raise RuntimeError("stopped here")

    monkeypatch.setattr(plan_stage, "flat_graph_module", first_step_of_compiling)
    with pytest.raises(RuntimeError, match="stopped here"):
        fp8conf.compile_joint(gm)
    assert seen == [False] and gc.isenabled()
    with pytest.raises(FP8TraceError, match="the model failed"):
        fp8conf.trace_joint(_RecordsCollector(fail=True), (x,))
    assert gc.isenabled()
    gc.disable()
    try:
        fp8conf.trace_joint(_RecordsCollector(), (x,))
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_one_regional_compile_finds_the_regions_and_reads_the_joint_signature_once(monkeypatch):
    # Data flows forward: the regions found on the joint graph are handed to the cut and to the
    # tagging of each half, the signature to the cut, the halves and the input check.
    import collections
    import sys

    import fp8conf.graph.regions
    import fp8conf.graph.trace

    _, _, gm = traced(2)
    calls = collections.Counter()
    for owner, name in ((fp8conf.graph.regions, "identify_fp8_regions"), (fp8conf.graph.trace, "joint_signature")):
        real = getattr(owner, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        # Wherever the function was imported by name, lazily or not.
        for module in [m for n, m in list(sys.modules.items()) if n == "fp8conf" or n.startswith("fp8conf.")]:
            if getattr(module, name, None) is real:
                monkeypatch.setattr(module, name, counted)
    compiled = fp8conf.compile_joint(gm, mode="regional")
    assert dict(calls) == {"identify_fp8_regions": 1, "joint_signature": 1}
    # The regions handed on are the ones each half holds: every one tagged, compiled, whole.
    complete = [r for r in compiled.regions if r.complete]
    assert len(complete) == 8 and all(len({n.graph for n in r.nodes}) == 1 for r in complete)
    assert {n.name for r in complete for n in r.nodes} <= compiled.compiled_nodes
    # The same regions as found afresh in each half (less the nodes the cut merged away).
    parts = partition_joint(flat_graph_module(gm))
    afresh = {r.id: {n.name for n in r.nodes} for g in (parts.forward, parts.backward) for r in identify_fp8_regions(g)}
    assert {r.id: {n.name for n in r.nodes} for r in compiled.regions} == afresh


def test_a_cpu_graphs_compile_finds_the_vector_instruction_set_in_a_thread_of_its_own(monkeypatch):
    # Inductor's first C++ kernel would build the instruction-set probes itself (seconds of g++);
    # compile_joint starts that search beside the cut, once per process, for a graph on the CPU only.
    import threading

    from torch._inductor import cpu_vec_isa

    from fp8conf.compile import plan

    asked, pick = [], cpu_vec_isa.pick_vec_isa

    def recorded():
        asked.append(threading.current_thread().name)
        return pick()

    monkeypatch.setattr(cpu_vec_isa, "pick_vec_isa", recorded)
    plan._warm_cpu_codegen.cache_clear()
    try:
        _, _, gm = traced(1)
        on_meta = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
        on_meta.graph.placeholder("x").meta["val"] = torch.empty(2, device="meta")
        on_meta.graph.output(None)
        plan._warm_compile_pool(on_meta)
        assert asked == [] and plan._warm_cpu_codegen.cache_info().currsize == 0, "a graph not on the CPU warmed C++ codegen"
        for _ in range(2):
            fp8conf.compile_joint(gm, mode="regional", remainder="eager")
        for thread in threading.enumerate():
            if thread.name == "fp8conf-cpu-vec-isa":
                thread.join(timeout=60)
        assert asked.count("fp8conf-cpu-vec-isa") == 1, f"the search started more than once per process: {asked}"
    finally:
        plan._warm_cpu_codegen.cache_clear()
