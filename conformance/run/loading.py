"""Finding and constructing the backend ``--fp8-backend`` names.

A name is an entry point of the group ``fp8conf.backends``; ``package.module:Class`` names a
class directly. Every failure is one paragraph of ``pytest.UsageError``, never a traceback.
"""

from __future__ import annotations

import importlib
import importlib.metadata

import pytest

from conformance.api import Backend

__all__ = ["ENTRY_POINT_GROUP", "load_backend"]

ENTRY_POINT_GROUP = "fp8conf.backends"


def load_backend(spec: str) -> Backend:
    """Instantiate the backend ``spec`` names; any failure becomes a one-paragraph UsageError."""
    cls = _backend_class(spec)
    try:
        return cls()
    except Exception as exc:
        raise pytest.UsageError(_failure(spec, "could not be constructed", exc)) from None


def _backend_class(spec: str) -> type[Backend]:
    if ":" in spec:
        module_name, _, qualname = spec.partition(":")

        def load() -> object:
            obj: object = importlib.import_module(module_name)
            for attr in qualname.split("."):
                obj = getattr(obj, attr)
            return obj

    else:
        # Only the names are read here: listing must not import any backend's module.
        entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        if spec not in entry_points.names:
            installed = ", ".join(sorted(entry_points.names)) or "none"
            raise pytest.UsageError(
                f"unknown fp8conf backend {spec!r}; installed backends: {installed}. "
                "Pass an installed name or --fp8-backend=package.module:Class."
            )
        load = entry_points[spec].load
    try:
        obj = load()
    except Exception as exc:
        raise pytest.UsageError(_failure(spec, "could not be imported", exc)) from None
    if not (isinstance(obj, type) and issubclass(obj, Backend)):
        raise pytest.UsageError(
            f"fp8conf backend {spec!r} is {obj!r}, which is not a subclass of conformance.Backend."
        )
    return obj


def _failure(spec: str, what: str, exc: BaseException) -> str:
    message = " ".join(str(exc).split())  # one paragraph even for multi-line messages
    return f"fp8conf backend {spec!r} {what}: {type(exc).__name__}: {message}"
