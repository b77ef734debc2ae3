"""fp8conf's custom ops. Importing this package registers them with ``torch.library``."""

from fp8conf.quantized.ops import e8m0
from fp8conf.quantized.ops.e8m0 import *  # noqa: F401,F403  (the names e8m0.__all__ lists)

__all__ = list(e8m0.__all__)
