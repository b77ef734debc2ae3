"""Deprecated: moved to :mod:`conformance.draw.strategies`.

This old path stays for backend authors' own Hypothesis tests that draw the suite's models:
importing it warns and gives the module at the new path itself (the same module object, so its
names and any patch of them are shared).
"""

import importlib
import sys
import warnings

warnings.warn("conformance.strategies moved to conformance.draw.strategies; import conformance.draw.strategies instead", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = importlib.import_module("conformance.draw.strategies")
