"""fp8conf's conformance suite: the FP8 region-compilation spec as property-based tests.

The contract a backend implements is :mod:`conformance.api` (re-exported here). Importing this
package does not import torch; the pytest plugin stays inert until ``--fp8-backend`` is given.
"""

from conformance.api import *  # noqa: F401,F403
from conformance.api import __all__  # noqa: F401
