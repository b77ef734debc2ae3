"""Deprecated: moved to :mod:`conformance.draw.families`.

This old path stays for reproducers in reports written before the move (``from conformance.families
import *``): importing it warns and gives the module at the new path itself (the same module
object, so its names and any patch of them are shared).
"""

import importlib
import sys
import warnings

warnings.warn("conformance.families moved to conformance.draw.families; import conformance.draw.families instead", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = importlib.import_module("conformance.draw.families")
