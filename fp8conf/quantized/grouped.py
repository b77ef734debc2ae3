"""FP8 grouped experts for mixture-of-experts layers: rowwise FP8 through ``torch._scaled_grouped_mm``.

An experts module holds one weight per expert, ``weight`` of shape ``(E, N, K)`` (expert ``e``
maps ``K`` features to ``N``, as ``nn.Linear`` stacked), and is called as ``experts(x, offs)``:
``x`` is ``(M, K)``, its tokens sorted by expert, and ``offs`` the ``(E,)`` int32 end offsets of
the token groups (group ``e`` is ``x[offs[e-1]:offs[e]]``; a group may be empty; ``offs[-1]``
equals ``M``). :class:`Float8GroupedExperts` (kind ``float8_grouped_experts``, recipe
``rowwise``) runs its three grouped GEMMs in FP8, each operand quantized to ``float8_e4m3fn``
along the GEMM's contraction dim with power-of-two float32 scales:

* output ``x @ weight[e].T`` per group: ``x`` per token (over K), ``weight`` per expert and row;
* grad_input ``grad @ weight[e]`` per group: ``grad`` per token (over N), ``weight`` per expert
  and column;
* grad_weight ``grad[g].T @ x[g]`` per group ``g`` (a 2-D by 2-D grouped GEMM whose groups cut
  the contraction dim): both operands per group and feature, over that group's tokens only, so
  one group's outlier never coarsens another group's scale; an empty group's gradient is zero.

The quantization is plain torch ops (amax, scale, cast), so the module traces with fake tensors
on any device and its chains are ordinary graph nodes that region compilation can take in.
TorchAO's ``torchao.prototype.moe_training`` does the same math through Triton kernels, which
CPU builds without Triton cannot even register, so its path cannot be traced there.

With ``v2=True`` each of the three grouped GEMMs goes through torch's second scaled-matmul API,
``F.scaled_grouped_mm`` (``aten._scaled_grouped_mm_v2``, torch 2.12 and newer), naming both
operands' scaling ``RowWise``: the same operands, scales and result, the call trainers written
against today's API make. torch ships a CUDA kernel for it only (no CPU or Meta kernel), so such
experts run on sm90 GPUs and trace with fake tensors only where a Meta kernel is registered.

Recipe ``rowwise`` with ``emulate=True`` quantizes identically and multiplies the dequantized
operands (exact in bfloat16) with ``torch._grouped_mm`` (no FP8 compute: exempt from validation), which
also runs on CPU. :func:`convert_to_float8_grouped_experts` swaps a model's experts modules.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from fp8conf.arguments import require
from fp8conf.errors import GroupedExpertsError
from fp8conf.quantized.protocol import QuantizationConfig

__all__ = [
    "GROUPED_KIND",
    "GROUPED_RECIPES",
    "Float8GroupedExperts",
    "convert_to_float8_grouped_experts",
    "float8_grouped_mm",
    "has_scaled_grouped_mm_v2",
    "to_float8_rowwise",
    "to_float8_per_group",
    "token_groups",
]

#: The quantized module kind of :class:`Float8GroupedExperts`.
GROUPED_KIND = "float8_grouped_experts"
#: Its recipes.
GROUPED_RECIPES = ("rowwise",)
#: FP8 grouped GEMMs need every dim of both operands, and each group's token count for the
#: 2-D by 2-D weight-gradient GEMM, a multiple of 16 (16-byte alignment of e4m3 rows).
ALIGNMENT = 16

_E4M3 = torch.float8_e4m3fn
_E4M3_MAX = torch.finfo(_E4M3).max
# A floor under amax: an all-zero row (or an empty group) gets a large finite scale, not inf.
_AMAX_EPS = 1e-12


_F32_EXPONENT_MASK = 0x7F800000


def _power_of_two_scale(amax: torch.Tensor) -> torch.Tensor:
    # Power-of-two scales make quantize/dequantize exact exponent shifts (torchao's MoE recipe).
    # Rounding down by clearing the mantissa bits, not through log2/exp2, gives the same scale in
    # eager and in every compiled kernel: a log2 approximation one ulp off at a power of two would
    # halve a scale only in the compiled graph.
    scale = _E4M3_MAX / amax.to(torch.float32).clamp(min=_AMAX_EPS)
    return (scale.view(torch.int32) & _F32_EXPONENT_MASK).view(torch.float32)


def _cast(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # bfloat16 has float32's exponent range, so a bfloat16 value times a power-of-two scale is
    # exact in bfloat16 (what falls below its normal range is far below e4m3's smallest value):
    # scaling there gives the same e4m3 bytes as in float32 with temporaries half the size.
    if x.dtype == torch.bfloat16:
        scaled = x * scale.to(torch.bfloat16)
    else:
        scaled = x.to(torch.float32) * scale
    return scaled.clamp(-_E4M3_MAX, _E4M3_MAX).to(_E4M3)


def to_float8_rowwise(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` as e4m3 with one power-of-two scale per slice along ``dim`` (kept, size 1).

    Returns ``(data, scale)``, ``data * (1 / scale)`` approximating ``x``."""
    scale = _power_of_two_scale(x.abs().amax(dim=dim, keepdim=True))
    return _cast(x, scale), scale


def token_groups(offs: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The expert group of each of ``num_tokens`` tokens, from the end offsets ``offs``."""
    positions = torch.arange(num_tokens, device=offs.device, dtype=offs.dtype)
    return torch.searchsorted(offs, positions, right=True).clamp(max=offs.shape[0] - 1)


def to_float8_per_group(x: torch.Tensor, groups: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (M, C) as e4m3 with one scale per (group, column), its amax over that group's rows.

    Returns ``(data, scale)`` with ``scale`` of shape ``(num_groups, C)``. Each group's amax is
    a masked reduction over all rows, so shapes are static whatever the group sizes."""
    # One masked max per group, not a scatter_reduce into (groups, C): on CUDA that scatter
    # serialises every row of a group on the same addresses (18 ms of a 25 ms MoE step on an
    # H200), where these are plain reductions Inductor fuses. The amax is exact in x's dtype.
    magnitude = x.abs()
    zero = magnitude.new_zeros(())
    amax = torch.stack([torch.where((groups == g).unsqueeze(1), magnitude, zero).amax(dim=0) for g in range(num_groups)])
    index = groups.to(torch.int64).unsqueeze(1).expand(-1, x.shape[1])
    scale = _power_of_two_scale(amax)
    row_scale = scale.to(torch.bfloat16) if x.dtype == torch.bfloat16 else scale  # exact: see _cast
    return _cast(x, row_scale.gather(0, index)), scale


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(-2, -1).contiguous().transpose(-2, -1)


def has_scaled_grouped_mm_v2() -> bool:
    """Whether this torch has ``torch.nn.functional.scaled_grouped_mm`` (torch 2.12 and newer)."""
    functional = torch.nn.functional
    return hasattr(functional, "scaled_grouped_mm") and hasattr(functional, "ScalingType")


def _scaled_grouped(a, b, a_scale, b_scale, offs, v2: bool) -> torch.Tensor:
    """One FP8 grouped GEMM; ``a_scale`` / ``b_scale`` are the inverse scales laid out as
    ``torch._scaled_grouped_mm`` takes them (its FP8 kernels write bfloat16). ``v2``: through
    ``F.scaled_grouped_mm`` with both scalings named ``RowWise`` (the same scale tensors)."""
    if v2:
        rowwise = torch.nn.functional.ScalingType.RowWise
        return torch.nn.functional.scaled_grouped_mm(
            a, b, a_scale, rowwise, b_scale, rowwise, offs=offs, output_dtype=torch.bfloat16
        )
    return torch._scaled_grouped_mm(a, b, a_scale, b_scale, offs, out_dtype=torch.bfloat16)


def _dequant(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # An e4m3 value over a power of two is exact in bfloat16, the dtype torch._grouped_mm takes:
    # computing there needs no float32 copy of the operand.
    return data.to(torch.bfloat16) / scale.to(torch.bfloat16)


# allow_in_graph: Dynamo records the Function as one call, and AOTAutograd traces its forward and
# backward through autograd itself (as for MXLinear).
@torch._dynamo.allow_in_graph
class _Float8GroupedMM(torch.autograd.Function):
    """``out[g] = x[g] @ weight[e_g].T`` for every token group, its three GEMMs in rowwise FP8.

    The high-precision ``x`` and ``weight`` are saved: the backward quantizes them along other
    dims than the forward did.
    """

    @staticmethod
    def forward(ctx, x, weight, offs, emulate: bool, v2: bool):
        ctx.save_for_backward(x, weight, offs)
        ctx.emulate, ctx.v2 = emulate, v2
        x_data, x_scale = to_float8_rowwise(x, dim=-1)
        w_data, w_scale = to_float8_rowwise(weight, dim=-1)
        if emulate:
            out = torch._grouped_mm(_dequant(x_data, x_scale), _dequant(w_data, w_scale).transpose(-2, -1), offs=offs)
        else:
            # (E, N, K) contiguous, transposed: the column-major (E, K, N) right operand.
            out = _scaled_grouped(x_data, w_data.transpose(-2, -1), x_scale.reciprocal().squeeze(-1),
                                  w_scale.reciprocal().squeeze(-1), offs, v2)
        # In x's dtype from inside the Function, so the backward quantizes the gradient as it
        # arrives: a bfloat16 round trip before the cast is one that compilers may fuse away
        # (Inductor does not round fused intermediates), and the FP8 bytes would then differ.
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, offs = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = _grad_input(grad_out, weight, offs, ctx.emulate, ctx.v2).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = _grad_weight(grad_out, x, offs, weight.shape[0], ctx.emulate, ctx.v2).to(weight.dtype)
        return grad_x, grad_w, None, None, None


def _grad_input(grad_out, weight, offs, emulate: bool, v2: bool) -> torch.Tensor:
    g_data, g_scale = to_float8_rowwise(grad_out, dim=-1)
    w_data, w_scale = to_float8_rowwise(weight, dim=-2)  # per expert and column, over N
    if emulate:
        return torch._grouped_mm(_dequant(g_data, g_scale), _dequant(w_data, w_scale), offs=offs)
    return _scaled_grouped(g_data, _column_major(w_data), g_scale.reciprocal().squeeze(-1),
                           w_scale.reciprocal().squeeze(-2).contiguous(), offs, v2)


def _grad_weight(grad_out, x, offs, num_experts: int, emulate: bool, v2: bool) -> torch.Tensor:
    groups = token_groups(offs, x.shape[0])
    g_data, g_scale = to_float8_per_group(grad_out, groups, num_experts)
    x_data, x_scale = to_float8_per_group(x, groups, num_experts)
    if emulate:
        index = groups.to(torch.int64).unsqueeze(1)
        g_dq = _dequant(g_data, g_scale.to(torch.bfloat16).gather(0, index.expand_as(g_data)))
        x_dq = _dequant(x_data, x_scale.to(torch.bfloat16).gather(0, index.expand_as(x_data)))
        return torch._grouped_mm(g_dq.t().contiguous(), x_dq, offs=offs)
    # Scales of the 2-D x 2-D grouped GEMM: one per (group, row of a) and (group, column of b),
    # group-major.
    return _scaled_grouped(g_data.t().contiguous(), _column_major(x_data), g_scale.reciprocal().reshape(-1),
                           x_scale.reciprocal().reshape(-1), offs, v2)


def float8_grouped_mm(
    x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, *, emulate: bool = False, v2: bool = False
) -> torch.Tensor:
    """Differentiable ``x[g] @ weight[e_g].T`` per token group with rowwise FP8 (see the module
    docstring; ``v2``: through ``F.scaled_grouped_mm``); the result has ``x``'s dtype."""
    return _Float8GroupedMM.apply(x, weight, offs, emulate, v2)


def _v2_problem(v2: bool) -> str | None:
    if v2 and not has_scaled_grouped_mm_v2():
        return (f"v2=True needs torch.nn.functional.scaled_grouped_mm, which torch {torch.__version__} lacks "
                "(torch 2.12 and newer have it); leave v2=False to use torch._scaled_grouped_mm")
    return None


def _dims_problem(weight: torch.Tensor) -> str | None:
    if weight.dim() != 3:
        return f"weight has shape {tuple(weight.shape)}, expected (experts, out_features, in_features)"
    bad = [f"{name}={value}" for name, value in zip(("out_features", "in_features"), weight.shape[1:]) if value % ALIGNMENT]
    return f"{', '.join(bad)} not a multiple of {ALIGNMENT}" if bad else None


class Float8GroupedExperts(nn.Module):
    """Experts whose grouped GEMMs, forward and backward, run in rowwise FP8.

    Attributes:
        quant_kind: ``"float8_grouped_experts"`` (the kind fp8conf's provenance names).
        recipe: ``"rowwise"``.
        emulate: quantize identically but multiply in float32 (no FP8 compute).
        v2: the grouped GEMMs go through ``F.scaled_grouped_mm`` (``aten._scaled_grouped_mm_v2``)
            instead of ``torch._scaled_grouped_mm``.
        weight: ``(num_experts, out_features, in_features)``.

    ``forward(x, offs)``: ``x`` (M, in_features), tokens sorted by expert, ``offs`` the (E,)
    int32 group end offsets; returns (M, out_features) in ``x``'s dtype. On real FP8 hardware
    each group's token count must be a multiple of 16 (pad groups with zero rows).
    """

    quant_kind = GROUPED_KIND

    def __init__(self, weight: nn.Parameter, *, recipe: str = "rowwise", emulate: bool = False, v2: bool = False):
        super().__init__()
        if recipe not in GROUPED_RECIPES:
            raise GroupedExpertsError(f"Float8GroupedExperts: recipe must be one of {GROUPED_RECIPES}, got {recipe!r}")
        if not isinstance(weight, torch.Tensor):
            raise GroupedExpertsError(f"Float8GroupedExperts(weight=...): expected a 3-d Parameter (experts, out, in), got {type(weight).__name__}")
        problem = _dims_problem(weight)
        if problem:
            raise GroupedExpertsError(f"Float8GroupedExperts: {problem}")
        if _v2_problem(v2):
            raise GroupedExpertsError(f"Float8GroupedExperts: {_v2_problem(v2)}")
        self.weight = weight
        self.recipe = recipe
        self.emulate = bool(emulate)
        self.v2 = bool(v2)

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[-1] != self.weight.shape[-1]:
            raise GroupedExpertsError(
                f"Float8GroupedExperts: `x` must be (tokens, {self.weight.shape[-1]}), got {tuple(x.shape)}"
            )
        if offs.dtype != torch.int32 or tuple(offs.shape) != (self.num_experts,):
            raise GroupedExpertsError(
                f"Float8GroupedExperts: `offs` must be an int32 tensor of shape ({self.num_experts},), "
                f"got {offs.dtype} {tuple(offs.shape)}"
            )
        return float8_grouped_mm(x, self.weight, offs, emulate=self.emulate, v2=self.v2)

    def fp8_quantization(self) -> QuantizationConfig:
        """The quantized-module protocol; ``v2`` is a setting for experts on ``F.scaled_grouped_mm``
        only (the compiled code calls one API or the other), so the signatures of experts on the
        first API are what they were."""
        return QuantizationConfig(kind=self.quant_kind, recipe=self.recipe, emulate=self.emulate, settings={"v2": True} if self.v2 else {})

    def extra_repr(self) -> str:
        experts, out_features, in_features = self.weight.shape
        return f"experts={experts}, in_features={in_features}, out_features={out_features}, recipe={self.recipe}, emulate={self.emulate}" + (
            ", v2=True" if self.v2 else ""
        )


def _experts_to_convert(model: nn.Module, module_filter_fn) -> list[tuple[str, nn.Module]]:
    found = []
    for fqn, module in model.named_modules(remove_duplicate=False):
        weight = getattr(module, "weight", None)
        if isinstance(module, Float8GroupedExperts) or not isinstance(weight, nn.Parameter) or weight.dim() != 3:
            continue
        if module_filter_fn is not None and not module_filter_fn(module, fqn):
            continue
        problem = _dims_problem(weight)
        if problem:
            raise GroupedExpertsError(
                f"convert_to_float8_grouped_experts: experts module {fqn or '<root>'!r}: {problem}; exclude it with "
                "module_filter_fn or resize it",
                module_fqn=fqn,
            )
        found.append((fqn, module))
    return found


def convert_to_float8_grouped_experts(
    model: nn.Module,
    *,
    recipe: str = "rowwise",
    emulate: bool = False,
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
    v2: bool = False,
) -> nn.Module:
    """Swap, in place, the experts modules of ``model`` for :class:`Float8GroupedExperts`
    (``v2``: whose grouped GEMMs go through ``F.scaled_grouped_mm``, torch 2.12 and newer).

    An experts module is one with a 3-D ``weight`` Parameter ``(E, out, in)`` called as
    ``module(x, offs)`` with the grouped semantics of this module's docstring;
    ``module_filter_fn(module, fqn)`` picks among them. The Parameter is taken over, not copied.
    Every candidate is checked before any is swapped. Returns ``model`` (or the new module when
    ``model`` itself is converted).

    Raises:
        GroupedExpertsError: (a ``ValueError``) naming an experts module whose dims are not
            multiples of 16, for an unknown ``recipe``, or for ``v2`` on a torch without
            ``F.scaled_grouped_mm``.
    """
    require(model, "model", "convert_to_float8_grouped_experts", "model")
    if recipe not in GROUPED_RECIPES:
        raise GroupedExpertsError(f"convert_to_float8_grouped_experts: recipe must be one of {GROUPED_RECIPES}, got {recipe!r}")
    if _v2_problem(v2):
        raise GroupedExpertsError(f"convert_to_float8_grouped_experts: {_v2_problem(v2)}")
    converted: dict[int, Float8GroupedExperts] = {}
    for fqn, module in _experts_to_convert(model, module_filter_fn):
        if id(module) not in converted:
            converted[id(module)] = Float8GroupedExperts(module.weight, recipe=recipe, emulate=emulate, v2=v2)
        if fqn == "":
            return converted[id(module)]
        parent_fqn, _, name = fqn.rpartition(".")
        setattr(model.get_submodule(parent_fqn), name, converted[id(module)])
    return model
