"""The neutral value types a backend returns.

Defined in :mod:`fp8contract.types`, the torch-free contract the suite and fp8conf both import
as a leaf; re-exported here unchanged (the same objects, so ``isinstance`` and ``except``
match either path). ``from conformance.api.types import ...`` stays the backend author's path.
"""

from fp8contract.types import *  # noqa: F401,F403
from fp8contract.types import __all__  # noqa: F401
