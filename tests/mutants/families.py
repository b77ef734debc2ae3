"""Mutant backends whose defect needs what real trainers run: modules of one leaf name under two
parents, a model's own annotations, token groups made only of padding, operands laid out as a
linear layer passes them. The suite's stacks of linears never show them any of these; the model
families and the forced shapes do (``conformance/draw/families.py``, MOE-006/007's padding groups,
E8M0-001's layouts).
"""

from __future__ import annotations

import contextlib
import dataclasses
import types

import torch
import torch.fx.traceback as fx_traceback

import fp8conf.graph.provenance
import fp8conf.graph.trace
from conformance.backends.reference import ReferenceBackend
from fp8conf.quantized import grouped
from fp8conf.graph.regions import identify_fp8_regions
from fp8conf.quantized.protocol import find_quantized_modules
from mutants.backends import _replaced
from mutants.regions import _tag


def _block_and_leaf(fqn: str) -> tuple[str, str]:
    """``(repeated block, leaf name)``: ``layers.3.attention.wq`` -> ``("layers.3", "wq")``; a
    module outside every block belongs to the model's top level, ``""``."""
    parts = fqn.split(".")
    index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    return (".".join(parts[: index + 1]) if index is not None else ""), parts[-1]


def _configs_keyed_by_leaf(model):
    found = find_quantized_modules(model)
    by_key = {_block_and_leaf(fqn): config for fqn, config in found.items()}  # the last one registered wins
    return {fqn: by_key[_block_and_leaf(fqn)] for fqn in found}


class ConfigsKeyedByLeafName(ReferenceBackend):
    """Looks a module's config up by its leaf name within its block (``wq``, ``w1``: how recipes
    name a block's linears), modules outside every block by leaf name alone: ``attn.proj`` and
    ``mlp.proj`` share the config of the one registered last."""

    name = "mutant-configs-keyed-by-leaf-name"
    KILLED_BY = "PROV-002"

    def trace_joint(self, model, args):
        with _replaced(fp8conf.graph.trace, "find_quantized_modules", _configs_keyed_by_leaf):
            return super().trace_joint(model, args)


def _short_name(fqn: str) -> str:
    """A module as a compile log names it: its block and leaf name (``layers.3.wq``), its leaf
    name alone outside every block (``proj``), a block by itself."""
    block, leaf = _block_and_leaf(fqn)
    return fqn if block == fqn else f"{block}.{leaf}" if block else leaf


class RegionIdsByShortName(ReferenceBackend):
    """Names each region after its module's block and leaf name instead of its FQN: the regions
    of ``attn.proj`` and ``mlp.proj`` share ids (``proj/forward/call0/0``), and regional
    Inductor compiles the two modules' nodes as one piece."""

    name = "mutant-region-ids-by-short-name"
    KILLED_BY = "REG-002"

    def regions(self, gm):
        found = identify_fp8_regions(gm)
        return _tag(gm, [dataclasses.replace(r, id=r.id.replace(r.module_fqn, _short_name(r.module_fqn), 1)) for r in found])


@contextlib.contextmanager
def _replacing_annotate(annotation: dict):
    # Starts the annotations afresh from the tracer's own keys and this one, instead of adding it
    # to those already open: as a tracer that rebuilds node.meta["custom"] from its provenance.
    meta = fx_traceback.current_meta
    had, before = "custom" in meta, meta.get("custom") or {}
    meta["custom"] = {**{k: v for k, v in before.items() if k.startswith("fp8conf.")}, **annotation}
    try:
        yield
    finally:
        if had:
            meta["custom"] = before
        else:
            meta.pop("custom", None)


class TracingReplacesUserAnnotations(ReferenceBackend):
    """Annotates each quantized module's ops with its provenance by replacing the open
    ``torch.fx.traceback`` annotations with its own keys, not adding to them: a model's own
    annotations (a pipeline stage, a part) never reach the nodes its quantized modules issue."""

    name = "mutant-tracing-replaces-user-annotations"
    KILLED_BY = "REG-007"

    def trace_joint(self, model, args):
        shim = types.SimpleNamespace(**{**vars(fx_traceback), "annotate": _replacing_annotate})
        with _replaced(fp8conf.graph.provenance, "fx_traceback", shim):
            return super().trace_joint(model, args)


def _floor_for_empty_groups_only(x, groups, num_groups):
    # The reference's per-group quantization, its amax floor kept only for groups without rows:
    # a group whose rows are all padding has amax 0, an infinite scale, and 0 * inf = NaN.
    magnitude = x.abs()
    zero = magnitude.new_zeros(())
    amax = torch.stack([torch.where((groups == g).unsqueeze(1), magnitude, zero).amax(dim=0) for g in range(num_groups)])
    empty = torch.stack([(groups == g).sum() == 0 for g in range(num_groups)]).unsqueeze(1)
    amax = torch.where(empty, torch.full_like(amax, grouped._AMAX_EPS), amax).to(torch.float32)
    scale = ((grouped._E4M3_MAX / amax).view(torch.int32) & grouped._F32_EXPONENT_MASK).view(torch.float32)
    index = groups.to(torch.int64).unsqueeze(1).expand(-1, x.shape[1])
    row_scale = scale.to(torch.bfloat16) if x.dtype == torch.bfloat16 else scale
    return grouped._cast(x, row_scale.gather(0, index)), scale


class AmaxFloorOnlyForEmptyGroups(ReferenceBackend):
    """Floors the per-group amax of the grad_weight operands only for empty groups, as if a group
    with rows always held a nonzero one; a group of padding rows alone gets NaN."""

    name = "mutant-amax-floor-only-for-empty-groups"
    KILLED_BY = "MOE-007"

    def trace_joint(self, model, args):
        with _replaced(grouped, "to_float8_per_group", _floor_for_empty_groups_only):
            return super().trace_joint(model, args)


def _as_row_major(t: torch.Tensor) -> torch.Tensor:
    # What a kernel handed data_ptr() reads when it assumes row-major storage, whatever the strides.
    return torch.as_strided(t, t.shape, (t.shape[1], 1))


class E8M0OperandsReadRowMajor(ReferenceBackend):
    """Reads the e8m0 op's operands as row-major storage: right for contiguous ``a`` and ``b``,
    wrong for ``b = weight.t()`` (column-major) and for a non-contiguous ``a``."""

    name = "mutant-e8m0-operands-read-row-major"
    KILLED_BY = "E8M0-001"

    def scaled_mm_e8m0(self, a, b, a_scale, b_scale, out_dtype):
        return super().scaled_mm_e8m0(_as_row_major(a), _as_row_major(b), a_scale, b_scale, out_dtype)


#: What a linear layer's backward node is called: ``MmBackward0`` / ``AddmmBackward0`` (a plain
#: ``nn.Linear``), TorchAO's ``matmul_with_hp_or_float8_argsBackward``, fp8conf's MX linear.
_LINEAR_BACKWARDS = ("mmbackward", "matmul", "linear")


def _fed_by_data_or_a_linear(value, data_nodes) -> bool:
    """Whether a call's input needs a gradient, as a trainer written for stacks of linears decides
    it: when the step's input, requiring one, or a linear layer's output lies upstream of it
    (``data_nodes``: the autograd nodes of the step's inputs that require a gradient). The
    parameters of other ops (an embedding's, a norm's) are not looked for."""
    if not getattr(value, "requires_grad", False):
        return False
    stack, seen = [value.grad_fn], []
    while stack:
        fn = stack.pop()
        if fn is None or any(fn is s for s in seen):
            continue
        seen.append(fn)
        if any(fn is d for d in data_nodes) or any(name in type(fn).__name__.lower() for name in _LINEAR_BACKWARDS):
            return True
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return False


class InputGradOnlyAfterALinear(ReferenceBackend):
    """Decides which calls need a grad_input matmul as a trainer written for stacks of linears
    does: a call's input needs a gradient when the step's input (requiring one) or a linear
    layer's output lies upstream of it. What comes before the first linear (an embedding, a
    norm) counts as data preprocessing, its parameters as nothing a gradient flows to, so the q,
    k and v projections fed by the embedding through RMSNorm are expected to issue no grad_input
    matmul, and strict validation rejects the step's correct graph: the grad_input matmuls that
    the embedding's and the norm's weights need."""

    name = "mutant-input-grad-only-after-a-linear"
    KILLED_BY = "VAL-001"

    def trace_joint(self, model, args):
        data_nodes: list = []
        annotated_forward = fp8conf.graph.provenance._annotated_forward

        def step(*step_args, **kwargs):
            # The tracer calls the model on its own (functional) copies of the inputs: read them here.
            data_nodes[:] = [a.grad_fn for a in step_args if isinstance(a, torch.Tensor) and a.grad_fn is not None]
            return forward(*step_args, **kwargs)

        def judged_forward(module, fqn, counters, calls):
            inner = annotated_forward(module, fqn, counters, calls)

            def judged(*call_args, **kwargs):
                first = call_args[0] if call_args else next(iter(kwargs.values()), None)
                before = len(calls)
                result = inner(*call_args, **kwargs)
                calls[before] = dataclasses.replace(calls[before], input_requires_grad=_fed_by_data_or_a_linear(first, data_nodes))
                return result

            return judged

        own, forward = model.__dict__.get("forward"), model.forward
        model.forward = step
        try:
            with _replaced(fp8conf.graph.provenance, "_annotated_forward", judged_forward):
                return super().trace_joint(model, args)
        finally:
            if own is None:
                del model.forward
            else:
                model.forward = own

MUTANTS = [ConfigsKeyedByLeafName, RegionIdsByShortName, TracingReplacesUserAnnotations, AmaxFloorOnlyForEmptyGroups, E8M0OperandsReadRowMajor, InputGradOnlyAfterALinear]
