"""The depth benchmark's grouped-experts model (``benchmarks/llama.py`` with ``ffn="experts"``) and
how ``benchmarks/bench_depth.py`` reads its rows: the experts' FP8 grouped GEMMs are in fp8conf's
joint graph, named by module and pass, and a row written before ``--ffn`` existed reads as dense."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import fp8conf
from fp8conf.errors import GroupedExpertsError
from fp8conf.graph.roles import is_fp8_compute
from fp8conf.quantized.grouped import Float8GroupedExperts

sys.path.append(str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_depth  # noqa: E402  benchmarks/, on sys.path above
from llama import build_llama  # noqa: E402

DIM, BLOCKS, HEADS, VOCAB, TOKENS = 32, 2, 2, 64, 16
EXPERTS = ("experts_up", "experts_down")


def _experts_llama(emulate: bool):
    return build_llama(DIM, BLOCKS, "rowwise", device="cpu", heads=HEADS, vocab=VOCAB, ffn="experts", tokens=TOKENS,
                       emulate_experts=emulate)


def _tokens():
    return torch.randint(0, VOCAB, (1, TOKENS), generator=torch.Generator().manual_seed(0))


def test_an_experts_llama_steps_eagerly_and_its_grouped_gemms_are_fp8_compute_in_the_joint_graph():
    # Eagerly on CPU the experts are emulated (torch has no CPU FP8 grouped GEMM): one training step.
    model = _experts_llama(emulate=True)
    experts = {fqn: m for fqn, m in model.named_modules() if isinstance(m, Float8GroupedExperts)}
    assert sorted(experts) == sorted(f"layers.{i}.feed_forward.moe.{name}" for i in range(BLOCKS) for name in EXPERTS)
    assert all(m.recipe == "rowwise" and m.emulate for m in experts.values())
    assert model.layers[0].feed_forward.moe.router.weight.dtype == torch.bfloat16
    assert type(model.layers[0].feed_forward.moe.router) is torch.nn.Linear  # the router stays high precision
    out = model(_tokens())
    out.float().square().mean().backward()
    assert out.shape == (1, TOKENS, VOCAB)
    assert all(m.weight.grad is not None and torch.isfinite(m.weight.grad).all() for m in experts.values())

    # Real FP8 experts trace with fake tensors: each call's forward GEMM and both backward ones.
    traced = _experts_llama(emulate=False)
    gm = fp8conf.trace_joint(traced, (_tokens(),))
    grouped = [n for n in gm.graph.nodes if n.op == "call_function" and is_fp8_compute(n) and "grouped" in str(n.target)]
    assert len(grouped) == 3 * 2 * BLOCKS
    counts = fp8conf.validate_fp8_graph(gm, strict=True).compute_counts
    for i in range(BLOCKS):
        for name in EXPERTS:
            fqn = f"layers.{i}.feed_forward.moe.{name}"
            assert (counts.get((fqn, "forward")), counts.get((fqn, "backward"))) == (1, 2), fqn


def test_experts_have_no_tensorwise_recipe_and_say_so():
    with pytest.raises(GroupedExpertsError, match="recipe must be one of"):
        build_llama(DIM, 1, "tensorwise", device="cpu", heads=HEADS, vocab=VOCAB, ffn="experts", tokens=TOKENS)


def test_a_row_without_ffn_reads_as_dense_and_rows_are_drawn_per_feed_forward():
    old = {"path": "fp8conf regional", "recipe": "tensorwise", "blocks": 2, "device": "cpu", "first_step_s": 1.0}
    experts = dict(old, recipe="rowwise", ffn="experts", experts=4, top_k=2, experts_emulated=True, first_step_s=2.0)
    failed = dict(experts, path="torch.compile", error="BackendCompilerFailed: ...")
    del failed["first_step_s"]
    rows = [old, experts, failed]
    assert bench_depth.row_ffn(old) == "dense" and bench_depth.ffn_label(old) == "dense"
    assert bench_depth.select_rows(rows, "cpu", "dense") == [old]
    assert bench_depth.select_rows(rows, "cpu", "experts") == [experts, failed]
    assert bench_depth.select_rows(rows, "cuda", "dense") == []
    text = bench_depth.table(rows)
    assert "| tensorwise | dense | fp8conf regional | 2 |" in text
    assert "| rowwise | experts (4 experts, top-2, emulated) | torch.compile | 2 |" in text and "BackendCompilerFailed" in text
    svg = bench_depth.plot_svg(rows, "t")
    assert "fp8conf regional (rowwise, experts (4 experts, top-2, emulated))" in svg
