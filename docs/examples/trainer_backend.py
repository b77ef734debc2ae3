"""A conformance backend for a trainer that owns its float8 linears: the worked example.

The trainer's module is :class:`trainer_float8.TrainerFloat8Linear` (recipes ``rowwise`` and
``rowwise_with_gw_hp``, no tensorwise; an emulated mode; forward on ``F.scaled_mm``, backward on
``torch._scaled_mm``). The trainer runs fp8conf's passes on its graphs, so the adapter is short:

* it claims ``float8_modules`` and declares the recipes its linears have
  (``float8_recipes``); the suite then builds every float8 layer it draws through
  :meth:`TrainerBackend.convert_float8`, never draws a tensorwise layer, and reports a property
  that asks only for tensorwise as ``not_supported``;
* the module is declared to fp8conf from outside (``fp8conf.register_quantized_module``, in
  ``own_module_walkthrough.py``), as the trainer's own code cannot import fp8conf;
* its provenance maps the trainer's kind onto the contract's neutral ``float8_linear``.

Run the suite against it from the repository root::

    PYTHONPATH=docs/examples pytest --fp8-backend=trainer_backend:TrainerBackend
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import trainer_float8  # noqa: E402
from conformance.api import Provenance  # noqa: E402
from conformance.backends.reference import ReferenceBackend  # noqa: E402
from own_module_walkthrough import describe  # noqa: E402,F401  (declares the module to fp8conf, from outside)

__all__ = ["TrainerBackend"]

#: The kind fp8conf's provenance names the trainer's module by (the walkthrough's declaration).
TRAINER_KIND = "trainer_float8_linear"


class TrainerBackend(ReferenceBackend):
    name = "trainer-example"
    capabilities = frozenset(
        {
            "provenance", "validation", "emulation", "regions", "compile.full", "compile.regional", "graphpp",
            "fingerprint", "artifacts", "float8_modules",
        }
    )
    float8_recipes = frozenset(trainer_float8.RECIPES)
    float8_emulation = True

    def convert_float8(self, model, *, module_filter_fn, recipe, emulate):
        trainer_float8.convert(model, recipe=recipe, emulate=emulate, module_filter_fn=module_filter_fn)

    def provenance(self, node):
        found = super().provenance(node)
        if found is None or found.kind != TRAINER_KIND:
            return found
        return Provenance(found.module_fqn, "float8_linear", found.recipe, found.emulate)
