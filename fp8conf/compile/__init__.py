"""The compile engine: a joint graph, or a GraphPP stage's callables, compiled by Inductor.

The pipeline stages (:mod:`fp8conf.graph`) trace, attribute, validate and find the FP8 regions;
this package makes the result fast, behind one entry point, :func:`compile_joint` (and
:func:`compile_split` for a split stage), configured by one frozen :class:`CompileConfig`.
Inside, in the order a compile visits them:

* :mod:`~fp8conf.compile.joint` -- the entry point: ``full`` or ``regional``, the stages below
  called one after another, each handing the next its result;
* :mod:`~fp8conf.compile.plan` -- the graph validated, its signature, flat copy and FP8 regions;
* :mod:`~fp8conf.compile.partition` -- the min-cut cut into forward and backward, with
  :mod:`~fp8conf.compile.share_scales` (backward regions take the forward's scales) and
  :mod:`~fp8conf.compile.block_saves` (equal blocks save alike);
* :mod:`~fp8conf.compile.units` -- each graph compiled, whole (``full``) or as its regions and
  the units around them (``regional``), with :mod:`~fp8conf.compile.remainder` (the units
  around the regions) and :mod:`~fp8conf.compile.region_compile` (units cut out, keyed and
  compiled once each, by :mod:`~fp8conf.compile.workers`, here or in helper processes side by
  side, and called through :mod:`~fp8conf.compile.fast_call` where torch's wrappers have nothing
  to do; a unit Inductor cannot compile is compiled again, kept eager or refused by
  :mod:`~fp8conf.compile.unit_failures`);
* :mod:`~fp8conf.compile.assemble` -- the compiled graphs made one step, CUDA graphs;
* :mod:`~fp8conf.compile.stage` -- a GraphPP stage's callables compiled alike.

Only the names below are the engine's surface; the artifacts (:mod:`fp8conf.artifacts`) use
them and nothing of the modules inside.
"""

import importlib

# Imported on first use (PEP 562), as fp8conf's own names are: CompileConfig alone (what a
# command line checks its options with) then costs no torch import.
_EXPORTS = {
    "fp8conf.compile.config": ("MODES", "REMAINDERS", "CompileConfig"),
    "fp8conf.compile.joint": ("compile_joint",),
    "fp8conf.compile.assemble": ("CompiledJoint",),
    "fp8conf.compile.stage": ("compile_split",),
    # What artifacts need of the engine: its own units, and a loaded unit called as compiling calls it.
    "fp8conf.compile.compiled_unit": ("CompiledUnit",),
    "fp8conf.compile.region_compile": ("unit_call",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = [name for names in _EXPORTS.values() for name in names]


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'fp8conf.compile' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_MODULE_OF))
