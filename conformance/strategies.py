"""Hypothesis strategies that draw the suite's models (as :class:`~conformance.models.ModelSpec`).

Widths are multiples of 16 (FP8 matmuls need it); which linears are quantized, their recipe,
``emulate``, bias, activation, residuals, module reuse and nesting are all drawn. Shrinking
heads for one small quantized layer, so a failure ends as a minimal model.

MX layers (``MXLinear``, recipes ``mxfp8`` / ``mxfp8_emulated``) are opt-in: pass
``kinds=ALL_KINDS``. Half the models are then drawn exactly as without MX; the other half start at
width 32 or 64, keep widths of 32 or 64 up to their forced quantized layer, which is MX, and may
make any later quantized layer whose in features allow it MX too. MX layers take no nested adapter.
"""

from __future__ import annotations

from hypothesis import strategies as st

from conformance.models import ACTIVATIONS, LayerSpec, ModelSpec

__all__ = ["FLOAT8_RECIPES", "ALL_KINDS", "layer_specs", "model_specs", "runnable_recipes"]

FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
WIDTHS = (16, 32, 48)
#: Quantized module kinds a model may draw: ``kinds=ALL_KINDS`` opts into MX layers.
FLOAT8_KIND, MX_KIND = "float8_linear", "mxfp8_linear"
ALL_KINDS = (FLOAT8_KIND, MX_KIND)
#: Widths of MX layers (MXFP8 quantizes both dims in blocks of 32).
MX_WIDTHS = (32, 64)


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
def layer_specs(
    draw, in_width: int, *, recipes=FLOAT8_RECIPES, emulate=st.booleans(), quantized=None, reuse=True, nesting=True,
    kinds=(FLOAT8_KIND,), widths=WIDTHS,
):
    """One layer taking ``in_width`` features. With the default ``kinds`` the draws are exactly those
    of a float8-only suite; a quantized layer becomes MX when ``kinds`` allows it and ``in_width``
    is a multiple of 32 (drawn when both kinds are allowed)."""
    quantize = quantized or (quantized is None and draw(st.booleans()))
    mx = (
        bool(quantize)
        and MX_KIND in kinds
        and in_width % 32 == 0
        and (FLOAT8_KIND not in kinds or draw(st.sampled_from(kinds), label="kind") == MX_KIND)
    )
    if mx:
        recipe = "mxfp8_emulated" if draw(emulate) else "mxfp8"
    else:
        recipe = draw(st.sampled_from(recipes)) if quantize else None
    square = draw(st.booleans())
    width = in_width if square else draw(st.sampled_from(MX_WIDTHS if mx else widths))
    return LayerSpec(
        width=width,
        recipe=recipe,
        emulate=(recipe == "mxfp8_emulated") if mx else (draw(emulate) if recipe else False),
        bias=draw(st.booleans()),
        activation=draw(st.sampled_from(ACTIVATIONS)),
        residual=width == in_width and draw(st.booleans()),
        calls=2 if (reuse and width == in_width and draw(st.booleans())) else 1,
        adapter=bool(recipe) and not mx and nesting and draw(st.booleans()),
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
    kinds=(FLOAT8_KIND,),
):
    """A model with at least one quantized layer (the first drawn quantized layer is forced).

    ``kinds=ALL_KINDS`` draws MX models too (see the module docstring); ``require_nesting`` keeps
    the forced layer float8, since MX layers take no adapter."""
    with_mx = MX_KIND in kinds and (FLOAT8_KIND not in kinds or draw(st.booleans(), label="with MX layers"))
    in_features = draw(st.sampled_from(MX_WIDTHS if with_mx else WIDTHS))
    n = draw(st.integers(1, max_layers))
    forced = draw(st.integers(0, n - 1))
    layers, width = [], in_features
    for i in range(n):
        layer_kinds = kinds if with_mx else (FLOAT8_KIND,)
        if with_mx and i == forced:
            layer_kinds = (FLOAT8_KIND,) if require_nesting else (MX_KIND,)
        widths = MX_WIDTHS if with_mx and (i < forced or FLOAT8_KIND not in kinds) else WIDTHS
        layer = draw(
            layer_specs(
                width, recipes=recipes, emulate=emulate, quantized=True if i == forced else None, reuse=reuse, nesting=nesting,
                kinds=layer_kinds, widths=widths,
            )
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
