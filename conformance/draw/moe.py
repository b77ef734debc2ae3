"""Mixture-of-experts models the suite draws (kind ``float8_grouped_experts``), as plain data.

A :class:`MoESpec` prints as Python that builds its model with a backend that claims capability
``moe``::

    from conformance.draw.moe import *
    from your_backend import YourBackend
    model, args = build_moe_model(MoESpec(...), convert=YourBackend().convert_grouped_experts)

Each layer of the model is a top-k router (a plain high-precision ``nn.Linear``: routers stay in
high precision) and two experts modules, ``experts_up`` (dim -> hidden) and ``experts_down``
(hidden -> dim), with an activation between them. The suite builds the experts as its own
high-precision :class:`GroupedExperts` (a 3-D ``weight`` ``(E, out, in)``, called as
``experts(x, offs)``) and the backend converts them to FP8 through the contract's
``Backend.convert_grouped_experts``. Routing sorts the token copies by expert and pads every
group with zero rows to a multiple of 16 (FP8 grouped GEMMs need it), all with static shapes,
so the model traces with fake tensors; the token-group end offsets are an input of each experts
call. Experts listed in ``MoESpec.unused`` are masked out of routing: their groups are empty.

A spec with ``v2`` (for a backend that claims capability ``scaled_grouped_mm_v2``) has its experts
converted through ``Backend.convert_scaled_grouped_experts`` instead: grouped experts whose
grouped GEMMs go through ``F.scaled_grouped_mm`` (``aten._scaled_grouped_mm_v2``), what
trainers written against torch's second scaled-matmul API call.

torch ships a CUDA kernel for ``aten._scaled_grouped_mm_v2`` only: no CPU, Meta or fake one (up
to 2.14 at least), so a model calling it cannot even be traced with fake tensors on CPU. Within
:func:`v2_grouped_structure` it can, and nothing else changes:

* the Meta kernel computes what torch's own kernels compute before any arithmetic, and nothing
  else: the output's shape, dtype and strides by torch's own rule for grouped GEMM outputs, the
  one the first API's Meta kernel uses (``torch._meta_registrations._meta_grouped_mm_common``,
  the Python twin of the CUDA code's ``create_grouped_gemm_output_tensor``, which both APIs'
  CUDA kernels call), with its checks of the operands (FP8 dtypes, row/column-major layouts,
  16-byte strides, rowwise scale shapes, int32 offsets), which are the rowwise recipe's on both
  APIs; a layout the GPU would refuse is refused here too. It takes one rowwise scale per
  operand and refuses any other scaling rather than guess;
* it is registered with ``torch.library`` only inside the block, only where torch has no Meta
  kernel of its own, and removed on leaving, with FakeTensor's dispatch cache cleared, so no
  fake result outlives the block;
* it is a Meta kernel, not a CPU one: a real call still raises inside the block, so nothing that
  runs a v2 grouped GEMM can pretend to compute on CPU.

What a rowwise FP8 grouped GEMM of either API computes, the suite defines itself
(:func:`reference_grouped_mm`): EMU-006 runs experts under it where the device has no kernel
(``conformance.judge.block_scaled.read_by_the_suite``), and its report row says so.
"""

from __future__ import annotations

import contextlib
import dataclasses

from conformance.draw.models import reproducer, seed_for_init

__all__ = [
    "GROUPED_KIND", "ALIGNMENT", "MoESpec", "ExpertsSpec", "GroupedExperts", "build_moe_model", "build_experts_model",
    "experts_inputs", "experts_family", "v2_grouped_structure", "has_v2_grouped_meta_kernel", "reference_grouped_mm",
]

#: The quantized module kind of FP8 grouped experts.
GROUPED_KIND = "float8_grouped_experts"
#: Token groups are padded to a multiple of this many rows.
ALIGNMENT = 16
ACTIVATIONS = ("relu", "gelu")


@dataclasses.dataclass(frozen=True)
class MoESpec:
    """A stack of ``layers`` MoE layers on ``tokens`` tokens of ``dim`` features.

    ``unused``: experts no token is routed to (never the last one, whose group also takes the
    padding slack). ``emulate``: the experts compute in high precision on purpose. ``v2``: the
    experts' grouped GEMMs go through ``F.scaled_grouped_mm`` (never emulated). ``unconverted``:
    FQNs of experts modules left as the suite's high-precision :class:`GroupedExperts` (the FPR
    changes of which experts are converted); every other experts module is converted."""

    dim: int = 16
    hidden: int = 32
    experts: int = 4
    top_k: int = 2
    layers: int = 1
    tokens: int = 16
    unused: tuple[int, ...] = ()
    activation: str = "relu"
    emulate: bool = False
    input_requires_grad: bool = True
    seed: int = 0
    v2: bool = False
    unconverted: tuple[str, ...] = ()

    def __post_init__(self):
        _check_v2(self)
        stray = sorted(set(self.unconverted) - set(self.experts_modules()))
        if stray:
            raise ValueError(f"unconverted {stray} are no experts modules of this spec; they are {self.experts_modules()}")
        if self.dim % ALIGNMENT or self.hidden % ALIGNMENT:
            raise ValueError(f"dim and hidden must be multiples of {ALIGNMENT}, got {self.dim}, {self.hidden}")
        if any(not 0 <= e < self.experts - 1 for e in self.unused) or len(set(self.unused)) != len(self.unused):
            raise ValueError(f"unused experts {self.unused} must be distinct and below {self.experts - 1}")
        if not 1 <= self.top_k <= self.experts - len(self.unused):
            raise ValueError(f"top_k={self.top_k} needs that many routable experts of {self.experts} - {len(self.unused)} unused")

    @property
    def padded_tokens(self) -> int:
        """Rows of every experts call: the token copies plus the most padding routing can add, a
        multiple of 16 (the weight-gradient GEMM contracts over the rows)."""
        copies = self.tokens * self.top_k
        return -(-copies // ALIGNMENT) * ALIGNMENT + ALIGNMENT * self.experts

    def experts_modules(self) -> tuple[str, ...]:
        """FQNs of every experts module, converted or not, in call order."""
        return tuple(f"layers.{i}.{name}" for i in range(self.layers) for name in ("experts_up", "experts_down"))

    def quantized_modules(self) -> dict[str, tuple[str, str, bool]]:
        """FQN -> (kind, recipe, emulate) of every converted experts module: the ground truth."""
        return {fqn: (GROUPED_KIND, "rowwise", self.emulate) for fqn in self.experts_modules() if fqn not in self.unconverted}

    def calls(self) -> list[tuple[str, bool]]:
        """``(fqn, input_requires_grad)`` for every call of a converted experts module, in call order."""
        calls = []
        for i in range(self.layers):
            calls.append((f"layers.{i}.experts_up", self.input_requires_grad or i > 0))
            calls.append((f"layers.{i}.experts_down", True))
        return [(fqn, grad) for fqn, grad in calls if fqn not in self.unconverted]

    def expected_compute_counts(self) -> dict[tuple[str, str], int]:
        """(fqn, pass) -> FP8 grouped GEMMs: forward 1 per call; backward grad_input when the
        call's input needs a gradient, and grad_weight; none for emulated experts."""
        if self.emulate:
            return {}
        counts = {}
        for fqn, input_grad in self.calls():
            counts[(fqn, "forward")] = 1
            counts[(fqn, "backward")] = 1 + int(input_grad)
        return counts

    def to_python(self, backend: str | None = None) -> str:
        return reproducer("conformance.draw.moe", "build_moe_model", self, backend, ("convert", _converter(self))) + _v2_hint(self)


@dataclasses.dataclass(frozen=True)
class ExpertsSpec:
    """One experts module on tokens already grouped: ``groups`` are the token counts per expert
    (multiples of 16, zeros for empty groups), the offsets a model input. The last ``padding``
    rows of every non-empty group are zeros, as routing's padding makes them."""

    groups: tuple[int, ...] = (16, 0, 32)
    in_features: int = 16
    out_features: int = 32
    padding: int = 0
    emulate: bool = False
    seed: int = 0
    v2: bool = False

    def __post_init__(self):
        _check_v2(self)
        if any(g % ALIGNMENT or g < 0 for g in self.groups) or not any(self.groups):
            raise ValueError(f"groups {self.groups} must be multiples of {ALIGNMENT}, not all empty")
        if self.in_features % ALIGNMENT or self.out_features % ALIGNMENT:
            raise ValueError(f"features must be multiples of {ALIGNMENT}")
        if not 0 <= self.padding <= min(g for g in self.groups if g):
            raise ValueError(f"padding {self.padding} exceeds a group")

    @property
    def experts(self) -> int:
        return len(self.groups)

    def quantized_modules(self) -> dict[str, tuple[str, str, bool]]:
        return {"experts": (GROUPED_KIND, "rowwise", self.emulate)}

    def group_rows(self) -> list[tuple[int, int]]:
        """``(start, end)`` of every group's rows."""
        bounds, start = [], 0
        for size in self.groups:
            bounds.append((start, start + size))
            start += size
        return bounds

    def to_python(self, backend: str | None = None) -> str:
        return reproducer("conformance.draw.moe", "build_experts_model", self, backend, ("convert", _converter(self))) + _v2_hint(self)


def _check_v2(spec) -> None:
    if spec.v2 and spec.emulate:
        raise ValueError("experts on F.scaled_grouped_mm (v2) are never emulated")


def _v2_hint(spec) -> str:
    if not spec.v2:
        return ""
    return ("# torch ships no CPU or Meta kernel of aten._scaled_grouped_mm_v2: on CPU, trace with fake tensors\n"
            "# inside `with v2_grouped_structure():` (the suite's structure-only Meta kernel)\n")


def experts_family(spec) -> str:
    """The family the report and the coverage matrix file ``spec``'s experts under."""
    return "moe on F.scaled_grouped_mm" if spec.v2 else "moe"


def _converter(spec) -> str:
    """The contract method that converts ``spec``'s experts."""
    return "convert_scaled_grouped_experts" if spec.v2 else "convert_grouped_experts"


def _convert(convert, model, spec, module_filter_fn) -> None:
    if spec.v2:
        convert(model, module_filter_fn=module_filter_fn, recipe="rowwise")
    else:
        convert(model, module_filter_fn=module_filter_fn, recipe="rowwise", emulate=spec.emulate)


_CACHE: dict[str, type] = {}


def _classes():
    if _CACHE:
        return _CACHE
    import torch
    from torch import nn

    class GroupedExperts(nn.Module):
        """High-precision (bfloat16) experts: ``weight`` (E, out, in); ``forward(x, offs)``
        multiplies each token group of ``x`` by its expert's ``weight[e].T``."""

        def __init__(self, experts: int, in_features: int, out_features: int):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(experts, out_features, in_features) / in_features**0.5)

        def forward(self, x, offs):
            # bfloat16: the dtype torch's grouped GEMM takes on every device (and under fake tensors).
            weight = self.weight.to(torch.bfloat16).transpose(-2, -1)
            return torch._grouped_mm(x.to(torch.bfloat16), weight, offs=offs).to(x.dtype)

    class MoELayer(nn.Module):
        def __init__(self, spec: MoESpec):
            super().__init__()
            self.spec = spec
            self.router = nn.Linear(spec.dim, spec.experts, bias=False)
            mask = torch.zeros(spec.experts)
            mask[list(spec.unused)] = float("-inf")
            self.register_buffer("expert_mask", mask)
            self.experts_up = GroupedExperts(spec.experts, spec.dim, spec.hidden)
            self.experts_down = GroupedExperts(spec.experts, spec.hidden, spec.dim)

        def forward(self, x):
            spec = self.spec
            probs = torch.softmax(self.router(x) + self.expert_mask, dim=-1)
            weights, chosen = probs.topk(spec.top_k, dim=-1)
            order, dest, offs = _route(chosen.reshape(-1), spec)
            token = torch.div(order, spec.top_k, rounding_mode="floor")
            rows = x.new_zeros(spec.padded_tokens, spec.dim).index_put((dest,), x[token])
            hidden = self.experts_up(rows, offs)
            hidden = torch.relu(hidden) if spec.activation == "relu" else torch.nn.functional.gelu(hidden)
            out_rows = self.experts_down(hidden, offs)[dest] * weights.reshape(-1)[order].unsqueeze(-1)
            return x.new_zeros(x.shape).index_add(0, token, out_rows.to(x.dtype))

    class DrawnMoE(nn.Module):
        def __init__(self, spec: MoESpec):
            super().__init__()
            self.spec = spec
            self.layers = nn.ModuleList(MoELayer(spec) for _ in range(spec.layers))

        def forward(self, x):
            for layer in self.layers:
                x = x + layer(x)
            return x

    class ExpertsOnly(nn.Module):
        def __init__(self, spec: ExpertsSpec):
            super().__init__()
            self.experts = GroupedExperts(spec.experts, spec.in_features, spec.out_features)

        def forward(self, x, offs):
            return self.experts(x, offs)

    _CACHE.update(GroupedExperts=GroupedExperts, MoELayer=MoELayer, DrawnMoE=DrawnMoE, ExpertsOnly=ExpertsOnly)
    return _CACHE


def _route(expert_of_copy, spec: MoESpec):
    """Sort token copies by expert and place them in zero-padded groups.

    Returns ``(order, dest, offs)``: ``order`` the copies sorted by expert, ``dest`` the row
    each sorted copy lands in, ``offs`` the int32 group end offsets (the last group ends at
    :attr:`MoESpec.padded_tokens`, taking the padding slack)."""
    import torch

    order = torch.argsort(expert_of_copy, stable=True)
    # A scatter, not one_hot or bincount: no host synchronisation, so CUDA graphs can capture it.
    counts = torch.zeros(spec.experts, dtype=expert_of_copy.dtype, device=expert_of_copy.device)
    counts = counts.scatter_add(0, expert_of_copy, torch.ones_like(expert_of_copy))
    padded = torch.div(counts + ALIGNMENT - 1, ALIGNMENT, rounding_mode="floor") * ALIGNMENT
    starts = torch.cumsum(counts, 0) - counts
    padded_starts = torch.cumsum(padded, 0) - padded
    sorted_experts = expert_of_copy[order]
    rank = torch.arange(order.shape[0], device=order.device) - starts[sorted_experts]
    dest = padded_starts[sorted_experts] + rank
    ends = torch.cumsum(padded, 0)
    last = torch.full_like(ends[-1:], spec.padded_tokens)
    offs = torch.cat([ends[:-1], last]).to(torch.int32)
    return order, dest, offs


def __getattr__(name):
    # Lazily defined so that importing conformance.draw.moe does not import torch.
    if name in ("GroupedExperts", "MoELayer", "DrawnMoE", "ExpertsOnly"):
        return _classes()[name]
    raise AttributeError(name)


def build_moe_model(spec: MoESpec, device: str = "cpu", *, convert):
    """Build ``spec``'s model and convert its experts with ``convert`` (a backend's
    ``convert_grouped_experts``, called as ``convert(model, module_filter_fn=..., recipe="rowwise",
    emulate=...)``; for a ``v2`` spec its ``convert_scaled_grouped_experts``, called without
    ``emulate``); return ``(model, args)``."""
    import torch

    seed_for_init(spec.seed)
    model = _classes()["DrawnMoE"](spec)
    experts = set(spec.quantized_modules())
    _convert(convert, model, spec, lambda m, fqn: fqn in experts)
    model.to(device)
    x = torch.randn(spec.tokens, spec.dim, device=device, requires_grad=spec.input_requires_grad)
    return model, (x,)


def experts_inputs(spec: ExpertsSpec, seed: int, device: str = "cpu", *, scale_group: int | None = None, factor: float = 1.0):
    """``(x, offs)`` for ``spec``'s model drawn from ``seed``; with ``scale_group``, that group's
    rows are multiplied by ``factor`` (every other row is unchanged)."""
    import torch

    generator = torch.Generator(device).manual_seed(seed)
    x = torch.randn(sum(spec.groups), spec.in_features, device=device, generator=generator)
    for group, (start, end) in enumerate(spec.group_rows()):
        if end > start and spec.padding:
            x[end - spec.padding:end] = 0
        if group == scale_group:
            x[start:end] *= factor
    offs = torch.tensor([end for _, end in spec.group_rows()], dtype=torch.int32, device=device)
    return x.requires_grad_(True), offs


def build_experts_model(spec: ExpertsSpec, device: str = "cpu", *, convert):
    """Build ``spec``'s one-experts model, converted by ``convert`` (as :func:`build_moe_model`);
    return ``(model, (x, offs))``."""
    import torch

    seed_for_init(spec.seed)
    model = _classes()["ExpertsOnly"](spec)
    _convert(convert, model, spec, lambda m, fqn: fqn == "experts")
    model.to(device)
    return model, experts_inputs(spec, spec.seed, device)


# --- structure-only tracing of experts on F.scaled_grouped_mm -------------------------------

_V2_GROUPED = "aten::_scaled_grouped_mm_v2"


#: Whether :func:`v2_grouped_structure` has its Meta kernel registered now.
_REGISTERED = False


def has_v2_grouped_meta_kernel(*, torchs_own: bool = False) -> bool:
    """Whether ``aten._scaled_grouped_mm_v2`` has a Meta kernel now: torch's own or the one
    :func:`v2_grouped_structure` registers, or with ``torchs_own``, torch's own only."""
    import torch

    if torchs_own and _REGISTERED:
        return False
    return hasattr(torch.ops.aten, "_scaled_grouped_mm_v2") and torch._C._dispatch_has_kernel_for_dispatch_key(_V2_GROUPED, "Meta")


def _meta_scaled_grouped_mm_v2(mat_a, mat_b, scale_a, recipe_a, swizzle_a, scale_b, recipe_b, swizzle_b, offs=None,
                               bias=None, out_dtype=None, contraction_dim=(), use_fast_accum=False):
    import torch
    import torch.nn.functional as F
    from torch._meta_registrations import _meta_grouped_mm_common

    rowwise = int(F.ScalingType.RowWise.value)
    if len(scale_a) != 1 or len(scale_b) != 1 or list(recipe_a) != [rowwise] or list(recipe_b) != [rowwise] or list(contraction_dim):
        raise NotImplementedError(
            "the structure-only _scaled_grouped_mm_v2 kernel (conformance.draw.moe.v2_grouped_structure) takes one rowwise "
            f"scale per operand and the default contraction dims; got recipes {list(recipe_a)} / {list(recipe_b)}, "
            f"contraction_dim {list(contraction_dim)}"
        )
    return _meta_grouped_mm_common(
        mat_a, mat_b, scale_a=scale_a[0], scale_b=scale_b[0], offs=offs, bias=bias, scale_result=None,
        out_dtype=out_dtype or torch.bfloat16, use_fast_accum=use_fast_accum,
    )


def reference_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype):
    """What a rowwise FP8 grouped GEMM (``torch._scaled_grouped_mm``, or
    ``aten._scaled_grouped_mm_v2`` with ``RowWise`` scalings) computes, each operand times its
    inverse scales, multiplied in float64 and cast to ``out_dtype``. ``a`` (M, K) by ``b``
    (E, K, N): token group ``g`` (rows of ``a`` cut by ``offs``) by expert ``g``, scales
    ``(M,)`` and ``(E, N)``. ``a`` (N, M) by ``b`` (M, K): the groups cut the contraction dim,
    ``out[g] = a[:, g] @ b[g]``, scales ``(E * N,)`` and ``(E * K,)`` group-major. Any other
    operand shapes raise ``NotImplementedError``."""
    import torch

    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    if a.dim() == 2 and b.dim() == 3:
        lhs = a64 * scale_a.to(torch.float64).reshape(-1, 1)
        rhs = b64 * scale_b.to(torch.float64).reshape(b.shape[0], 1, b.shape[-1])
        out = lhs.new_zeros(a.shape[0], b.shape[-1])
        for g, (start, end) in enumerate(zip(starts, ends)):
            out[start:end] = lhs[start:end] @ rhs[g]
    elif a.dim() == 2 and b.dim() == 2:
        groups = len(ends)
        sa = scale_a.to(torch.float64).reshape(groups, a.shape[0])
        sb = scale_b.to(torch.float64).reshape(groups, b.shape[1])
        out = a64.new_zeros(groups, a.shape[0], b.shape[1])
        for g, (start, end) in enumerate(zip(starts, ends)):
            out[g] = (a64[:, start:end] * sa[g].reshape(-1, 1)) @ (b64[start:end] * sb[g])
    else:
        raise NotImplementedError(f"the suite's grouped GEMM reads 2-D by 3-D and 2-D by 2-D operands; got {a.dim()}-D by "
                                  f"{b.dim()}-D")
    return out.to(out_dtype or torch.bfloat16)


@contextlib.contextmanager
def v2_grouped_structure():
    """Within: ``aten._scaled_grouped_mm_v2`` has a Meta kernel (shapes, dtypes, strides and the
    operand checks of the rowwise recipe), so fake tensors trace it; outside, as torch ships it
    (see the module docstring). Where torch has a Meta kernel of its own, or no such op at all,
    nothing is registered."""
    import torch

    if not hasattr(torch.ops.aten, "_scaled_grouped_mm_v2") or has_v2_grouped_meta_kernel():
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    global _REGISTERED
    library = torch.library.Library("aten", "IMPL")
    try:
        library.impl("_scaled_grouped_mm_v2", _meta_scaled_grouped_mm_v2, "Meta")
        _REGISTERED = True
        yield
    finally:
        _REGISTERED = False
        library._destroy()
        FakeTensorMode.cache_clear()
