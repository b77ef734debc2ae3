"""Judge: the suite's own reading of what is right, against which it holds what it observed.

The fourth stage of the suite's pipeline (draw -> run -> observe -> judge -> report):
:mod:`~conformance.judge.definitions` (what each low-precision recipe defines, in plain torch),
:mod:`~conformance.judge.block_scaled` (block-scaled matmuls with swizzled scales),
:mod:`~conformance.judge.dead_compute` (which FP8 compute counts and which is dead),
:mod:`~conformance.judge.rewrites` (graphs the suite breaks on purpose, which a validator must
reject), :mod:`~conformance.judge.fingerprint_scopes` (what each fingerprint scope promises)
and :mod:`~conformance.judge.expectations` (the failures ``--fp8-expectations`` expects).

This ``__init__`` imports nothing.
"""
