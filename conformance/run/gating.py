"""Which collected tests may run: hardware markers, claimed capabilities, the spec version.

The GPU markers carry fp8conf's prefix (``fp8_gpu``, ``fp8_sm89``, ``fp8_sm90``, ``fp8_sm100``)
so that a project's own ``gpu`` marker keeps its own meaning. The plugin gates them only in a
run with ``--fp8-backend``; fp8conf's own tests gate them from their ``conftest.py`` with
:func:`skip_unavailable_gpu_tests`. torch is imported only when a collected test carries one.
"""

from __future__ import annotations

import re

import pytest

from conformance.api import SPEC_VERSION, Backend, get_property
# The skip reasons are the report's words; the strategies that skip a drawn model use them too.
from conformance.report.notes import NOT_IN_SPEC, NOT_SUPPORTED

__all__ = [
    "GPU_MARKERS",
    "NOT_IN_SPEC",
    "NOT_SUPPORTED",
    "CitationError",
    "add_markers",
    "checked_spec_version",
    "cited_ids",
    "gpu_skip_reasons",
    "skip_reason_for",
    "skip_unavailable_gpu_tests",
]

#: Minimum CUDA compute capability per marker; ``None``: any CUDA device.
GPU_MARKERS: dict[str, tuple[int, int] | None] = {
    "fp8_gpu": None,
    "fp8_sm89": (8, 9),
    "fp8_sm90": (9, 0),
    "fp8_sm100": (10, 0),
}
_MARKERS = (
    "fp8_property(id): the test checks spec property `id` of conformance.api.spec; it is skipped "
    "as not_supported when the backend does not claim the property's capability",
    "fp8_gpu: needs a CUDA device",
    "fp8_sm89: needs a CUDA device of compute capability 8.9 or newer",
    "fp8_sm90: needs a CUDA device of compute capability 9.0 or newer",
    "fp8_sm100: needs a CUDA device of compute capability 10.0 or newer",
    "fp8_gloo: needs a gloo process group of two processes on this machine; with --fp8-backend, a "
    "run that selects such a test checks first that one can start (a usage error when not)",
)
_VERSION = re.compile(r"^\d+(\.\d+)*$")


def add_markers(config: pytest.Config) -> None:
    """Register ``fp8_property``, the GPU markers and ``fp8_gloo`` (names only: nothing is gated
    by this)."""
    for line in _MARKERS:
        config.addinivalue_line("markers", line)


def _wants_gpu(item: pytest.Item) -> bool:
    return any(item.get_closest_marker(name) for name in GPU_MARKERS)


def gpu_skip_reasons(items: list[pytest.Item]) -> dict[pytest.Item, str]:
    """The reason each GPU-marked item cannot run on this machine; items that can are left out."""
    items = [item for item in items if _wants_gpu(item)]
    if not items:
        return {}
    import torch  # only now: a collected test asked for a GPU

    have = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    reasons = {}
    for item in items:
        for name, need in GPU_MARKERS.items():
            if item.get_closest_marker(name) is None:
                continue
            if have is None:
                reasons[item] = f"{name}: CUDA is not available"
                break
            if need is not None and have < need:
                reasons[item] = (
                    f"{name}: needs compute capability {need[0]}.{need[1]}, "
                    f"the device has {have[0]}.{have[1]}"
                )
                break
    return reasons


def skip_unavailable_gpu_tests(items: list[pytest.Item]) -> None:
    """Skip, with the reason, the ``fp8_gpu`` / ``fp8_sm*`` tests this machine cannot run."""
    for item, reason in gpu_skip_reasons(items).items():
        item.add_marker(pytest.mark.skip(reason=reason))


class CitationError(Exception):
    """A test cites a property that is not in the registry, or cites it wrongly."""


def cited_ids(item: pytest.Item) -> list[str]:
    """The property IDs ``item``'s ``fp8_property`` markers cite, each checked against the spec."""
    ids: list[str] = []
    for mark in item.iter_markers(name="fp8_property"):
        if len(mark.args) != 1 or mark.kwargs or not isinstance(mark.args[0], str):
            raise CitationError(
                f"{item.nodeid}: fp8_property takes one property ID, got "
                f"args={mark.args!r} kwargs={mark.kwargs!r}"
            )
        property_id = mark.args[0]
        try:
            get_property(property_id)
        except KeyError:
            raise CitationError(
                f"{item.nodeid} cites unknown spec property {property_id!r} "
                "(not in conformance.api.spec.PROPERTIES)"
            ) from None
        if property_id not in ids:
            ids.append(property_id)
    return ids


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def checked_spec_version(config: pytest.Config, backend: Backend) -> str:
    """``--fp8-spec-version``, else the backend's ``spec_version``, checked to look like one."""
    given = config.getoption("fp8_spec_version")
    version = str(given or getattr(backend, "spec_version", None) or SPEC_VERSION)
    if not _VERSION.match(version):
        where = "--fp8-spec-version" if given else f"backend {backend.name!r}: spec_version"
        raise pytest.UsageError(f"{where} {version!r} is not a version like {SPEC_VERSION!r}")
    return version


def skip_reason_for(ids: list[str], backend: Backend, spec_version: str) -> str | None:
    """Why a test citing ``ids`` does not apply to ``backend``: a property newer than the spec
    version checked, or a capability it does not claim; None when it applies."""
    checked = _version_tuple(spec_version)
    newer = [
        f"property {pid} is since spec {get_property(pid).since}"
        for pid in ids
        if _version_tuple(get_property(pid).since) > checked
    ]
    if newer:
        return (
            f"{NOT_IN_SPEC} backend {backend.name!r} is checked against spec {spec_version}; "
            + "; ".join(newer)
        )
    missing = [
        f"capability {get_property(pid).capability!r} (property {pid})"
        for pid in ids
        if get_property(pid).capability not in backend.capabilities
    ]
    if missing:
        return f"{NOT_SUPPORTED} backend {backend.name!r} does not claim " + "; ".join(missing)
    return None
