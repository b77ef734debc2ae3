"""What every property test shares: calling the backend safely, tracing once, failing clearly.

* :func:`call_backend` runs one adapter method; an exception becomes a failure that names the
  property, the backend method and the exception, so a misbehaving backend fails one property
  and the run goes on;
* :func:`traced` traces a drawn model once per session and backend (Hypothesis draws the same
  models for many properties) and hands each caller its own copy of the graph, so that what a
  backend tags or rewrites in place stays with that property; :func:`fresh_copy` gives another;
* :func:`fp8_ops` is the suite's ground truth of FP8 compute for a backend, built once, and
  :func:`fp8_compute_truth` of how much of it a traced graph must hold per (module, pass);
* :func:`serving` scopes a test to one backend: model strategies draw only the quantized module
  kinds it claims, and reproducers of models it converts name it;
* :func:`fail` prints the property ID, its spec line, what was expected versus seen, and the
  drawn model as runnable Python, and records for the report what the failure names (the
  model's modules and the graph's nodes, :mod:`conformance.observe.evidence`);
* :func:`names_module` / :func:`names_pass`: whether an error locates a module or a pass, by
  its attribute or, for a backend that cannot set it, in its message;
* :func:`require_subject`: a property whose subject is empty (no region reported, nothing to
  break) fails saying so, rather than passing on nothing or erroring in a strategy.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools

import pytest

from conformance.observe import evidence
from conformance.draw import strategies
from conformance.api.errors import ValidationFailure
from conformance.api.spec import get_property
from conformance.judge.dead_compute import ComputeTruth, compute_truth
from conformance.observe.graphs import Fp8Ops, Oracle, RewriteFailed, copy_graph_module, trace_and_rewrite, trace_with_oracle
from conformance.draw.models import ModelSpec, build_model

__all__ = [
    "compile_settings", "TracedCase", "fail", "check", "call_backend", "strict_error", "traced", "traced_graph", "fresh_copy",
    "fresh_args", "grad_outputs", "fp8_ops", "serving", "supported_kinds", "device", "names_module", "names_pass",
    "moe_settings", "note_kinds_left_out", "require_subject", "fp8_compute_truth", "declared_ops", "traced_before_rewrite", "traced_after_cse", "owns_float8", "float8_converter", "float8_config_settable", "built_with",
    "attributed",
]

#: The backend the running test checks, set by :func:`serving` (for reproducers only).
_SERVED = contextvars.ContextVar("conformance backend under test", default=None)
#: The device models are built, traced and checked on (``--fp8-device``), set by :func:`serving`.
_DEVICE = contextvars.ContextVar("conformance device", default="cpu")


@contextlib.contextmanager
def serving(backend, device: str = "cpu"):
    """Run one test against ``backend``: models are drawn with only the quantized module kinds it
    claims (:func:`supported_kinds`; experts on ``F.scaled_grouped_mm`` only when it claims
    ``scaled_grouped_mm_v2``), built on ``device``, and failing models print as code that
    builds them with it."""
    token, device_token = _SERVED.set(backend), _DEVICE.set(device)
    own = owns_float8(backend)
    try:
        with strategies.supported_kinds(
            supported_kinds(backend), grouped_v2="scaled_grouped_mm_v2" in backend.capabilities,
            float8_recipes=backend.float8_recipes if own else strategies.FLOAT8_RECIPES,
            float8_emulation=backend.float8_emulation if own else True,
        ):
            yield
    finally:
        _SERVED.reset(token)
        _DEVICE.reset(device_token)


def note_kinds_left_out(backend) -> None:
    """For a property that runs graphs: say in its report row which kinds the suite draws this
    device cannot run (``strategies.kinds_left_out``), and note them as left out for the coverage
    matrix (``evidence.left_out``), for a backend that claims the second scaled-matmul API."""
    from conformance.report.notes import note

    reason = strategies.kinds_left_out(device())
    if reason and "scaled_mm_v2" in backend.capabilities:
        note(reason)
        evidence.left_out(strategies.kinds_not_runnable(device()), reason)


def owns_float8(backend) -> bool:
    """Whether ``backend`` builds the float8 linears of the models it is shown (it claims
    ``float8_modules``: ``Backend.convert_float8``); TorchAO builds them otherwise."""
    return "float8_modules" in backend.capabilities


def float8_converter(backend):
    """What builds ``backend``'s float8 linears: its ``convert_float8``, or None for TorchAO."""
    return backend.convert_float8 if owns_float8(backend) else None


@functools.lru_cache(maxsize=16)
def float8_config_settable(backend) -> bool:
    """Whether the suite may set a ``Float8LinearConfig`` on ``backend``'s float8 linears (FPR's
    config-field changes, DP's float8 all-gather), building them with TorchAO: they are TorchAO's
    (it does not claim ``float8_modules``), or its ``convert_float8`` builds, for every recipe it
    declares, exactly TorchAO's ``Float8Linear`` with the config of TorchAO's recipe of that name
    (observed on a one-linear model), so that TorchAO's build differs from the backend's in the
    setting changed alone. A backend's own linears of another class have no such config."""
    if not owns_float8(backend):
        return True
    import torch
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    for recipe in sorted(backend.float8_recipes):
        model = torch.nn.Sequential(torch.nn.Linear(16, 16, bias=False))
        try:
            backend.convert_float8(model, module_filter_fn=lambda m, fqn: fqn == "0", recipe=recipe, emulate=False)
        except Exception:
            return False  # the properties that build its linears say what went wrong
        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=False)
        if type(model[0]) is not Float8Linear or model[0].config != config:
            return False
    return True


def device() -> str:
    """The device of the models of this run (``--fp8-device``; ``"cpu"`` by default)."""
    return _DEVICE.get()


def supported_kinds(backend) -> tuple[str, ...]:
    """The quantized module kinds the suite may show ``backend``: ``float8_linear`` always (TorchAO
    converts those), ``mxfp8_linear`` when it claims ``mx`` and so converts MX layers itself,
    ``float8_scaled_mm_linear`` when it claims ``scaled_mm_v2`` and converts linears on
    ``F.scaled_mm`` itself, ``nvfp4_linear`` when it claims ``nvfp4``; of MX layers only the
    recipes it declares (``Backend.mx_recipes``: ``mxfp8_linear`` for ``mxfp8`` and
    ``mxfp8_emulated``, the drawing kind ``mxfp8_swizzled`` for that recipe)."""
    claimed = {strategies.MX_KIND: "mx", strategies.SCALED_MM_KIND: "scaled_mm_v2", strategies.NVFP4_KIND: "nvfp4",
               strategies.MX_SWIZZLED_KIND: "mx"}
    mx_recipes = set(getattr(backend, "mx_recipes", ()))
    declared = {strategies.MX_KIND: "mxfp8" in mx_recipes, strategies.MX_SWIZZLED_KIND: "mxfp8_swizzled" in mx_recipes}
    return tuple(k for k in strategies.ALL_KINDS
                 if claimed.get(k) is None or (claimed[k] in backend.capabilities and declared.get(k, True)))


def fail(property_id: str, message: str, spec: ModelSpec | None = None) -> None:
    prop = get_property(property_id)
    text = f"[{property_id}] {prop.level}: {prop.title}\n{message}"
    model = spec if spec is not None else evidence.drawn_model()
    code = None
    if model is not None:
        backend = _SERVED.get()
        source = None if backend is None else f"{type(backend).__module__}:{type(backend).__qualname__}"
        own = backend is not None and owns_float8(backend) and getattr(model, "has_float8", lambda: False)()
        code = model.to_python(backend=source, own_float8=True) if own else model.to_python(backend=source)
    if spec is not None:
        text += "\n\nMinimal model (runnable):\n" + code
    # What the failure names, for the report's root causes: several properties failing on one
    # model and naming one module there are one defect (conformance.plugin.causes).
    size = getattr(model, "size", None)
    evidence.record_failure(
        property_id, message, modules=evidence.named_modules(message, _module_fqns(model)),
        size=size() if size is not None else None, code=code,
    )
    pytest.fail(text, pytrace=False)


def _module_fqns(spec) -> tuple[str, ...]:
    """Every module of ``spec``'s model a message may name: its linears, or its quantized modules."""
    if spec is None:
        return ()
    if hasattr(spec, "module_fqns"):
        return tuple(spec.module_fqns())
    return tuple(spec.quantized_modules())


def check(condition: bool, property_id: str, message: str, spec: ModelSpec | None = None) -> None:
    if not condition:
        fail(property_id, message, spec)


def call_backend(property_id: str, backend, method: str, *args, expect=None, passing=(), **kwargs):
    """Call ``backend.method``; any exception fails ``property_id`` naming the method, except
    those of the classes in ``passing``, which the caller judges (a contract refusal such as
    ``UnsupportedConfig``)."""
    try:
        result = getattr(backend, method)(*args, **kwargs)
    except passing:
        raise
    except Exception as exc:  # a backend bug must not take the session down
        fail(property_id, f"backend {backend.name!r}: {method}() raised {type(exc).__name__}: {exc}")
    if expect is not None and not isinstance(result, expect):
        fail(property_id, f"backend {backend.name!r}: {method}() returned {type(result).__qualname__}, expected {expect.__name__}")
    return result


def strict_error(property_id: str, backend, gm):
    """The ``conformance.api.ValidationFailure`` strict validation raises on ``gm``, or None when it
    accepts it; any other exception fails ``property_id``."""
    try:
        backend.validate(gm, strict=True)
    except ValidationFailure as exc:
        return exc
    except Exception as exc:
        fail(
            property_id,
            f"backend {backend.name!r}: validate() raised {type(exc).__name__}, not a conformance.api.ValidationFailure: {exc}",
        )
    return None


def names_module(exc, fqn: str) -> bool:
    """Whether ``exc`` locates module ``fqn``: its ``module_fqn`` attribute when the backend set
    one (it must be right), else the FQN named in its message."""
    given = getattr(exc, "module_fqn", None)
    return given == fqn if given is not None else evidence.is_named(str(exc), fqn)


def names_pass(exc, pass_name: str) -> bool:
    """Whether ``exc`` locates the ``pass_name`` pass, as :func:`names_module` does a module."""
    given = getattr(exc, "pass_name", None)
    return given == pass_name if given is not None else evidence.is_named(str(exc), pass_name)


def require_subject(items, property_id: str, what: str, spec: ModelSpec | None = None):
    """``items`` when there are any; otherwise fail ``property_id``: ``what`` is empty, so the
    property has nothing to judge (a backend reporting no region passes no region rule)."""
    items = list(items)
    if not items:
        fail(property_id, f"{what}: the property has nothing to check, which is a failure, not a pass", spec)
    return items


@functools.lru_cache(maxsize=None)
def _fp8_ops(backend) -> Fp8Ops:
    return Fp8Ops.of(backend)


def fp8_ops(property_id: str, backend) -> Fp8Ops:
    """The ops the suite counts as FP8 compute in ``backend``'s graphs, built once per backend."""
    try:
        return _fp8_ops(backend)
    except Exception as exc:
        fail(property_id, f"backend {backend.name!r}: e8m0_op() raised or returned no op: {type(exc).__name__}: {exc}")


@functools.lru_cache(maxsize=None)
def _declared_ops(backend) -> Fp8Ops:
    return Fp8Ops.declared_by(backend)


def declared_ops(property_id: str, backend) -> Fp8Ops:
    """The ops ``backend`` itself declares FP8 compute (``fp8_compute_ops``, its e8m0 op)."""
    try:
        return _declared_ops(backend)
    except Exception as exc:
        fail(property_id, f"backend {backend.name!r}: fp8_compute_ops() or e8m0_op() raised or returned no op: {type(exc).__name__}: {exc}")


def fp8_compute_truth(property_id: str, backend, spec, gm, oracle: Oracle) -> ComputeTruth:
    """The FP8 compute ``gm`` must hold per ``(fqn, pass)``: the recipe's count for what the step
    needs, what the graph keeps within the allowance (a grad_input nobody needs, kept for an
    in-place op) and the dead FP8 compute beyond it (SPEC.md, "Counting what the outputs need";
    :func:`conformance.judge.dead_compute.compute_truth`). Attributed by the suite's oracle, never by
    the backend's provenance; a functional graph keeps nothing, and its truth is the recipe's."""
    return compute_truth(spec, gm, oracle, fp8_ops(property_id, backend), lambda n: "backward" if backend.is_backward(n) else "forward")


def compile_settings():
    """Hypothesis settings for a property that compiles with Inductor in every example (seconds to
    tens of seconds each on CPU): one in twelve of the profile's examples, at least two."""
    from hypothesis import settings

    return settings(max_examples=max(2, settings.default.max_examples // 12))


def moe_settings():
    """Hypothesis settings for a property drawing MoE models (``strategies.moe_specs``): a sixth of
    the profile's examples, and never fewer than the shared MoE corpus holds under a
    derandomized profile: that corpus is a finite space (each feature, and both grouped APIs
    where the backend claims the second), taken whole whatever the profile's count."""
    from hypothesis import settings

    return settings(max_examples=max(strategies.MOE_CORPUS_SIZE, settings.default.max_examples // 6))


@dataclasses.dataclass
class TracedCase:
    spec: ModelSpec
    model: object
    args: tuple
    gm: object
    oracle: Oracle
    #: What the model's quantized modules were built with (:func:`built_with`).
    built: tuple = ()
    #: ``(gm, oracle)`` of the graph as traced, before the backend's rewrite (capability
    #: ``rewrites``; ``gm`` is then the rewritten graph), else None.
    before: tuple | None = None
    #: ``gm`` after torch's joint-graph CSE, made once when a property first asks
    #: (:func:`traced_after_cse`).
    after_cse: object = None


#: Who builds the quantized modules of each kind, when the backend does not (TorchAO).
_CONVERTERS = {
    "float8_linear": "convert_float8", "mxfp8_linear": "convert_mx", "float8_scaled_mm_linear": "convert_scaled_mm",
    "nvfp4_linear": "convert_nvfp4",
}


def built_with(backend, spec, model, *, float8_by_torchao: bool = False) -> tuple[tuple[str, ...], ...]:
    """``(family, kind, module class, recipe, built by)`` of each quantized module of ``spec``,
    read off the built ``model``: the class is what the module is, observed, not what was asked
    for. Noted for the report (:func:`conformance.observe.evidence.built`) by every property that
    builds one. ``float8_by_torchao``: the suite built the float8 linears with TorchAO although
    the backend claims ``float8_modules``, to set their config (:func:`float8_config_settable`)."""
    family = getattr(spec, "family", None) or "stacks"
    found = []
    for fqn, (kind, recipe, _emulate) in spec.quantized_modules().items():
        try:
            cls = type(model.get_submodule(fqn))
            module = f"{cls.__module__}.{cls.__qualname__}"
        except AttributeError:
            # A converter that moved the module: the report says so; the property that needs it fails.
            module = f"(no module at {fqn!r})"
        by = _CONVERTERS.get(kind, "")
        if kind == "float8_linear" and (float8_by_torchao or not owns_float8(backend)):
            by = "TorchAO"
        found.append((family, kind, module, recipe, by))
    return tuple(dict.fromkeys(found))


class _NotBuilt(Exception):
    """The drawn model could not be built (MX and scaled-matmul layers are converted by the backend)."""


@functools.lru_cache(maxsize=256)
def _trace(backend, spec: ModelSpec, device: str) -> TracedCase:
    try:
        if hasattr(spec, "build"):  # a model family (conformance.draw.families)
            model, args = spec.build(device, float8=float8_converter(backend))
        else:
            model, args = build_model(
                spec, device, mx=backend.convert_mx if "mx" in backend.capabilities else None,
                scaled_mm=backend.convert_scaled_mm if "scaled_mm_v2" in backend.capabilities else None,
                nvfp4=backend.convert_nvfp4 if "nvfp4" in backend.capabilities else None,
                float8=float8_converter(backend),
            )
    except Exception as exc:
        raise _NotBuilt(f"{type(exc).__name__}: {exc}") from exc
    built = built_with(backend, spec, model)
    fqns = list(spec.quantized_modules())
    if "rewrites" in backend.capabilities:
        done = trace_and_rewrite(backend, model, args, fqns, backend.is_backward)
        return TracedCase(spec, model, args, done.gm, done.oracle, built, (done.traced_gm, done.traced_oracle))
    gm, oracle = trace_with_oracle(backend, model, args, fqns, backend.is_backward)
    return TracedCase(spec, model, args, gm, oracle, built)


def traced(property_id: str, backend, spec: ModelSpec) -> TracedCase:
    """The backend's joint graph of ``spec``'s model, traced once per session.

    The case holds a copy of the cached graph (:func:`fresh_copy`): the backend may tag or
    rewrite it in place without another property seeing the change. The model is shared.
    """
    evidence.drawn(spec)
    try:
        cached = _trace(backend, spec, device())
    except RewriteFailed as exc:
        fail(property_id, f"backend {backend.name!r}: {exc}", spec)
    except _NotBuilt as exc:
        fail(property_id, f"backend {backend.name!r}: building the drawn model (its own float8 linears through convert_float8(), MX layers through convert_mx(), scaled-matmul layers through convert_scaled_mm(), NVFP4 layers through convert_nvfp4()) raised {exc}", spec)
    except Exception as exc:
        fail(property_id, f"backend {backend.name!r}: trace_joint() raised {type(exc).__name__}: {exc}", spec)
    evidence.built(cached.built)
    gm, oracle = fresh_copy(cached)
    return dataclasses.replace(cached, gm=gm, oracle=oracle)


def traced_after_cse(property_id: str, backend, spec: ModelSpec):
    """A copy of ``spec``'s graph (:func:`traced`) after torch's joint-graph CSE
    (:func:`conformance.judge.rewrites.eliminate_common_subexpressions`), which every property that
    asks shares: the merge is made once per traced case, each caller gets a graph of its own."""
    from conformance.judge.rewrites import eliminate_common_subexpressions

    traced(property_id, backend, spec)  # fails the property, saying why, where tracing does
    cached = _trace(backend, spec, device())
    if cached.after_cse is None:
        cached.after_cse = eliminate_common_subexpressions(cached.gm)
    return copy_graph_module(cached.after_cse)


def traced_before_rewrite(property_id: str, backend, spec: ModelSpec):
    """``(gm, oracle)``: a copy of ``spec``'s graph as the backend traced it, before its rewrite
    (capability ``rewrites``)."""
    case = traced(property_id, backend, spec)
    if case.before is None:
        fail(property_id, f"backend {backend.name!r} claims no rewrites: there is no graph before a rewrite", spec)
    return fresh_copy(dataclasses.replace(case, gm=case.before[0], oracle=case.before[1]))


def attributed(property_id: str, backend, oracle, nodes, spec: ModelSpec | None = None) -> list:
    """``nodes`` (FP8 compute of a traced graph), each of which the suite's own attribution
    (``oracle``) gives to a quantized module; where it gives one to none, ``property_id`` fails
    with the evidence (the node, its pass, its sequence number, the module calls the trace
    showed) instead of the suite going on with no module to judge."""
    nodes = list(nodes)
    lost = [n for n in nodes if oracle.issued_by.get(n) is None]
    if not lost:
        return nodes
    calls = sorted({c for c in oracle.call_of.values() if c is not None})

    def evidence_of(node) -> str:
        seq = node.meta.get("seq_nr")
        pass_name = "backward" if backend.is_backward(node) else "forward"
        why = ("its sequence number is no forward op's" if pass_name == "backward" and seq not in oracle.forward_seq_nrs
               else "it carries none of the suite's module annotations (node.meta['custom'])")
        return f"'{node.name}' ({node.target}, {pass_name}, seq_nr {seq}: {why})"

    fail(property_id,
         f"the suite's own attribution, its ground truth, gives FP8 compute to no quantized module: "
         f"{', '.join(evidence_of(n) for n in lost[:6])}{' ...' if len(lost) > 6 else ''}; the module calls the trace showed: "
         f"{calls or 'none'}. A pass that makes nodes without copying node.meta (provenance, seq_nr, custom), or a "
         "trace that records no module annotations, leaves FP8 compute nobody can be held to", spec)


def traced_graph(property_id: str, backend, spec: ModelSpec):
    """``(gm, oracle)`` of :func:`traced`: the caller's own copy of the graph, for a property that
    needs nothing else of the case."""
    case = traced(property_id, backend, spec)
    return case.gm, case.oracle


def fresh_copy(case: TracedCase):
    """Another copy of the case's graph (:func:`conformance.observe.graphs.copy_graph_module`), with the
    oracle's node keys mapped onto it by position."""
    gm = copy_graph_module(case.gm)
    by_position = dict(zip(case.gm.graph.nodes, gm.graph.nodes))
    oracle = Oracle(
        {by_position[n]: f for n, f in case.oracle.issued_by.items()},
        case.oracle.forward_seq_nrs,
        {by_position[n]: c for n, c in case.oracle.call_of.items()},
    )
    return gm, oracle


def fresh_args(spec: ModelSpec, seed: int, device: str | None = None) -> tuple:
    """New inputs for ``spec``'s model, drawn from ``seed`` (not the traced example inputs), on
    ``device`` (default: the run's)."""
    import torch

    device = device or _DEVICE.get()
    if hasattr(spec, "example_inputs"):  # a model family: token ids, or inputs of its own shape
        return spec.example_inputs(seed, device)
    generator = torch.Generator(device).manual_seed(seed)
    x = torch.randn(spec.batch, spec.in_features, device=device, generator=generator)
    return (x.requires_grad_(spec.input_requires_grad),)


def high_precision_twin(property_id: str, spec, model):
    """``spec``'s model with every quantized linear a plain ``nn.Linear`` holding the FP8 model's
    parameters (by FQN): the step the FP8 step stands in for."""
    import torch

    from conformance.draw.families import build_family
    from conformance.draw.models import build_model

    if hasattr(spec, "family"):
        twin, _ = build_family(spec, device(), plain=True)
    else:
        plain = dataclasses.replace(spec, layers=tuple(dataclasses.replace(l, recipe=None, emulate=False) for l in spec.layers))
        twin, _ = build_model(plain, device())
    theirs = dict(model.named_parameters())
    missing = [name for name, _ in twin.named_parameters() if name not in theirs or theirs[name].shape != _.shape]
    if missing:
        fail(property_id, f"the quantized model has no parameters {missing} of the shapes the plain model's have: the "
                        "suite compares gradients by parameter FQN, which a converted linear must keep", spec)
    with torch.no_grad():
        for name, p in twin.named_parameters():
            p.copy_(theirs[name])
    return twin


def eager_step(model, args, grad_outputs):
    """Outputs and gradients (``run_joint``'s convention) of ``model`` run eagerly with autograd."""
    import torch

    args = tuple(a.detach().clone().requires_grad_(a.requires_grad) if a.is_floating_point() else a for a in args)
    outputs = model(*args)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    torch.autograd.backward(outputs, grad_outputs)
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    grads.update({f"input.{i}": a.grad for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.grad is not None})
    return outputs, grads


def grad_outputs(spec: ModelSpec, seed: int, device: str | None = None) -> tuple:
    """Gradients of ``spec``'s model output, drawn from ``seed``, on ``device`` (default: the run's)."""
    import torch

    device = device or _DEVICE.get()
    if hasattr(spec, "example_grad_outputs"):
        return spec.example_grad_outputs(seed, device)
    generator = torch.Generator(device).manual_seed(seed)
    return (torch.randn(spec.batch, spec.layers[-1].width, device=device, generator=generator),)
