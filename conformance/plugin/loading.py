"""Deprecated: moved to :mod:`conformance.run.loading`.

This old path stays for code that loads a backend by name (``conformance.plugin`` itself re-exports
``load_backend``): importing it warns and gives the module at the new path itself (the same module
object, so its names and any patch of them are shared).
"""

import importlib
import sys
import warnings

warnings.warn("conformance.plugin.loading moved to conformance.run.loading; import conformance.run.loading instead", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = importlib.import_module("conformance.run.loading")
