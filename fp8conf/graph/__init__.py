"""The graph passes, in pipeline order: :mod:`~fp8conf.graph.trace` (the joint graph and its
signature) -> :mod:`~fp8conf.graph.provenance` -> :mod:`~fp8conf.graph.roles` ->
:mod:`~fp8conf.graph.validate` -> :mod:`~fp8conf.graph.regions` -> :mod:`~fp8conf.graph.compile`
or :mod:`~fp8conf.graph.split` (GraphPP). A pass imports only the passes before it."""
