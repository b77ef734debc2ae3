"""Draw: the models and operands the suite draws, as plain data, and how to build them.

The first stage of the suite's pipeline (draw -> run -> observe -> judge -> report):
:mod:`~conformance.draw.models` (stacks of quantized linears), :mod:`~conformance.draw.moe`
(grouped experts), :mod:`~conformance.draw.families` (model families shaped like what trainers
train) and :mod:`~conformance.draw.family_examples` (each family run first),
:mod:`~conformance.draw.strategies` (the Hypothesis strategies over all of them),
:mod:`~conformance.draw.e8m0` (E8M0 operands), and the changes the FPR properties draw:
:mod:`~conformance.draw.fingerprints` (what changes in a model) and
:mod:`~conformance.draw.versions` (other torch and torchao versions).

Nothing here asks a backend anything. This ``__init__`` imports nothing, so importing one
module does not import the others.
"""
