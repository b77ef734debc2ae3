"""fp8conf's conformance suite: the FP8 region-compilation spec as property-based tests.

The contract a backend implements is :mod:`conformance.api` (re-exported here; its errors, types
and spec are :mod:`fp8contract`'s, the same objects). Importing this package does not import
torch; the pytest plugin stays inert until ``--fp8-backend`` is given.

The folders follow the suite's own pipeline, as ``fp8conf/`` follows its passes:

* ``api/``: the contract a backend implements; ``backends/``: worked example backends;
* ``draw/``: the models and operands the suite draws (:mod:`conformance.draw`);
* ``run/``: which tests run, the backend loaded, called, watched (:mod:`conformance.run`);
* ``observe/``: what the suite reads from what the backend did (:mod:`conformance.observe`);
* ``judge/``: the suite's own reading of what is right (:mod:`conformance.judge`);
* ``report/``: what a test leaves for the report (:mod:`conformance.report`);
* ``plugin/``: the pytest plugin that runs the properties and builds, renders and writes the
  report; ``properties/``: the property tests themselves.

``conformance.models``, ``.moe``, ``.families``, ``.e8m0`` and ``.strategies`` are deprecated
names of modules now under ``draw/``, kept for reproducers in earlier reports.
"""

from conformance.api import *  # noqa: F401,F403
from conformance.api import __all__  # noqa: F401
