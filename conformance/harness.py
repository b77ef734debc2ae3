"""What every property test shares: calling the backend safely, tracing once, failing clearly.

* :func:`call_backend` runs one adapter method; an exception becomes a failure that names the
  property, the backend method and the exception, so a misbehaving backend fails one property
  and the run goes on;
* :func:`traced` traces a drawn model once per session and backend (Hypothesis draws the same
  models for many properties); tests that rewrite the graph take :func:`fresh_copy` of it;
* :func:`fail` prints the property ID, its spec line, what was expected versus seen, and the
  drawn model as runnable Python.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest

from conformance.graphs import Oracle, copy_graph_module, trace_with_oracle
from conformance.models import ModelSpec, build_model
from conformance.api.spec import get_property

__all__ = ["compile_settings", "TracedCase", "fail", "check", "call_backend", "strict_error", "traced", "fresh_copy", "fresh_args", "grad_outputs"]


def fail(property_id: str, message: str, spec: ModelSpec | None = None) -> None:
    prop = get_property(property_id)
    text = f"[{property_id}] {prop.level}: {prop.title}\n{message}"
    if spec is not None:
        text += "\n\nMinimal model (runnable):\n" + spec.to_python()
    pytest.fail(text, pytrace=False)


def check(condition: bool, property_id: str, message: str, spec: ModelSpec | None = None) -> None:
    if not condition:
        fail(property_id, message, spec)


def call_backend(property_id: str, backend, method: str, *args, expect=None, **kwargs):
    """Call ``backend.method``; any exception fails ``property_id`` naming the method."""
    try:
        result = getattr(backend, method)(*args, **kwargs)
    except Exception as exc:  # a backend bug must not take the session down
        fail(property_id, f"backend {backend.name!r}: {method}() raised {type(exc).__name__}: {exc}")
    if expect is not None and not isinstance(result, expect):
        fail(property_id, f"backend {backend.name!r}: {method}() returned {type(result).__qualname__}, expected {expect.__name__}")
    return result


def strict_error(property_id: str, backend, gm):
    """The ``FP8ValidationError`` strict validation raises on ``gm``, or None when it accepts it."""
    from fp8conf.errors import FP8ValidationError

    try:
        backend.validate(gm, strict=True)
    except FP8ValidationError as exc:
        return exc
    except Exception as exc:
        fail(property_id, f"backend {backend.name!r}: validate() raised {type(exc).__name__}, not an FP8ValidationError: {exc}")
    return None


def compile_settings():
    """Hypothesis settings for a property that compiles with Inductor in every example (seconds to
    tens of seconds each on CPU): one in twelve of the profile's examples, at least two."""
    from hypothesis import settings

    return settings(max_examples=max(2, settings.default.max_examples // 12))


@dataclasses.dataclass
class TracedCase:
    spec: ModelSpec
    model: object
    args: tuple
    gm: object
    oracle: Oracle


@functools.lru_cache(maxsize=256)
def _trace(backend, spec: ModelSpec) -> TracedCase:
    model, args = build_model(spec)
    gm, oracle = trace_with_oracle(backend, model, args, list(spec.quantized_modules()), backend.is_backward)
    return TracedCase(spec, model, args, gm, oracle)


def traced(property_id: str, backend, spec: ModelSpec) -> TracedCase:
    """The backend's joint graph of ``spec``'s model, traced once per session. Do not mutate it."""
    try:
        return _trace(backend, spec)
    except Exception as exc:
        fail(property_id, f"backend {backend.name!r}: trace_joint() raised {type(exc).__name__}: {exc}", spec)


def fresh_copy(case: TracedCase):
    """A copy of the case's graph that a test may rewrite; node keys of the oracle map by position."""
    gm = copy_graph_module(case.gm)
    by_position = dict(zip(case.gm.graph.nodes, gm.graph.nodes))
    oracle = Oracle({by_position[n]: f for n, f in case.oracle.issued_by.items()}, case.oracle.forward_seq_nrs)
    return gm, oracle


def fresh_args(spec: ModelSpec, seed: int, device: str = "cpu") -> tuple:
    """New inputs for ``spec``'s model, drawn from ``seed`` (not the traced example inputs)."""
    import torch

    generator = torch.Generator(device).manual_seed(seed)
    x = torch.randn(spec.batch, spec.in_features, device=device, generator=generator)
    return (x.requires_grad_(spec.input_requires_grad),)


def grad_outputs(spec: ModelSpec, seed: int, device: str = "cpu") -> tuple:
    """Gradients of ``spec``'s model output, drawn from ``seed``."""
    import torch

    generator = torch.Generator(device).manual_seed(seed)
    return (torch.randn(spec.batch, spec.layers[-1].width, device=device, generator=generator),)
