"""Model families shaped like what graph trainers train, drawn beside the stacks of linears.

A stack of linears with adapters never shows a backend what a real training step holds:
attention through ``F.scaled_dot_product_attention``, 3-D activations, an embedding whose
gradient is the only "input" gradient, modules of equal leaf names under different parents,
a module called twice in one step, or nodes that already carry a user's annotations. Each
family is a :class:`FamilySpec` (a frozen dataclass whose ``repr`` is Python, like
:class:`conformance.draw.models.ModelSpec`, and which answers the same questions: its quantized
modules and their configs, its calls, the FP8 matmuls its recipe issues), built with real
TorchAO conversion by :func:`build_family`:

* ``llama``: an embedding, blocks of RMSNorm, attention (q/k/v/o projections, causal SDPA, with
  grouped-query attention when ``kv_heads < heads``), RMSNorm and a SwiGLU MLP on a residual
  stream, then a norm and a high-precision output head; every projection quantized. The
  properties that compile every example run it without the MLP (:data:`LLAMA_ATTENTION`).
* ``annotated``: the ``llama`` family whose forward annotates each block's attention and MLP
  with ``torch.fx.traceback.annotate`` (a stage and a part, as pipeline trainers do): the
  traced nodes carry the model's own ``meta["custom"]`` keys, which a backend must keep.
* ``siblings``: two quantized ``proj`` linears of equal leaf name under the parents ``attn``
  and ``mlp`` (with different recipes where the property allows two), a ``shared`` linear
  called twice in the step, and, with ``emulate=None``, ``mlp.proj`` emulated next to the real
  ``attn.proj``: one model with emulated and real modules of one leaf name.

Properties opt in through ``Constraints.families`` (``conformance.draw.strategies``); every family
their constraints admit is run as an explicit example first (:func:`variants`), then Hypothesis
draws as before.
"""

from __future__ import annotations

import contextlib
import dataclasses

from conformance.draw.models import _float8_config, recipe_compute_counts, reproducer, seed_for_init, spec_code

__all__ = [
    "FAMILIES", "LLAMA_ATTENTION", "FamilySpec", "build_family", "user_annotations", "variants",
]

#: Every family, in the order properties run them.
FAMILIES = ("llama", "siblings", "annotated")
#: The ``llama`` family without its MLP, as the properties that compile every example run it
#: (the name a property's ``Constraints.families`` gives; its models are ``llama`` models with
#: ``mlp=False``): embedding, RMSNorm, attention through SDPA with grouped-query attention, the
#: residual stream, the final norm and the high-precision head, at half a cold compile's cost.
LLAMA_ATTENTION = "llama-attention"
_LLAMA_LIKE = ("llama", "annotated")
#: Rows of the token dimension (a multiple of 16: FP8 matmuls need it) and the vocabulary.
_VOCAB = 64
#: The keys the ``annotated`` family's forward sets with ``torch.fx.traceback.annotate``.
USER_STAGE_KEY, USER_PART_KEY = "user.pp_stage", "user.part"


@dataclasses.dataclass(frozen=True)
class FamilySpec:
    """One model of a family. ``recipe`` is every quantized module's recipe but ``mlp.proj``'s
    (``sibling_recipe``, None: ``recipe``). ``emulate`` True/False: every module emulated or
    real; None: some of each (``llama``: the MLP's ``w1`` and ``w3``, or without an MLP the
    attention's ``wv``; ``siblings``: ``mlp.proj``). ``mlp``: the Llama blocks end in their
    SwiGLU MLP (``ffn_norm`` and ``feed_forward``); without it a block is its attention on the
    residual stream. ``input_requires_grad``: the ``siblings`` model's float input needs a
    gradient; the Llama families take token ids, which need none (every projection's input
    needs one all the same, through the embedding's weight)."""

    family: str
    dim: int = 32
    blocks: int = 1
    heads: int = 2
    kv_heads: int = 2
    recipe: str = "tensorwise"
    sibling_recipe: str | None = None
    emulate: bool | None = False
    input_requires_grad: bool = False
    tokens: int = 16
    seed: int = 0
    mlp: bool = True

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family {self.family!r} is none of {FAMILIES}")
        if self.dim % 16 or self.tokens % 16 or self.dim % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"dim {self.dim}, tokens {self.tokens}, heads {self.heads}/{self.kv_heads} do not fit")
        if (self.dim // self.heads * self.kv_heads) % 16:
            raise ValueError(f"the k/v projections' width {self.dim // self.heads * self.kv_heads} is not a multiple of 16")
        if self.llama and self.input_requires_grad:
            raise ValueError(f"the {self.family} family takes token ids, which need no gradient")
        if not (self.mlp or self.llama):
            raise ValueError(f"the {self.family} family has no MLP to leave out")

    @property
    def llama(self) -> bool:
        return self.family in _LLAMA_LIKE

    # -- what the suite knows about the model without asking the backend -------------------
    def _linears(self) -> list[tuple[str, int, int]]:
        """``(fqn, in, out)`` of every quantized linear, in call order of a block."""
        if not self.llama:
            return [("attn.proj", self.dim, self.dim), ("mlp.proj", self.dim, self.dim), ("shared", self.dim, self.dim)]
        kv = self.dim // self.heads * self.kv_heads
        hidden = 2 * self.dim
        found = []
        for i in range(self.blocks):
            a, f = f"layers.{i}.attention", f"layers.{i}.feed_forward"
            found += [(f"{a}.wq", self.dim, self.dim), (f"{a}.wk", self.dim, kv), (f"{a}.wv", self.dim, kv), (f"{a}.wo", self.dim, self.dim)]
            if self.mlp:
                found += [(f"{f}.w1", self.dim, hidden), (f"{f}.w3", self.dim, hidden), (f"{f}.w2", hidden, self.dim)]
        return found

    def _config(self, fqn: str) -> tuple[str, bool]:
        recipe = self.sibling_recipe or self.recipe if fqn == "mlp.proj" else self.recipe
        if self.emulate is not None:
            return recipe, self.emulate
        return recipe, fqn == "mlp.proj" or fqn.endswith((".w1", ".w3") if self.mlp else (".wv",))

    def quantized_modules(self) -> dict[str, tuple[str, str, bool]]:
        """FQN -> (kind, recipe, emulate) of every quantized module."""
        return {fqn: ("float8_linear", *self._config(fqn)) for fqn, _, _ in self._linears()}

    def calls(self) -> list[tuple[str, bool]]:
        """``(fqn, input_requires_grad)`` for every call of a quantized module, in call order:
        the embedding's weight makes every Llama projection's input need a gradient."""
        if self.llama:
            return [(fqn, True) for fqn, _, _ in self._linears()]
        return [("attn.proj", self.input_requires_grad), ("mlp.proj", True), ("shared", True), ("shared", True)]

    def expected_compute_counts(self) -> dict[tuple[str, str], int]:
        """(fqn, pass) -> FP8 scaled matmuls the recipe issues (as ``ModelSpec``'s)."""
        return recipe_compute_counts(self.calls(), self.quantized_modules())

    def has_mx(self) -> bool:
        return False

    def has_scaled_mm(self) -> bool:
        return False

    def module_fqns(self) -> tuple[str, ...]:
        """Every linear a failure message may name: the quantized ones and the plain head."""
        return tuple(fqn for fqn, _, _ in self._linears()) + (("output",) if self.llama else ())

    def size(self) -> tuple[int, int]:
        linears = self._linears()
        return len(linears), sum(i * o for _, i, o in linears)

    def has_float8(self) -> bool:
        return True

    def to_python(self, backend: str | None = None, *, own_float8: bool = False) -> str:
        """The model as code; ``own_float8``: ``backend`` (``"package.module:Class"``) converts its
        float8 linears (it claims ``float8_modules``)."""
        if own_float8:
            return reproducer("conformance.draw.families", "build_family", self, backend, ("float8", "convert_float8"))
        return "import torch\nfrom conformance.draw.families import *\n\n" + spec_code(self) + "model, args = build_family(spec)\n"

    # -- inputs ---------------------------------------------------------------------------
    def build(self, device: str = "cpu", *, float8=None):
        return build_family(self, device, float8=float8)

    def example_inputs(self, seed: int, device: str = "cpu") -> tuple:
        import torch

        generator = torch.Generator(device).manual_seed(seed)
        if self.llama:
            return (torch.randint(0, _VOCAB, (1, self.tokens), device=device, generator=generator),)
        x = torch.randn(self.tokens, self.dim, device=device, generator=generator)
        return (x.requires_grad_(self.input_requires_grad),)

    def example_grad_outputs(self, seed: int, device: str = "cpu") -> tuple:
        import torch

        generator = torch.Generator(device).manual_seed(seed)
        shape = (1, self.tokens, _VOCAB) if self.llama else (self.tokens, self.dim)
        return (torch.randn(*shape, device=device, generator=generator),)


def user_annotations(spec, fqn: str) -> dict:
    """The ``meta["custom"]`` keys the ``annotated`` family's forward puts on every node module
    ``fqn`` issues (empty for other families and models): its block as a pipeline stage, and
    its part."""
    if getattr(spec, "family", None) != "annotated" or not fqn.startswith("layers."):
        return {}
    _, block, part, _ = fqn.split(".")
    return {USER_STAGE_KEY: int(block), USER_PART_KEY: "attention" if part == "attention" else "mlp"}


def variants(c) -> tuple[FamilySpec, ...]:
    """The family models a property with constraints ``c`` (``conformance.draw.strategies.Constraints``)
    runs first: one per family of ``c.families`` that ``c`` admits, with ``c``'s first recipe
    (the siblings' ``mlp.proj`` its second, where it allows two) and emulation; with emulation
    left open, the siblings both all real and mixed."""
    if "float8_linear" not in c.kinds or c.require_nesting:
        return ()
    recipes = c.float8_choices
    recipe, other = recipes[0], recipes[1 % len(recipes)]
    emulate = c.emulate if c.float8_emulation else False
    found = []
    for family in c.families:
        if family == "siblings" and not c.reuse:
            continue
        if family != "siblings" and c.require_reuse:
            continue
        if family in ("llama", LLAMA_ATTENTION):
            found.append(FamilySpec("llama", kv_heads=1, recipe=recipe, emulate=emulate, mlp=family == "llama"))
        elif family == "annotated":
            found.append(FamilySpec("annotated", recipe=other, emulate=False if emulate is None else emulate))
        else:
            # Open emulation runs both: real siblings of one leaf name, and one of them emulated.
            for each in (False, None) if emulate is None else (emulate,):
                found.append(FamilySpec("siblings", recipe=recipe, sibling_recipe=other, emulate=each))
    return tuple(found)


# --- the models ---------------------------------------------------------------------------


def _classes() -> dict[str, type]:
    if _CLASSES:
        return _CLASSES
    import torch
    import torch.fx.traceback as fx_traceback
    import torch.nn.functional as F
    from torch import nn

    class RMSNorm(nn.Module):
        def __init__(self, dim, eps=1e-6):
            super().__init__()
            self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    class Attention(nn.Module):
        def __init__(self, spec: FamilySpec):
            super().__init__()
            self.heads, self.kv_heads, self.head_dim = spec.heads, spec.kv_heads, spec.dim // spec.heads
            kv = self.head_dim * spec.kv_heads
            self.wq, self.wo = nn.Linear(spec.dim, spec.dim, bias=False), nn.Linear(spec.dim, spec.dim, bias=False)
            self.wk, self.wv = nn.Linear(spec.dim, kv, bias=False), nn.Linear(spec.dim, kv, bias=False)

        def forward(self, x):
            batch, tokens, _ = x.shape
            q = self.wq(x).view(batch, tokens, self.heads, self.head_dim).transpose(1, 2)
            k = self.wk(x).view(batch, tokens, self.kv_heads, self.head_dim).transpose(1, 2)
            v = self.wv(x).view(batch, tokens, self.kv_heads, self.head_dim).transpose(1, 2)
            gqa = self.kv_heads != self.heads
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            return self.wo(a.transpose(1, 2).reshape(batch, tokens, -1))

    class FeedForward(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.w1, self.w3 = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(dim, 2 * dim, bias=False)
            self.w2 = nn.Linear(2 * dim, dim, bias=False)

        def forward(self, x):
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    class Block(nn.Module):
        def __init__(self, spec: FamilySpec, index: int):
            super().__init__()
            self.annotated, self.index, self.mlp = spec.family == "annotated", index, spec.mlp
            # Registered in this order whether or not the block has an MLP (None without one).
            self.attention_norm, self.ffn_norm = RMSNorm(spec.dim), RMSNorm(spec.dim) if spec.mlp else None
            self.attention, self.feed_forward = Attention(spec), FeedForward(spec.dim) if spec.mlp else None

        def _part(self, part):
            if not self.annotated:
                return contextlib.nullcontext()
            return fx_traceback.annotate({USER_STAGE_KEY: self.index, USER_PART_KEY: part})

        def forward(self, x):
            with self._part("attention"):
                x = x + self.attention(self.attention_norm(x))
            if not self.mlp:
                return x
            with self._part("mlp"):
                return x + self.feed_forward(self.ffn_norm(x))

    class FamilyLlama(nn.Module):
        def __init__(self, spec: FamilySpec):
            super().__init__()
            self.embedding = nn.Embedding(_VOCAB, spec.dim)
            self.layers = nn.ModuleList(Block(spec, i) for i in range(spec.blocks))
            self.norm, self.output = RMSNorm(spec.dim), nn.Linear(spec.dim, _VOCAB, bias=False)

        def forward(self, tokens):
            x = self.embedding(tokens)
            for layer in self.layers:
                x = layer(x)
            return self.output(self.norm(x))

    class Branch(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.proj = nn.Linear(dim, dim, bias=False)

    class Siblings(nn.Module):
        """``attn.proj`` and ``mlp.proj`` (one leaf name, two parents), ``shared`` called twice."""

        def __init__(self, spec: FamilySpec):
            super().__init__()
            self.attn, self.mlp = Branch(spec.dim), Branch(spec.dim)
            self.shared = nn.Linear(spec.dim, spec.dim, bias=False)

        def forward(self, x):
            x = x + self.attn.proj(x)
            x = torch.relu(self.mlp.proj(x))
            x = self.shared(x)
            return F.gelu(self.shared(x))

    _CLASSES.update(FamilyLlama=FamilyLlama, Siblings=Siblings)
    return _CLASSES


_CLASSES: dict[str, type] = {}


def build_family(spec: FamilySpec, device: str = "cpu", *, float8=None, plain: bool = False):
    """Build ``spec``'s model, every quantized linear converted by
    ``torchao.float8.convert_to_float8_training`` with its own config, or by ``float8`` (a
    backend's ``convert_float8``) when given, or left a plain ``nn.Linear`` when ``plain`` (the
    model in high precision); return ``(model, args)``."""
    import torch
    from torchao.float8 import convert_to_float8_training

    seed_for_init(spec.seed)
    model = _classes()["FamilyLlama" if spec.llama else "Siblings"](spec)
    for fqn, (_kind, recipe, emulate) in ({} if plain else spec.quantized_modules()).items():
        def accept(m, name, fqn=fqn):
            return name == fqn

        if float8 is not None:
            float8(model, module_filter_fn=accept, recipe=recipe, emulate=emulate)
            continue
        config = _float8_config(recipe, emulate, fqn=fqn)
        convert_to_float8_training(model, config=config, module_filter_fn=accept)
    model.to(device)
    return model, spec.example_inputs(spec.seed, device)
