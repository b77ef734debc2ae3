"""What the engine's own compiled units offer, as a protocol: recognised by what they do, not by
the name of their class.

A unit the engine compiles itself, rather than leaving to torch's ``CompiledArtifact``
(:class:`~fp8conf.compile.region_compile.InnerCompiledUnit`), exposes Inductor's compiled graph
(:mod:`~fp8conf.compile.fast_call` calls it directly), puts off the wait for its kernels until it
is bound, and can give itself in the form a regional artifact stores.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

__all__ = ["CompiledUnit"]


@runtime_checkable
class CompiledUnit(Protocol):
    """A compiled unit of a regional compile, called with the unit's inputs as arguments."""

    #: Inductor's compiled graph: takes the inputs as one list and empties it.
    compiled_fn: Callable
    #: The fast path this unit did not take (a line of :func:`fp8conf.log.fell_back`), or None;
    #: the compile that binds the unit counts it in ``CompiledJoint.fallbacks``.
    fallback: str | None

    def __call__(self, *args): ...

    def finish(self) -> None:
        """Wait for the unit's kernels (a kernel that fails to build raises here)."""

    def saveable(self) -> Callable:
        """The unit as a regional artifact stores it (a serializable ``AOTCompiledArtifact``)."""
