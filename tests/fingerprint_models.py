"""Model factories for the ``fp8conf precompile`` CLI tests (``--model fingerprint_models:model_a``)."""

from __future__ import annotations

import dataclasses

from conformance.draw.fingerprints import ARTIFACT_SPEC
from conformance.draw.models import build_model

#: The artifact model FPR-004 saves (so Inductor's cache serves both).
SPEC_A = ARTIFACT_SPEC
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


def model_a_batch_8():
    """SPEC_A's model with inputs of another batch size: the same fingerprint, stale input shapes."""
    return build_model(dataclasses.replace(SPEC_A, batch=8))


def broken_factory():
    raise RuntimeError("the factory is broken")


def not_a_model():
    return 42


def unquantized_model():
    """A model without FP8 modules: strict validation refuses it."""
    import torch

    return torch.nn.Sequential(torch.nn.Linear(16, 16)), (torch.ones(4, 16),)
