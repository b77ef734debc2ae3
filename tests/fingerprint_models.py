"""Model factories for the ``fp8conf precompile`` CLI tests (``--model fingerprint_models:model_a``)."""

from __future__ import annotations

import dataclasses

from conformance.models import LayerSpec, ModelSpec, build_model

#: The artifact model: a converted layer with bias, a plain layer, an emulated layer with a nested
#: quantized adapter (the same model FPR-004 saves, so Inductor's cache serves both).
SPEC_A = ModelSpec(
    in_features=16,
    layers=(
        LayerSpec(width=16, recipe="tensorwise", bias=True, activation="relu"),
        LayerSpec(width=16, recipe=None, activation="none"),
        LayerSpec(width=32, recipe="rowwise", emulate=True, adapter=True, activation="none"),
    ),
    input_requires_grad=False,
)
#: SPEC_A with layers.0 on the rowwise recipe and layers.2 no longer emulated.
SPEC_B = dataclasses.replace(
    SPEC_A,
    layers=(
        dataclasses.replace(SPEC_A.layers[0], recipe="rowwise"),
        SPEC_A.layers[1],
        dataclasses.replace(SPEC_A.layers[2], emulate=False),
    ),
)


def model_a():
    return build_model(SPEC_A)


def model_b():
    return build_model(SPEC_B)
