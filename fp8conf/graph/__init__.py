"""The pipeline stages, in order: :mod:`~fp8conf.graph.trace` (the joint graph and its
signature; repeated blocks traced once, :mod:`~fp8conf.graph.repeat` with
:mod:`~fp8conf.graph.equal_blocks`) -> :mod:`~fp8conf.graph.provenance` ->
:mod:`~fp8conf.graph.roles` -> :mod:`~fp8conf.graph.validate` (with :mod:`~fp8conf.graph.scales`,
what each scaled matmul requires of its scales) -> :mod:`~fp8conf.graph.regions`
-> :mod:`~fp8conf.graph.split` (GraphPP). For a sharded step, tracing records its collectives
(:mod:`~fp8conf.graph.collectives`) and :mod:`~fp8conf.graph.all_gathers` checks the weight
all-gathers against the float8 all-gather setting. A stage imports only the stages before it, and none
imports the compile engine (:mod:`fp8conf.compile`), which takes their results as arguments."""
