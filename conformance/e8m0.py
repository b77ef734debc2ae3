"""Deprecated: moved to :mod:`conformance.draw.e8m0`.

This old path stays for reproducers in reports written before the move (``from conformance.e8m0
import *``): importing it warns and gives the module at the new path itself (the same module
object, so its names and any patch of them are shared).
"""

import importlib
import sys
import warnings

warnings.warn("conformance.e8m0 moved to conformance.draw.e8m0; import conformance.draw.e8m0 instead", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = importlib.import_module("conformance.draw.e8m0")
