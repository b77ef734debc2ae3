"""Observe: what the suite itself reads from what a backend did, independently of the backend.

The third stage of the suite's pipeline (draw -> run -> observe -> judge -> report):
:mod:`~conformance.observe.graphs` (a backend's graphs: FP8 casts, compute, scales, regions),
:mod:`~conformance.observe.dispatch` (the ops that reached torch's dispatcher when a step ran
eagerly) and :mod:`~conformance.observe.evidence` (what one example showed, kept for the
report's root causes).

This ``__init__`` imports nothing.
"""
