"""Deprecated: moved to :mod:`conformance.run.gating`.

This old path stays for conftest files that gate GPU tests (``conformance.plugin`` itself re-
exports what they need): importing it warns and gives the module at the new path itself (the same
module object, so its names and any patch of them are shared).
"""

import importlib
import sys
import warnings

warnings.warn("conformance.plugin.gating moved to conformance.run.gating; import conformance.run.gating instead", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = importlib.import_module("conformance.run.gating")
