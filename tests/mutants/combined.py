"""Backends with planted defects for the report's root causes (``tests/test_root_causes.py``).

Unlike the single mutants of this package, each is meant to fail several properties, and the
report must tell how many defects lie behind those failures:

* :class:`RecipeAndTensorwiseFastPath`: two independent defects on disjoint models: PROV-002
  fails on every model holding a module whose recipe is not tensorwise, VAL-002 on the models
  whose modules are all tensorwise. VAL-002 relies on PROV-002 in the spec, but never fails where
  PROV-002 does: two root causes.
* :class:`ReusedCallsRenamed`: one defect that PROV-002, PROV-003 and PROV-004 all see, on the
  same models (every model with a reused quantized layer), at the same module: one root cause
  listing the three.
"""

from __future__ import annotations

import fp8conf
import fp8conf.graph.validate
from conformance.api.types import Provenance
from conformance.backends.reference import ReferenceBackend
from mutants.backends import _replaced


class RecipeAndTensorwiseFastPath(ReferenceBackend):
    """Two defects. Provenance reports every module as the default tensorwise recipe; and strict
    validation takes a fast path for graphs whose modules are all tensorwise, skipping its check
    that each non-emulated module kept its FP8 compute."""

    name = "planted-recipe-and-tensorwise-fast-path"

    def provenance(self, node):
        found = super().provenance(node)
        return None if found is None else Provenance(found.module_fqn, found.kind, "tensorwise", found.emulate)

    def validate(self, gm, *, strict):
        modules = fp8conf.trace_info(gm).modules.values()
        if all(config.recipe == "tensorwise" for config in modules):
            with _replaced(fp8conf.graph.validate, "_check_calls", lambda *a: []):
                return super().validate(gm, strict=strict)
        return super().validate(gm, strict=strict)


class ReusedCallsRenamed(ReferenceBackend):
    """Names the provenance of a reused module's later calls by FQN and call index
    (``layers.0#1``), as if each call were a module of its own: the second call's nodes name a
    module the model does not have (PROV-002), forward (PROV-004) and backward (PROV-003)."""

    name = "planted-reused-calls-renamed"

    def provenance(self, node):
        found = super().provenance(node)
        recorded = fp8conf.get_provenance(node)
        if found is None or recorded is None or recorded.call == 0:
            return found
        return Provenance(f"{found.module_fqn}#{recorded.call}", found.kind, found.recipe, found.emulate)
