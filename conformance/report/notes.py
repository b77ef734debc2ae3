"""Notes a property test leaves for its report row: what it did not check, and why.

A property whose scope a backend's declaration narrows (PROV-002 without a recipe) still passes
or fails on what it checked, and its report row says what it left out. Tests call :func:`note`;
the plugin takes the notes of each test when it reports it (:func:`take`). Plain Python, so the
plugin reads it without importing torch.
"""

from __future__ import annotations

__all__ = ["NOT_IN_SPEC", "NOT_SUPPORTED", "note", "take"]

#: Skip reason of a property whose capability the backend does not claim (gating and the
#: strategies skip with it; the report reads it as ``not_supported``).
NOT_SUPPORTED = "not_supported:"
#: Skip reason of a property newer than the spec version checked; reported ``not_supported``.
NOT_IN_SPEC = "not_in_spec_version:"

_PENDING: list[str] = []


def note(text: str) -> None:
    """Record ``text`` for the report row of the test running now (once per test)."""
    if text not in _PENDING:
        _PENDING.append(text)


def take() -> list[str]:
    """The notes recorded since the last call, cleared."""
    found = list(_PENDING)
    _PENDING.clear()
    return found
