"""How to compile a joint graph, as one frozen value checked when it is made.

:func:`fp8conf.compile_joint`, :func:`fp8conf.compile_split` and the artifact functions take a
:class:`CompileConfig` (their keyword arguments remain, and make one), so a trainer states its
compile settings once and hands them on, instead of forwarding loose keywords that one caller
forgets.
"""

from __future__ import annotations

import dataclasses
import functools
import os

from fp8conf.errors import FP8ConfigError

__all__ = ["MODES", "REMAINDERS", "CompileConfig"]

MODES = ("full", "regional")
#: What ``regional`` does with the nodes outside the FP8 regions.
REMAINDERS = ("inductor", "pieces", "eager")


@dataclasses.dataclass(frozen=True)
class CompileConfig:
    """Settings of one compile. A bad value is an :class:`~fp8conf.errors.FP8ConfigError` when
    the config is made, before anything is traced or compiled."""

    #: ``"regional"`` compiles the complete FP8 regions (with the rest around them, by
    #: ``remainder``): each distinct unit once, so a deep model's cold start stays short, and
    #: every region held to its module. ``"full"`` compiles every node, as ``torch.compile``
    #: would, for a graph whose regions need no such account.
    mode: str = "regional"
    #: Refuse what would lose FP8 silently: an incomplete region, FP8 compute no module can be
    #: held to, a tagged region left eager. ``False`` leaves them eager and logs each.
    strict: bool = True
    #: Capture the compiled step in a CUDA graph and replay it (CUDA only): no host time per
    #: kernel, at the price of outputs overwritten by the next call.
    cudagraph: bool = False
    #: Cut a joint graph into forward and backward as ``torch.compile`` does, so that fewer
    #: activations stay alive between the passes; ``False`` compiles the joint graph whole.
    partition: bool = True
    #: ``regional`` only: ``"inductor"`` compiles each region with the nodes around it (fused
    #: casts, equal blocks compiled once), ``"pieces"`` each region alone and the rest in
    #: pieces, ``"eager"`` the regions alone and the rest eagerly.
    remainder: str = "inductor"
    #: ``regional`` only: helper processes compiling distinct units beside this one (0: here).
    #: Distinct units are independent and their compiles mostly Python, so side by side they
    #: shorten a deep model's cold start; each helper costs a process importing torch.
    workers: int = 0
    #: Call compiled units straight through Inductor's generated code where torch's wrappers
    #: have nothing to do (:mod:`fp8conf.compile.fast_call`): less host time per step, same
    #: values. ``False`` keeps every call on torch's artifact, to measure what the fast path saves.
    fast_calls: bool = True
    #: ``regional`` only: compile every unit as a regional artifact stores it
    #: (``standalone_compile``) instead of by Inductor's inner compiler, so that what an artifact
    #: saves is what ran; precompiling sets it. The same kernels, a slower cold start.
    saveable_units: bool = False

    def __post_init__(self):
        if self.mode not in MODES:
            raise FP8ConfigError(f"CompileConfig(mode={self.mode!r}): choose one of {MODES}")
        if self.remainder not in REMAINDERS:
            raise FP8ConfigError(f"CompileConfig(remainder={self.remainder!r}): choose one of {REMAINDERS}")
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 0:
            raise FP8ConfigError(f"CompileConfig(workers={self.workers!r}): give a number of processes, 0 (this process, the default) or more")
        cores = os.cpu_count() or 1
        if self.workers > cores:
            raise FP8ConfigError(
                f"CompileConfig(workers={self.workers}): at most {cores}, this machine's cores (each helper is a process "
                "importing torch and compiling beside this one; more than the cores only wait for them)"
            )
        for name in ("strict", "cudagraph", "partition", "fast_calls", "saveable_units"):
            if not isinstance(getattr(self, name), bool):
                raise FP8ConfigError(f"CompileConfig({name}={getattr(self, name)!r}): give True or False")

    def ignored_by_mode(self) -> tuple[str, ...]:
        """The fields set away from their defaults that this config's mode does not read
        (``remainder``, ``workers`` and ``saveable_units`` are ``regional``'s), as ``name=value``."""
        if self.mode == "regional":
            return ()
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return tuple(f"{name}={getattr(self, name)!r}" for name in _REGIONAL_ONLY if getattr(self, name) != defaults[name])

    @classmethod
    def of(cls, config: CompileConfig | None, where: str, **keywords) -> CompileConfig:
        """``config``, or one made from ``keywords`` (a function's keyword arguments, each
        ``None`` where the caller left it out); both at once is a usage error naming ``where``."""
        given = {name: value for name, value in keywords.items() if value is not None}
        if config is None:
            return cls(**given)
        if not isinstance(config, cls):
            raise FP8ConfigError(f"{where}(config=...): expected a CompileConfig, got {type(config).__qualname__}")
        if given:
            raise FP8ConfigError(f"{where}: pass config= or the keywords {sorted(given)}, not both "
                                 f"(dataclasses.replace(config, ...) changes a field)")
        return config


#: The fields only mode ``regional`` reads.
_REGIONAL_ONLY = ("remainder", "workers", "saveable_units")
_FIELDS = tuple(f.name for f in dataclasses.fields(CompileConfig))
_generated_init = CompileConfig.__init__


@functools.wraps(_generated_init)
def _checked_init(self, *args, **kwargs):
    # A field name mistyped here or in dataclasses.replace(config, ...) is fp8conf's usage error,
    # naming the fields, not the dataclass's bare TypeError.
    unknown = sorted(set(kwargs) - set(_FIELDS))
    if unknown:
        raise FP8ConfigError(f"CompileConfig: no field {', '.join(unknown)}; its fields are {', '.join(_FIELDS)}")
    if len(args) > len(_FIELDS):
        raise FP8ConfigError(f"CompileConfig takes at most {len(_FIELDS)} fields ({', '.join(_FIELDS)}), got {len(args)} positional")
    _generated_init(self, *args, **kwargs)


CompileConfig.__init__ = _checked_init
