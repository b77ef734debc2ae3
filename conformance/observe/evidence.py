"""What one example of a property test showed, for the report's root causes.

A property is checked on many examples (drawn models). Whether a failure follows from another
property's failure or is a defect of its own is decided on what each property did on each example
(``conformance.plugin.causes``): the plugin keys every example by its drawn model
(:func:`example_key`) and notes whether it passed or failed, and :func:`conformance.run.harness.fail`
records here what its failure named (:func:`record_failure`): the modules of the drawn model and
the graph nodes its message locates. The harness notes the model an example traces
(:func:`drawn`), so a failure whose message shows no model (a backend method that raised) still
names its modules. The plugin starts each example afresh (:func:`start_example`) and takes the
record when it ends (:func:`take_failure`). Plain Python, so the plugin reads it without
importing torch.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Iterable

__all__ = [
    "built", "drawn", "drawn_model", "example_key", "left_out", "take_built", "take_left_out", "is_named", "named_modules", "named_nodes", "record_failure",
    "start_example", "take_failure",
]

#: A node is named in a failure message as ``node 'name'`` (``backward node 't_21'``,
#: ``FP8 compute node 'mm'``): graph node names are identifiers.
_NODE = re.compile(r"\bnode '(\w+)'")
#: Characters of a failure message kept for the report: its first lines say what was seen.
_SEEN_LIMIT = 400

_PENDING: list[dict[str, Any]] = []
_DRAWN: list[Any] = []
#: What the models of the test running now were built with, as :func:`built` noted it.
_BUILT: dict[tuple[str, ...], None] = {}
#: ``(kind, reason)`` of the kinds the test running now left out of its models, as :func:`left_out` noted.
_LEFT_OUT: dict[tuple[str, str], None] = {}


def start_example() -> None:
    """Forget the model and the failure of the example before."""
    _PENDING.clear()
    _DRAWN.clear()


def drawn(model: Any) -> None:
    """Note ``model`` as the model of the example running now."""
    _DRAWN[:] = [model]


def built(entries: Iterable[tuple[str, ...]]) -> None:
    """Note what a model of the test running now was built with: ``(family, kind, module class,
    recipe, built by)`` per quantized module, as seen on the built model. The report lists them
    per family (which modules, which recipes, whose conversion)."""
    for entry in entries:
        _BUILT.setdefault(tuple(entry), None)


def take_built() -> list[tuple[str, ...]]:
    """The entries :func:`built` noted since the last call, cleared."""
    found = list(_BUILT)
    _BUILT.clear()
    return found


def left_out(kinds: Iterable[str], reason: str) -> None:
    """Note that the test running now draws no layer of ``kinds`` (``conformance.strategies``'
    drawing kinds) for ``reason``: the device cannot run their matmuls. The report's coverage
    matrix shows such a family's cell in the test's area as checked for structure only, with
    ``reason``, where no property of the area built it."""
    for kind in kinds:
        _LEFT_OUT.setdefault((kind, reason), None)


def take_left_out() -> list[tuple[str, str]]:
    """The entries :func:`left_out` noted since the last call, cleared."""
    found = list(_LEFT_OUT)
    _LEFT_OUT.clear()
    return found


def drawn_model() -> Any:
    """The model :func:`drawn` noted for the example running now, or None."""
    return _DRAWN[0] if _DRAWN else None


def example_key(*models: Any) -> str:
    """A stable key of the example that drew ``models``: a digest of their ``repr``, which for
    the suite's frozen model specs is the same in every process and for every property, so two
    properties that ran one model share its key."""
    text = "\n".join(repr(model) for model in models)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:10]


def is_named(text: str, word: str) -> bool:
    """Whether ``text`` names ``word`` (a module FQN, a pass): "layers.1" is not found inside
    "layers.10" nor inside "layers.1.adapter", since a name ends where no name character follows."""
    return re.search(rf"(?<![\w.]){re.escape(word)}(?![\w.])", text) is not None


def named_modules(message: str, fqns: Iterable[str]) -> list[str]:
    """The module FQNs among ``fqns`` that ``message`` names."""
    return [fqn for fqn in fqns if is_named(message, fqn)]


def named_nodes(message: str) -> list[str]:
    """The graph nodes ``message`` names (``node 'name'``), each once, in order."""
    return list(dict.fromkeys(_NODE.findall(message)))


def record_failure(
    property_id: str,
    message: str,
    *,
    modules: Iterable[str] = (),
    size: Iterable[int] | None = None,
    code: str | None = None,
) -> None:
    """Record the failure ending the example running now: ``property_id``, what was seen
    (``message``, without the rule and the model), the ``modules`` it names, and the drawn
    model's ``size`` and ``code`` (to show it as evidence)."""
    seen = message.strip()
    _PENDING[:] = [{
        "property": property_id,
        "modules": list(modules),
        "nodes": named_nodes(message),
        "seen": seen if len(seen) <= _SEEN_LIMIT else seen[:_SEEN_LIMIT] + " ...",
        "size": None if size is None else list(size),
        "code": code,
    }]


def take_failure() -> dict[str, Any] | None:
    """The failure recorded since the last call, cleared; None when there was none."""
    found = _PENDING[0] if _PENDING else None
    _PENDING.clear()
    return found
