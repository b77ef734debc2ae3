"""Deprecated: moved to :mod:`conformance.draw.moe`.

This old path stays for reproducers in reports written before the move (``from conformance.moe
import *``): importing it warns and gives the module at the new path itself (the same module
object, so its names and any patch of them are shared).
"""

import importlib
import sys
import warnings

warnings.warn("conformance.moe moved to conformance.draw.moe; import conformance.draw.moe instead", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = importlib.import_module("conformance.draw.moe")
