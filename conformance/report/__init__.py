"""Report: what a test leaves for its report row, and what the report shows beside verdicts.

The last stage of the suite's pipeline (draw -> run -> observe -> judge -> report):
:mod:`~conformance.report.notes` (what a test did not check, and why; the ``not_supported``
skip reasons), :mod:`~conformance.report.replay` (reproducers: the drawn model and the command
that replays it) and :mod:`~conformance.report.coverage` (which model families each area
draws). The pytest plugin (:mod:`conformance.plugin`) builds, renders and writes the report from
them.

This ``__init__`` imports nothing and imports neither torch nor Hypothesis.
"""
