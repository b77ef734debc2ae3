"""The pipeline stages, in order: :mod:`~fp8conf.graph.trace` (the joint graph and its
signature; repeated blocks traced once, :mod:`~fp8conf.graph.repeat` with
:mod:`~fp8conf.graph.equal_blocks`) -> :mod:`~fp8conf.graph.provenance` ->
:mod:`~fp8conf.graph.roles` -> :mod:`~fp8conf.graph.validate` -> :mod:`~fp8conf.graph.regions`
-> :mod:`~fp8conf.graph.split` (GraphPP). A stage imports only the stages before it, and none
imports the compile engine (:mod:`fp8conf.compile`), which takes their results as arguments."""
