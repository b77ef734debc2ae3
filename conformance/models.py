"""Deprecated: moved to :mod:`conformance.draw.models`.

This old path stays for reproducers in reports written before the move (``from conformance.models
import *``) and backend authors' own tests: importing it warns and gives the module at the new path
itself (the same module object, so its names and any patch of them are shared).
"""

import importlib
import sys
import warnings

warnings.warn("conformance.models moved to conformance.draw.models; import conformance.draw.models instead", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = importlib.import_module("conformance.draw.models")
