"""The error protocol a backend raises and the suite catches.

Defined in :mod:`fp8contract.errors`, the torch-free contract the suite and fp8conf both import
as a leaf; re-exported here unchanged (the same objects, so ``isinstance`` and ``except``
match either path). ``from conformance.api.errors import ...`` stays the backend author's path.
"""

from fp8contract.errors import *  # noqa: F401,F403
from fp8contract.errors import __all__  # noqa: F401
