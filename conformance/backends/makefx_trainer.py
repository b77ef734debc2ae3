"""A small graph trainer's FP8 passes, traced with ``make_fx`` and ``torch.autograd.grad``.

This is the kind of trainer the conformance contract has to admit besides fp8conf: it does not
use AOT export, so its joint graph has no primals/tangents descriptors, and it records less:

* **tracing** (:func:`trace_train_step`): one training step, ``step(params, buffers, args,
  tangents) -> (outputs, param_grads, input_grads)``, traced by ``make_fx``; the backward is
  ``torch.autograd.grad`` inside the trace. Autograd hooks tell torch which forward op each
  backward op differentiates (``node.meta["seq_nr"]``), and every node gets the trainer's pass
  tag, ``node.meta["train_phase"]``: what was traced before the backward started is forward.
  The traced graph is not functional: torch's dead-code elimination keeps its in-place ops
  and what they read, so a grad_input nobody needs that TorchAO scales in place still runs;
* **provenance** in ``node.meta["custom"]``: ``module_fqn``, ``quantization_kind`` and
  ``quantization_emulate`` (no recipe), put on forward nodes by ``torch.fx.traceback.annotate``
  and copied to the backward nodes that differentiate them;
* **strict validation** (:func:`check_fp8_graph`) raises a plain ``RuntimeError`` listing
  ``(module_fqn, kind, pass)`` with what is wrong; non-strict mode warns and returns a
  :class:`Fp8CheckReport`;
* **job configuration** (:class:`TrainerConfig`), part of its artifact key.

Regions and the pipeline split live in :mod:`conformance.backends.makefx_stages`; the signature
and the whole-step artifact key in :mod:`conformance.backends.makefx_fingerprint`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import warnings
from pathlib import Path
from unittest import mock

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call

__all__ = [
    "PHASE_KEY", "STEP_KEY", "SIBLINGS_KEY", "TrainerConfig", "TrainStep", "QuantizedModule", "Fp8CheckReport",
    "quantized_modules", "trace_train_step", "run_train_step", "module_provenance", "module_call", "phase_of", "is_fp8_matmul",
    "check_fp8_graph",
]

#: The trainer's pass tag on every node: ``"forward"`` or ``"backward"``.
PHASE_KEY = "train_phase"
#: Key of the :class:`TrainStep` in ``gm.meta``.
STEP_KEY = "makefx_train_step"
#: Key, in a pipeline callable's ``gm.meta``, of the FP8 matmul counts its sibling callables hold.
SIBLINGS_KEY = "makefx_sibling_fp8_matmuls"
#: Provenance keys in ``node.meta["custom"]``.
FQN, KIND, EMULATE = "module_fqn", "quantization_kind", "quantization_emulate"
#: Which call of its module issued a node (0, 1, ... per module): two calls of a reused module are
#: two regions, never one.
CALL = "module_call"
_SCALED_MM = ("aten._scaled_mm.", "aten._scaled_mm_v2.", "aten._scaled_grouped_mm.")


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """The trainer's job settings. ``autocast_dtype`` changes quantized numerics (the forward
    runs under autocast, so what is cast to FP8 is rounded to it first); the others do not. The
    artifact key covers all of them (:func:`conformance.backends.makefx_fingerprint.step_key`).
    Quantized modules are not configured here field by field: a job names a recipe per module,
    and the trainer refuses a model whose config is none of the named recipes."""

    #: ``None`` (float32 forward) or a ``torch`` dtype name such as ``"bfloat16"``.
    autocast_dtype: str | None = None
    #: Named in the trainer's error messages.
    job_name: str = "train"
    #: When set, the generated code of every traced step is written into this folder.
    dump_folder: str | None = None


@dataclasses.dataclass(frozen=True)
class QuantizedModule:
    """A quantized module and the FP8 matmuls one call of it issues per gradient it computes."""

    fqn: str
    kind: str
    emulate: bool
    fp8_grad_input: bool
    fp8_grad_weight: bool


@dataclasses.dataclass(frozen=True)
class TrainStep:
    """What the traced step takes and what FP8 matmuls it must hold, per ``(fqn, pass)``."""

    param_names: tuple[str, ...]
    buffer_names: tuple[str, ...]
    input_requires_grad: tuple[bool, ...]
    modules: dict[str, QuantizedModule]
    expected_fp8_matmuls: dict[tuple[str, str], int]
    job_name: str


@dataclasses.dataclass(frozen=True)
class Fp8CheckReport:
    """``problems``: ``(what, module_fqn, pass, node, message)`` with ``what`` one of
    ``"missing"``, ``"count"``, ``"unattributed"``; ``counts`` per ``(module_fqn, pass)``."""

    problems: tuple[tuple[str, str | None, str | None, str | None, str], ...]
    counts: dict[tuple[str, str], int]
    summary: str


def quantized_modules(model: torch.nn.Module) -> dict[str, QuantizedModule]:
    """The model's TorchAO ``Float8Linear`` modules and the trainer's own linears
    (:mod:`conformance.backends.makefx_linear`: on ``F.scaled_mm`` with all three matmuls in FP8,
    and its float8 linears of TorchAO's recipe names) by FQN."""
    from torchao.float8.config import ScalingType
    from torchao.float8.float8_linear import Float8Linear

    from conformance.backends.makefx_linear import (
        FLOAT8_KIND, KIND, MX_KIND, NVFP4_KIND, Float8TrainerLinear, MXTrainerLinear, NVFP4TrainerLinear, ScaledMMTrainerLinear,
    )

    found = {}
    for fqn, module in model.named_modules():
        if isinstance(module, ScaledMMTrainerLinear):
            found[fqn] = QuantizedModule(fqn, KIND, False, fp8_grad_input=True, fp8_grad_weight=True)
        elif isinstance(module, MXTrainerLinear):
            found[fqn] = QuantizedModule(fqn, MX_KIND, False, fp8_grad_input=True, fp8_grad_weight=True)
        elif isinstance(module, NVFP4TrainerLinear):
            found[fqn] = QuantizedModule(fqn, NVFP4_KIND, module.emulate, fp8_grad_input=True, fp8_grad_weight=True)
        elif isinstance(module, Float8TrainerLinear):
            found[fqn] = QuantizedModule(
                fqn, FLOAT8_KIND, module.emulate, fp8_grad_input=True, fp8_grad_weight=module.recipe != "rowwise_with_gw_hp",
            )
        elif isinstance(module, Float8Linear):
            config = module.config
            found[fqn] = QuantizedModule(
                fqn, "float8_linear", bool(config.emulate),
                fp8_grad_input=config.cast_config_grad_output.scaling_type is not ScalingType.DISABLED,
                fp8_grad_weight=config.cast_config_input_for_grad_weight.scaling_type is not ScalingType.DISABLED,
            )
    return found


@contextlib.contextmanager
def _provenance_annotated(model, modules, calls):
    """Annotate each quantized module's forward ops; record ``(fqn, input_requires_grad,
    weight_requires_grad)`` per call. Nested modules: the inner annotation wins."""
    with contextlib.ExitStack() as stack:
        for fqn, info in modules.items():
            module = model.get_submodule(fqn)

            def forward(*args, _inner=module.forward, _info=info, _module=module, **kwargs):
                weight = getattr(_module, "weight", None)
                index = sum(call[0] == _info.fqn for call in calls)
                calls.append((_info.fqn, bool(args and getattr(args[0], "requires_grad", False)), bool(getattr(weight, "requires_grad", False))))
                with fx_traceback.annotate({FQN: _info.fqn, KIND: _info.kind, EMULATE: _info.emulate, CALL: index}):
                    return _inner(*args, **kwargs)

            stack.enter_context(mock.patch.object(module, "forward", forward))
        yield


@contextlib.contextmanager
def _backward_tagged(roots):
    """While autograd runs the backward inside the trace, give each op it issues the sequence
    number of the autograd node it belongs to (torch then records it as ``node.meta["seq_nr"]``,
    equal to that of the forward op it differentiates). Every node traced before is tagged
    forward; what the backward adds is left untagged and becomes backward (:func:`_tag_phases`)."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    for node in get_proxy_mode().tracer.graph.nodes:
        node.meta.setdefault(PHASE_KEY, "forward")
    handles, seen, stack = [], set(), [r for r in roots if r is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(fn for fn, _ in node.next_functions if fn is not None)
        seq_nr = node._sequence_nr()
        handles.append(node.register_prehook(lambda grad_outputs, _s=seq_nr: fx_traceback.set_grad_fn_seq_nr(_s)))
        handles.append(node.register_hook(lambda grad_inputs, grad_outputs: fx_traceback.reset_grad_fn_seq_nr()))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _autocast(config: TrainerConfig, device_type: str):
    if config.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=getattr(torch, config.autocast_dtype))


def trace_train_step(model: torch.nn.Module, args: tuple, config: TrainerConfig = TrainerConfig()) -> torch.fx.GraphModule:
    """Trace one training step of ``model(*args)``: forward, then ``torch.autograd.grad`` of the
    outputs with respect to the parameters and the inputs that require grad."""
    modules = quantized_modules(model)
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    device_type = next(iter(params.values())).device.type if params else "cpu"
    tangents = _zero_tangents(model, args, config, device_type)
    calls: list[tuple[str, bool, bool]] = []

    def step(params, buffers, args, tangents):
        calls.clear()  # only the traced run counts
        with _provenance_annotated(model, modules, calls), _autocast(config, device_type):
            outputs = tuple(pytree.tree_leaves(functional_call(model, {**params, **buffers}, args)))
        wanted = [p for p in params.values() if p.requires_grad] + [a for a in args if a.requires_grad]
        with _backward_tagged([o.grad_fn for o in outputs]):
            grads = iter(torch.autograd.grad(outputs, wanted, tangents, allow_unused=True))
        param_grads = {name: next(grads) if p.requires_grad else None for name, p in params.items()}
        input_grads = tuple(next(grads) if a.requires_grad else None for a in args)
        return outputs, param_grads, input_grads

    # Fake tracing: no compute, and every node's meta["val"] lives in one fake mode.
    with fx_traceback.preserve_node_meta():
        gm = make_fx(step, tracing_mode="fake")(params, buffers, tuple(args), tangents)
    _eliminate_dead_code(gm)
    _tag_phases(gm, len(tangents))
    _copy_provenance_to_backward(gm)
    gm.meta[STEP_KEY] = TrainStep(
        tuple(params), tuple(buffers), tuple(bool(a.requires_grad) for a in args), modules,
        _expected_fp8_matmuls(gm, modules, calls), config.job_name,
    )
    if config.dump_folder is not None:
        folder = Path(config.dump_folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{config.job_name}_step.py").write_text(gm.code)
    return gm


def _zero_tangents(model, args, config, device_type) -> tuple[torch.Tensor, ...]:
    """Zeros shaped like the step's outputs, their shapes found by a forward on fake tensors:
    the trainer never runs a matmul to trace (on some devices a recipe has no kernel)."""
    with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True), _autocast(config, device_type):
        outputs = pytree.tree_leaves(model(*args))
    return tuple(torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device=o.device).zero_() for o in outputs)


def _eliminate_dead_code(gm) -> None:
    # torch's own dead-code elimination, as a make_fx trainer runs it: every mutating op stays,
    # and with it what it reads. autograd's backward formulas compute gradients nobody asked for
    # (the grad_input of a first layer), and TorchAO scales a rowwise matmul's result in place
    # (``output *= scale``): that matmul then runs, as it does under torch's partitioner.
    gm.graph.eliminate_dead_code()
    gm.recompile()


def _kept_by_mutation(gm) -> list[torch.fx.Node]:
    """Nodes that run although no output depends on them: what an in-place op on a value
    nothing returns needs (:func:`_eliminate_dead_code` keeps both)."""
    needed, stack = set(), list(gm.graph.find_nodes(op="output"))
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack.extend(node.all_input_nodes)
    return [n for n in gm.graph.nodes if n not in needed and n.op == "call_function"]


def run_train_step(gm, model: torch.nn.Module, args: tuple, grad_outputs: tuple, *, fn=None) -> tuple[tuple, dict]:
    """Run the traced step (or ``fn``, called the same way) with ``model``'s current
    parameters; returns ``(outputs, grads)`` with grads keyed by parameter FQN and ``input.<i>``."""
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    outputs, param_grads, input_grads = (fn or gm)(params, buffers, tuple(args), tuple(grad_outputs))
    grads = {name: g for name, g in param_grads.items() if g is not None}
    grads.update({f"input.{i}": g for i, g in enumerate(input_grads) if g is not None})
    return tuple(outputs), grads


def _expected_fp8_matmuls(gm, modules, calls) -> dict[tuple[str, str], int]:
    """Per ``(fqn, pass)``: one forward FP8 matmul per call; backward one per gradient the step
    needs, plus the FP8 matmuls the traced step runs only for an in-place op (a grad_input that
    no one needs but TorchAO scales in place): they run, so they count."""
    expected: collections.Counter = collections.Counter()
    for fqn, input_grad, weight_grad in calls:
        info = modules[fqn]
        if info.emulate:
            continue
        expected[(fqn, "forward")] += 1
        expected[(fqn, "backward")] += (input_grad and info.fp8_grad_input) + (weight_grad and info.fp8_grad_weight)
    for node in _kept_by_mutation(gm):
        found = module_provenance(node)
        if is_fp8_matmul(node) and found is not None and not found[2]:
            expected[(found[0], phase_of(node))] += 1
    return dict(expected)


def _tag_phases(gm, num_tangents: int) -> None:
    # make_fx flattens (params, buffers, args, tangents) in order: the tangents are the last
    # placeholders, and belong to the backward.
    placeholders = gm.graph.find_nodes(op="placeholder")
    tangents = set(placeholders[len(placeholders) - num_tangents :])
    for node in gm.graph.nodes:
        backward = node.meta.get(PHASE_KEY) != "forward" or node in tangents or node.op == "output"
        node.meta[PHASE_KEY] = "backward" if backward else "forward"


def _copy_provenance_to_backward(gm) -> None:
    # A backward op differentiates the forward op that took its sequence number: the first one
    # carrying it (later ops, made under no_grad or before the next autograd node, may carry it too).
    first: dict[int, tuple] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.meta[PHASE_KEY] == "forward" and "seq_nr" in node.meta:
            first.setdefault(node.meta["seq_nr"], (module_provenance(node), module_call(node)))
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.meta[PHASE_KEY] != "backward":
            continue
        found = first.get(node.meta.get("seq_nr"))
        custom = {k: v for k, v in (node.meta.get("custom") or {}).items() if k not in (FQN, KIND, EMULATE, CALL)}
        if found is not None and found[0] is not None:
            (fqn, kind, emulate), call = found
            custom.update({FQN: fqn, KIND: kind, EMULATE: emulate, CALL: call})
        if custom:
            node.meta["custom"] = custom  # a new dict: tracing shares one between nodes
        else:
            node.meta.pop("custom", None)


def module_provenance(node: torch.fx.Node) -> tuple[str, str, bool] | None:
    """``(module_fqn, kind, emulate)`` recorded on ``node``, or None."""
    custom = node.meta.get("custom") or {}
    if FQN not in custom:
        return None
    return custom[FQN], custom.get(KIND), bool(custom.get(EMULATE))


def module_call(node: torch.fx.Node) -> int | None:
    """Which call of its module issued ``node``, or None."""
    return (node.meta.get("custom") or {}).get(CALL)


def phase_of(node: torch.fx.Node) -> str:
    """``"forward"`` or ``"backward"``. A node a rewrite created without the tag is backward when
    an input is, or when only backward nodes use it (a rebuilt cast of a saved value)."""
    phase = node.meta.get(PHASE_KEY)
    if phase is not None:
        return phase
    if any(phase_of(i) == "backward" for i in node.all_input_nodes):
        return "backward"
    users = [u for u in node.users if u.op != "output"]
    return "backward" if users and all(u.meta.get(PHASE_KEY) == "backward" for u in users) else "forward"


def _is_fp8(value) -> bool:
    dtype = getattr(value.meta.get("val"), "dtype", None) if isinstance(value, torch.fx.Node) else None
    return dtype in _LOW_PRECISION


#: FP8 dtypes and packed FP4 (NVFP4's elements), where torch has it.
_LOW_PRECISION = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz) + tuple(
    getattr(torch, name) for name in ("float4_e2m1fn_x2",) if hasattr(torch, name)
)


def is_fp8_matmul(node: torch.fx.Node) -> bool:
    """A scaled matmul whose two matrix operands are FP8 (or packed FP4)."""
    return (
        node.op == "call_function" and str(node.target).startswith(_SCALED_MM)
        and len(node.args) >= 2 and _is_fp8(node.args[0]) and _is_fp8(node.args[1])
    )


def check_fp8_graph(gm: torch.fx.GraphModule, *, strict: bool = True) -> Fp8CheckReport:
    """Check that every non-emulated quantized module issued its FP8 matmuls, forward and
    backward, and that no FP8 matmul is unattributed. Strict: a ``RuntimeError`` listing what
    is wrong; otherwise a warning per problem. Reads the graph only."""
    step: TrainStep | None = gm.meta.get(STEP_KEY)
    if step is None:
        raise RuntimeError("check_fp8_graph: this graph was not traced by trace_train_step (no gm.meta['makefx_train_step'])")
    counts: collections.Counter = collections.Counter()
    problems = []
    for node in gm.graph.nodes:
        if not is_fp8_matmul(node):
            continue
        found = module_provenance(node)
        if found is None:
            problems.append(("unattributed", None, phase_of(node), node.name,
                             f"FP8 matmul '{node.name}' ({phase_of(node)}) carries no module_fqn: its provenance was lost"))
        else:
            counts[(found[0], phase_of(node))] += 1
    siblings = gm.meta.get(SIBLINGS_KEY, {})
    for (fqn, phase), wanted in sorted(step.expected_fp8_matmuls.items()):
        have = counts[(fqn, phase)] + siblings.get((fqn, phase), 0)
        if have != wanted:
            what = "missing" if counts[(fqn, phase)] == 0 else "count"
            kind = step.modules[fqn].kind
            problems.append((what, fqn, phase, None, f"({fqn!r}, {kind!r}, {phase!r}): {have} FP8 matmul(s), expected {wanted}"))
    troubled = sorted({p[1] for p in problems if p[1]})
    summary = (
        f"job {step.job_name!r}: {sum(counts.values())} FP8 matmul(s) in {len({f for f, _ in counts})} module(s); "
        f"{len(problems)} problem(s)" + (f" in {', '.join(repr(m) for m in troubled)}" if troubled else "")
    )
    if problems and strict:
        raise RuntimeError(f"FP8 check failed for job {step.job_name!r}: " + "; ".join(p[4] for p in problems))
    for problem in problems:
        warnings.warn(f"FP8 check: {problem[4]}", RuntimeWarning, stacklevel=2)
    return Fp8CheckReport(tuple(problems), dict(counts), summary)
