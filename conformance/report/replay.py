"""Reproducers of failing conformance tests: the drawn model and the command that replays it.

Built on the process that ran the test (an xdist worker too) from the failure itself:

* the message of :func:`conformance.run.harness.fail`, which ends with ``Minimal model
  (runnable):`` and the drawn model as Python;
* the notes Hypothesis attaches to the exception (the failing test case and, under a profile
  with ``print_blob``, the ``@reproduce_failure`` decorator) and the seed it drew;
* the backend, the node ID and the Hypothesis profile, for a command that replays the test:
  ``pytest --fp8-backend=NAME '<nodeid>' --hypothesis-profile=P --hypothesis-seed=S``. Under a
  derandomized profile (``fp8conf-ci``, ``fp8conf-mutants``) the seed follows from the test and is left out.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

__all__ = ["MODEL_MARKER", "command", "reproducer", "section_text"]

#: The line :func:`conformance.run.harness.fail` puts before the drawn model.
MODEL_MARKER = "Minimal model (runnable):"
_BLOB = re.compile(r"@reproduce_failure\(.*?\)")
_FAILING_CASE = ("Failing test case: ", "Falsifying example: ")
_MESSAGE_LIMIT = 4000


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


def _cli_nodeid(item: pytest.Item) -> str:
    """The node ID as a path the command line accepts from the directory pytest ran in."""
    nodeid = item.nodeid
    rest = nodeid[nodeid.index("::"):] if "::" in nodeid else ""
    invocation = item.config.invocation_params.dir
    try:
        path = Path(item.path).resolve()
    except (AttributeError, OSError):
        return nodeid
    try:
        relative = path.relative_to(Path(invocation).resolve())
    except ValueError:
        return str(path) + rest  # outside the directory (an installed package): absolute
    return relative.as_posix() + rest


def _seed(item: pytest.Item) -> Any:
    forced = item.config.getoption("hypothesis_seed", None)
    if forced is not None:
        return forced
    function = getattr(item.obj, "__func__", item.obj)
    # None under a derandomized profile: there the test's own digest is the seed.
    return getattr(function, "_hypothesis_internal_use_generated_seed", None)


def command(item: pytest.Item, backend_spec: str) -> str:
    from hypothesis import settings

    parts = ["pytest", f"--fp8-backend={backend_spec}", _quote(_cli_nodeid(item))]
    parts.append(f"--hypothesis-profile={settings.get_current_profile_name()}")
    if getattr(item.obj, "hypothesis", None) is not None:
        seed = _seed(item)
        if seed is not None:
            parts.append(f"--hypothesis-seed={seed}")
    return " ".join(parts)


def _first_exception(exc: BaseException) -> BaseException:
    # Hypothesis raises an exception group for several distinct failures: report the first.
    while getattr(exc, "exceptions", None):
        exc = exc.exceptions[0]
    return exc


def reproducer(item: pytest.Item, exc: BaseException, backend_spec: str) -> dict[str, Any]:
    """JSON-ready reproducer of the failure ``exc`` of ``item``."""
    notes = [str(note) for note in getattr(exc, "__notes__", None) or []]
    inner = _first_exception(exc)
    if inner is not exc:
        notes += [str(note) for note in getattr(inner, "__notes__", None) or []]
    message = getattr(inner, "msg", None) or str(inner) or type(inner).__name__
    model = None
    if MODEL_MARKER in message:
        message, _, model = message.partition(MODEL_MARKER)
        model = model.strip("\n") + "\n"
    message = message.strip()
    if len(message) > _MESSAGE_LIMIT:
        message = message[:_MESSAGE_LIMIT] + " ..."
    failing_case = next(
        (note.split(": ", 1)[1] for note in notes if note.startswith(_FAILING_CASE)), None
    )
    blob = next((m.group(0) for note in notes for m in [_BLOB.search(note)] if m), None)
    return {
        "test": item.nodeid,
        "message": message,
        "model": model,
        "command": command(item, backend_spec),
        "failing_case": failing_case,
        "reproduce_failure": blob,
    }


def section_text(found: dict[str, Any]) -> str:
    """The reproducer as the section pytest prints under a failure."""
    lines = ["Replay:", "  " + found["command"]]
    if found.get("reproduce_failure"):
        lines += ["Or decorate the test with:", "  " + found["reproduce_failure"]]
    # The drawn model is already in the failure's message (conformance.run.harness.fail).
    if not found.get("model") and found.get("failing_case"):
        lines += ["Failing test case:", found["failing_case"]]
    return "\n".join(lines) + "\n"
