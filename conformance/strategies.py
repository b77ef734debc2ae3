"""Hypothesis strategies that draw the suite's models (as :class:`~conformance.models.ModelSpec`).

Widths are multiples of 16 (FP8 matmuls need it); which linears are quantized, their recipe,
``emulate``, bias, activation, residuals, module reuse and nesting are all drawn. Shrinking
heads for one small quantized layer, so a failure ends as a minimal model.
"""

from __future__ import annotations

from hypothesis import strategies as st

from conformance.models import ACTIVATIONS, LayerSpec, ModelSpec

__all__ = ["FLOAT8_RECIPES", "layer_specs", "model_specs", "runnable_recipes"]

FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
WIDTHS = (16, 32, 48)


def runnable_recipes(device: str = "cpu") -> tuple[str, ...]:
    """The recipes whose real FP8 matmuls this torch can execute on ``device``.

    Tracing works everywhere, but executing differs: torch 2.11's CPU ``_scaled_mm`` supports
    tensorwise scales only, so properties that *run* graphs draw rowwise recipes only where a
    rowwise matmul actually runs.
    """
    import torch

    a = torch.zeros(16, 16, device=device).to(torch.float8_e4m3fn)
    b = torch.zeros(16, 16, device=device).to(torch.float8_e4m3fn).t()
    try:
        torch._scaled_mm(a, b, torch.ones(16, 1, device=device), torch.ones(1, 16, device=device), out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError):
        return ("tensorwise",)
    return FLOAT8_RECIPES


@st.composite
def layer_specs(draw, in_width: int, *, recipes=FLOAT8_RECIPES, emulate=st.booleans(), quantized=None, reuse=True, nesting=True):
    recipe = draw(st.sampled_from(recipes)) if (quantized or (quantized is None and draw(st.booleans()))) else None
    square = draw(st.booleans())
    width = in_width if square else draw(st.sampled_from(WIDTHS))
    return LayerSpec(
        width=width,
        recipe=recipe,
        emulate=draw(emulate) if recipe else False,
        bias=draw(st.booleans()),
        activation=draw(st.sampled_from(ACTIVATIONS)),
        residual=width == in_width and draw(st.booleans()),
        calls=2 if (reuse and width == in_width and draw(st.booleans())) else 1,
        adapter=bool(recipe) and nesting and draw(st.booleans()),
    )


@st.composite
def model_specs(
    draw,
    *,
    max_layers: int = 3,
    recipes=FLOAT8_RECIPES,
    emulate=st.booleans(),
    reuse: bool = True,
    nesting: bool = True,
    require_reuse: bool = False,
    require_nesting: bool = False,
):
    """A model with at least one quantized layer (the first drawn quantized layer is forced)."""
    in_features = draw(st.sampled_from(WIDTHS))
    n = draw(st.integers(1, max_layers))
    forced = draw(st.integers(0, n - 1))
    layers, width = [], in_features
    for i in range(n):
        layer = draw(
            layer_specs(width, recipes=recipes, emulate=emulate, quantized=True if i == forced else None, reuse=reuse, nesting=nesting)
        )
        if i == forced and require_reuse and layer.calls == 1:
            layer = LayerSpec(**{**layer.__dict__, "width": width, "calls": 2})
        if i == forced and require_nesting:
            layer = LayerSpec(**{**layer.__dict__, "adapter": True})
        layers.append(layer)
        width = layer.width
    return ModelSpec(
        in_features=in_features,
        layers=tuple(layers),
        input_requires_grad=draw(st.booleans()),
    )
