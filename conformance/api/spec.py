"""The spec registry: SPEC_VERSION and the properties.

Defined in :mod:`fp8contract.spec`, the torch-free contract the suite and fp8conf both import
as a leaf; re-exported here unchanged (the same objects, so ``isinstance`` and ``except``
match either path). ``from conformance.api.spec import ...`` stays the backend author's path.
"""

from fp8contract.spec import *  # noqa: F401,F403
from fp8contract.spec import __all__  # noqa: F401
