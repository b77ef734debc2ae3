"""Run: which tests run, the backend loaded and called, watched and bounded.

The second stage of the suite's pipeline (draw -> run -> observe -> judge -> report):
:mod:`~conformance.run.loading` (the backend ``--fp8-backend`` names),
:mod:`~conformance.run.gating` (which collected tests may run: hardware markers, claimed
capabilities, the spec version), :mod:`~conformance.run.harness` (what every property test
shares: calling the backend safely, tracing once, failing clearly),
:mod:`~conformance.run.stages` (running a GraphPP split), :mod:`~conformance.run.distributed`
(a backend's sharded steps, on ranks), :mod:`~conformance.run.environment` (what the machine
must offer: CUDA, a gloo group) and :mod:`~conformance.run.watchdog` (which backend method is
running, and a timeout that names it).

This ``__init__`` imports nothing.
"""
