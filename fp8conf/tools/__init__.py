"""Tools built on the library: the ``fp8conf`` command (:mod:`~fp8conf.tools.cli`), its
``precompile`` and ``explain`` subcommands, the self-checking pipeline demo, the sharded-step
check (:mod:`~fp8conf.tools.sharded_check`) and the example
models they use. Nothing in the library imports from here."""
