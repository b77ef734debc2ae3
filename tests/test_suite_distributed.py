"""The suite's own reading of sharded graphs (conformance/run/distributed.py), on graphs the reference
traces over torch's fake process group: which all-gathers reach a module's weight, and what they
move, judged from the graph alone (no fp8conf collective record is read)."""

from __future__ import annotations

import pytest
import torch

from conformance.run.distributed import (
    fake_mesh, forward_matmuls, is_all_gather, moves_fp8_bytes, only_views_between, weight_gathers,
)
from conformance.observe.graphs import Fp8Ops, trace_with_oracle
from conformance.draw.models import LayerSpec, ModelSpec, build_model

SPEC = ModelSpec(32, (LayerSpec(64, "tensorwise", bias=True), LayerSpec(32, None), LayerSpec(32, "tensorwise")))
QUANTIZED = ("layers.0", "layers.2")


def _backward(node) -> bool:
    return node.meta.get("partitioner_tag") == "is_backward"


def _traced(on: bool, *, rank: int = 0):
    from conformance.backends.reference import ReferenceBackend

    backend = ReferenceBackend()
    with fake_mesh(rank=rank) as mesh:
        model, args = build_model(SPEC, float8_all_gather=on)
        model = backend.shard_data_parallel(model, mesh, float8_all_gather=on)
        gm, oracle = trace_with_oracle(backend, model, args, list(SPEC.quantized_modules()), _backward)
    return gm, forward_matmuls(gm, oracle, _backward, Fp8Ops())


@pytest.mark.parametrize("on", [True, False], ids=["float8_all_gather", "high_precision_all_gather"])
def test_each_quantized_weight_is_found_gathered_once_moving_what_the_setting_says(on):
    gm, matmuls = _traced(on)
    assert set(QUANTIZED) <= set(matmuls) and "layers.1" not in matmuls  # the plain linear is no quantized module
    for fqn in QUANTIZED:
        gathers = weight_gathers(matmuls[fqn], _backward)
        assert len(gathers) == 1, (fqn, gathers)
        found = gathers[0]
        assert moves_fp8_bytes(found.gather) is on
        assert found.wire_dtype == (torch.uint8 if on else torch.float32)
        # On: the gathered bytes are only viewed as FP8; off: cast to FP8 after the gather.
        computing = only_views_between(found.gather, found.operand)
        assert (not computing) if on else any("_to_copy" in str(n.target) for n in computing), computing
    # The bias and the plain linear's weight are gathered too, in float32, and reach no weight operand.
    gathers = [n for n in gm.graph.nodes if is_all_gather(n) and not _backward(n)]
    assert len(gathers) == 4 and sum(map(moves_fp8_bytes, gathers)) == (2 if on else 0)


def test_the_fake_mesh_refuses_a_second_process_group():
    with fake_mesh():
        with pytest.raises(RuntimeError, match="initialized already"):
            with fake_mesh():
                pass


@pytest.mark.parametrize("tensor_parallel", [False, True], ids=["data_parallel", "tensor_parallel"])
def test_sharded_models_are_what_float8_all_gather_and_the_fp8_styles_take(tensor_parallel):
    from hypothesis import given, settings

    from conformance.draw.strategies import sharded_specs

    @settings(max_examples=30, database=None, deadline=None)
    @given(spec=sharded_specs(tensor_parallel=tensor_parallel))
    def drawn(spec):
        quantized = spec.quantized_modules()
        assert quantized and all(config == ("float8_linear", "tensorwise", False) for config in quantized.values())
        assert all(layer.calls == 1 and not layer.residual and not layer.adapter for layer in spec.layers)
        assert spec.batch % 2 == 0 and all(layer.width % 16 == 0 for layer in spec.layers)  # halves of 8+ rows
        if tensor_parallel:  # both layers quantized; each rank's half of the hidden width a multiple of 16
            assert len(spec.layers) == 2 and len(quantized) == 2 and spec.layers[0].width % 32 == 0
        else:
            assert "layers.0" in quantized and len(spec.layers) <= 2

    drawn()
