"""Traced graphs shared by the sessions of one process of fp8conf's tests (``tests/suite_runs.py``).

The suite traces each drawn model once per session and backend (``conformance.run.harness.traced``):
a user's run has one session and one backend. fp8conf's own tests run many sessions in one
process, each against a new backend, most of them mutants of the reference whose tracing is the
reference's own: the mutants of one area take the same smallest models first, and the runs of one
property with and without a capability draw the same ones. :func:`install` lets those sessions
share the traces, keyed by what tracing a model involves:

* the functions the backend's class gives ``trace_joint`` and ``is_backward``; ``convert_mx``,
  ``convert_scaled_mm``, ``convert_nvfp4`` and ``convert_float8`` where it claims ``mx`` /
  ``scaled_mm_v2`` / ``nvfp4`` / ``float8_modules`` and the model holds layers they build (they
  build them); every other ``convert_*`` it has, for any model; ``rewrite`` where it claims
  ``rewrites`` (the case holds the rewritten graph); plus every attribute of the class those
  functions name, transitively (a mutant that overrides a helper the tracer calls traces on its own);
* the drawn model's spec and the device.

A backend instance with state of its own (anything in its ``__dict__`` but the suite's watch on
its methods, ``conformance.run.watchdog.track``) or an attribute that cannot
be a key shares nothing. The model of a shared case is shared too; sessions must leave its
parameters as they found them (the suite's properties restore what they change), and
:func:`check_models_kept` drops, and says so, any case whose parameters a session changed.
"""

from __future__ import annotations

import collections
import dataclasses

__all__ = ["install", "check_models_kept", "tracing_identity"]

#: Traces kept, as ``conformance.run.harness`` keeps per session.
_MAX_CASES = 256


def tracing_identity(backend, spec=None):
    """What tracing ``spec``'s model with ``backend`` depends on, or None when that cannot be
    told. The converters count only for a model holding layers they build (``spec`` None: any)."""
    cls = type(backend)
    if any(not _is_watched_method(cls, name, value) for name, value in vars(backend).items()):
        return None
    names = {"trace_joint", "is_backward"}
    needs = {capability: spec is None or _holds(spec, question) for capability, (question, _) in _CONVERTERS.items()}
    needs["rewrites"] = True  # the cached case holds the rewritten graph
    capabilities = frozenset(c for c in backend.capabilities if needs.get(c))
    for capability, (_, attributes) in _CONVERTERS.items():
        names |= set(attributes) if capability in capabilities else set()
    names |= {"rewrite"} if "rewrites" in capabilities else set()
    # A converter no spec question covers (grouped experts', one a later contract adds) counts
    # for every model: a mutant that overrides it traces on its own rather than borrowing the
    # reference's modules and passing for them.
    names |= {name for name in dir(cls) if name.startswith("convert_") and not any(name in a for _, a in _CONVERTERS.values())}
    todo = list(names)
    while todo:
        code = getattr(getattr(cls, todo.pop(), None), "__code__", None)
        for name in code.co_names if code is not None else ():
            if name not in names and hasattr(cls, name):
                names.add(name)
                todo.append(name)
    key = (tuple(sorted((name, getattr(cls, name)) for name in names)), capabilities)
    try:
        hash(key)
    except TypeError:
        return None
    return key


#: capability -> (the spec's question whether its model holds layers of it, the backend's
#: attributes that build them).
_CONVERTERS = {
    "mx": ("has_mx", ("convert_mx",)),
    "scaled_mm_v2": ("has_scaled_mm", ("convert_scaled_mm",)),
    "nvfp4": ("has_nvfp4", ("convert_nvfp4",)),
    "float8_modules": ("has_float8", ("convert_float8", "float8_recipes", "float8_emulation")),
}


def _is_watched_method(cls, name: str, value) -> bool:
    """Whether ``value``, found on an instance of ``cls``, is the suite's watch on its method ``name``."""
    wrapped = getattr(value, "__wrapped__", None)
    return getattr(value, "__fp8conf_tracked__", False) and getattr(wrapped, "__func__", None) is getattr(cls, name, None)


def _holds(spec, question: str) -> bool:
    ask = getattr(spec, question, None)
    return True if ask is None else bool(ask())


@dataclasses.dataclass
class _Shared:
    case: object
    parameters: dict
    session: int


class _Cache:
    def __init__(self, trace):
        self.trace = trace  # conformance.run.harness's own, uncached
        self.cases: collections.OrderedDict = collections.OrderedDict()
        #: Sessions started (:meth:`new_session`), traces taken from an earlier one, and traces
        #: made (each evicted case traced again counts again).
        self.session = 0
        self.hits = 0
        self.traced = 0

    def new_session(self) -> None:
        self.session += 1

    def __call__(self, backend, spec, device):
        identity = tracing_identity(backend, spec)
        key = (identity if identity is not None else backend, spec, device)
        shared = self.cases.get(key)
        if shared is not None:
            self.cases.move_to_end(key)
            self.hits += shared.session != self.session
            return shared.case
        case = self.trace(backend, spec, device)
        self.traced += 1
        self.cases[key] = _Shared(case, _parameters(case.model), self.session)
        while len(self.cases) > _MAX_CASES:
            self.cases.popitem(last=False)
        return case


def _parameters(model) -> dict:
    state = getattr(model, "state_dict", None)
    return {name: value.detach().clone() for name, value in state().items()} if state is not None else {}


def install():
    """Put the shared cache in place of ``conformance.run.harness``'s per-session one; returns it."""
    from conformance.run import harness

    current = harness._trace
    if isinstance(current, _Cache):
        return current
    cache = _Cache(current.__wrapped__)
    harness._trace = cache
    return cache


def check_models_kept(cache: _Cache) -> list[str]:
    """Drop every shared case whose model's parameters or buffers changed since it was traced;
    one line per case dropped."""
    import torch

    dropped = []
    for key, shared in list(cache.cases.items()):
        now = _parameters(shared.case.model)
        if now.keys() != shared.parameters.keys() or any(not _same(now[k], v) for k, v in shared.parameters.items()):
            del cache.cases[key]
            dropped.append(f"shared traces: the model of {key[1]!r} changed in a session; its trace is not shared any more")
    return dropped


def _same(a, b) -> bool:
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.element_size() == 1 and a.dtype not in (torch.uint8, torch.int8, torch.bool):  # float8: compare the bytes
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return bool(torch.equal(a, b))
