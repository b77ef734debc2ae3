"""The machine checked before the first property runs: a CUDA device for ``--fp8-device=cuda``,
a gloo process group for the selected tests marked ``fp8_gloo``.

Without this, a machine that cannot give what a property needs makes the property fail, and a
failure reads as the backend's: every property a FAIL on a torch without CUDA, DP-003 a FAIL when
gloo cannot start. Instead a problem is a usage error (exit status 4) with one line naming the
fix, raised once collection has chosen the tests, before any of them runs, so that nothing is
probed for a property that is not selected, not claimed by the backend or skipped. The run then
ends before its first test: it writes no report and removes an earlier one at ``--fp8-report``
(:mod:`~conformance.plugin.ending`).

The probes are :mod:`conformance.run.environment`'s: torch and the machine, never the backend. Under
xdist each worker probes its own selection (the process that would run the tests); a worker that
finds a problem writes it to a file in a folder its controller gave it and keeps no test, and the
controller, told the worker's collection is done, raises the usage error.
"""

from __future__ import annotations

from typing import Any

import pytest

from conformance.run import environment
from conformance.plugin.handoff import WorkerFolder
from conformance.plugin.report import PROPERTY_KEY

__all__ = ["GLOO_MARKER", "EnvironmentProbes", "environment_problem"]

#: The marker of a test that runs gloo ranks in processes of its own.
GLOO_MARKER = "fp8_gloo"
#: ``workerinput`` key: the folder where an xdist worker writes the problem it found.
_FOLDER_KEY = "fp8conf_environment"


def _will_run(item: pytest.Item) -> bool:
    # Skips the plugin decided (not_supported, GPU gating) are skip marks by now.
    return item.get_closest_marker("skip") is None


def environment_problem(items: list[pytest.Item], device: str) -> str | None:
    """The usage error the machine gives for running ``items`` on ``device``; None when it can."""
    running = [item for item in items if _will_run(item)]
    on_device = [item for item in running if "fp8_device" in getattr(item, "fixturenames", ())]
    if on_device:
        problem = environment.cuda_problem(device)
        if problem is not None:
            count = len(on_device)
            return (f"--fp8-device={device}: {problem}. No test ran: {count} selected "
                    f"{'test builds' if count == 1 else 'tests build'} models on {device}")
    gloo = [item for item in running if item.get_closest_marker(GLOO_MARKER) is not None]
    if gloo:
        problem = environment.gloo_problem()
        if problem is not None:
            ids = sorted({value for item in gloo for key, value in item.user_properties if key == PROPERTY_KEY})
            names = ", ".join(ids) or ", ".join(item.nodeid for item in gloo)
            return (f"{names} run{'s' if len(ids) == 1 else ''} ranks in gloo processes on this machine, but {problem}. "
                    f"No test ran; or leave {names} out (--fp8-property, -k) to run the others")
    return None


class EnvironmentProbes:
    """Probe the machine for the selected tests; under xdist, carry a worker's finding to the
    controller."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self._handoff = WorkerFolder(config, _FOLDER_KEY, ".txt")

    def close(self) -> None:
        self._handoff.close()

    def configure_node(self, node: Any) -> None:
        self._handoff.configure_node(node)

    def collection_finished(self, session: pytest.Session) -> None:
        """Probe for the tests ``session`` will run; a problem ends the run before any runs."""
        if self.config.option.collectonly or not session.items:
            return
        problem = environment_problem(session.items, self.config.getoption("fp8_device"))
        if problem is None:
            return
        if self._handoff.mine is None:
            raise pytest.UsageError(problem)
        # An exception would crash the worker; its controller raises the usage error instead,
        # and no test is left here to start meanwhile.
        self._handoff.mine.write_text(problem, encoding="utf-8")
        self.config.hook.pytest_deselected(items=list(session.items))
        session.items[:] = []

    def node_collected(self, node: Any) -> None:
        """On the controller: raise the problem the worker ``node`` found, if it found one."""
        found = self._handoff.of(node.gateway.id)
        if found is not None and found.exists():
            raise pytest.UsageError(found.read_text(encoding="utf-8"))
