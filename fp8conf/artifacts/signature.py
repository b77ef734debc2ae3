"""The quantization signature of a model: what a precompiled FP8 artifact was built for.

Graph trainers fingerprint a model by parameter names, shapes and dtypes, none of which change
when an ``nn.Linear`` becomes a ``Float8Linear`` or a recipe changes, so an artifact compiled
for one FP8 configuration could be loaded under another. :class:`QuantizationSignature` names
what does change: for every quantized module its FQN, kind, recipe, ``emulate`` flag and every
field of its quantization config (per tensor role the scaling type, granularity and target
dtype; per gemm the fast-accumulation flag; power-of-2 scale rounding; inner-dim padding; for MX
the block size and scale rounding; for grouped experts on ``F.scaled_grouped_mm``, ``v2``),
plus the torch and torchao versions and the ``strict`` flag; for a sharded model
(:func:`fp8conf.parallel.shard_data_parallel`), the FP8-relevant part of its parallel layout:
its kind and, per sharded quantized weight, whether it is all-gathered as FP8 or in high
precision; for a tensor-parallel model (:func:`fp8conf.parallel.shard_tensor_parallel`), its
plan: which modules are sharded, colwise or rowwise, in FP8 or not (``"parallel"``; absent for an
unsharded model, whose signature is unchanged).
Nothing else: not parameter values, shapes or ``requires_grad``, not the training flag, not
modules that are not quantized (the trainer's own fingerprint covers the model's structure).

The signature is canonical JSON (sorted keys, fixed separators, ASCII) and its :attr:`sha256` is
independent of ``PYTHONHASHSEED``, module registration order and dict order: modules are keyed
by FQN, every config is serialized field by field from its dataclass, enums by value and dtypes
by name, and nothing goes through Python's ``hash()``.

Example::

    sig = QuantizationSignature.from_model(model, strict=True)
    sig.to_json()       # '{"modules":{"layers.0":{"config":{...},"emulate":false,...}},...}'
    sig.sha256          # 'c0ffee...'
    sig.diff(other)     # [('modules[layers.0].recipe', 'tensorwise', 'rowwise'), ...]
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import re
from typing import Any

from fp8conf.errors import FP8ConfigError

__all__ = [
    "SIGNATURE_SCHEMA",
    "UNDECLARED_KIND",
    "ABSENT",
    "ModuleSignature",
    "QuantizationSignature",
    "format_differences",
    "describe_changes",
]

#: The kind a non-strict signature gives a module that computes in FP8 but declares nothing.
UNDECLARED_KIND = "undeclared"

#: Identifies the layout of the JSON; bumped when fields are added or renamed.
SIGNATURE_SCHEMA = "fp8conf.quantization-signature/1"


class _Absent:
    """The value of a field one of two diffed signatures does not have."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "<absent>"

    def __reduce__(self):
        return (_Absent, ())


#: Stands for a missing field in :meth:`QuantizationSignature.diff`.
ABSENT = _Absent()


def _json_value(value: Any, where: str) -> Any:
    """``value`` as plain JSON data, the same in every process."""
    import torch

    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, enum.Enum):
        return _json_value(value.value, where)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return repr(value) if value != value or value in (float("inf"), float("-inf")) else value
    if isinstance(value, torch.dtype):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _json_value(getattr(value, f.name), f"{where}.{f.name}") for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_json_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {str(k): _json_value(v, f"{where}.{k}") for k, v in value.items()}
    text = repr(value)
    if " at 0x" in text:  # an object repr with a memory address differs between processes
        raise FP8ConfigError(
            f"quantization signature: cannot serialize {where} = {text} ({type(value).__qualname__}) stably; "
            "extend fp8conf.artifacts.signature._json_value for this type"
        )
    return text


def _freeze(value: Any) -> Any:
    """JSON data as nested tuples, so that a signature is hashable and immutable."""
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, list):
        return ("__list__", tuple(_freeze(v) for v in value))
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, tuple):
        if len(value) == 2 and value[0] == "__list__":
            return [_thaw(v) for v in value[1]]
        return {k: _thaw(v) for k, v in value}
    return value


@dataclasses.dataclass(frozen=True)
class ModuleSignature:
    """What one quantized module computes with.

    ``config`` holds the numerics-relevant config fields as sorted ``(name, value)`` pairs (nested
    configs as nested pairs); :meth:`config_dict` gives them as a dict.
    """

    fqn: str
    kind: str
    recipe: str
    emulate: bool
    config: tuple = ()

    def config_dict(self) -> dict:
        return _thaw(self.config) if self.config else {}

    def to_dict(self) -> dict:
        return {"kind": self.kind, "recipe": self.recipe, "emulate": self.emulate, "config": self.config_dict()}


def module_signature(fqn: str, module) -> ModuleSignature | None:
    """The signature of one module, or None when it declares no quantization: its kind, recipe,
    ``emulate`` flag and every setting its :class:`~fp8conf.QuantizationConfig` names."""
    from fp8conf.quantized.protocol import quantization_config_of

    config = quantization_config_of(module)
    if config is None:
        return None
    fields = {name: _json_value(value, f"config.{name}") for name, value in config.settings}
    return ModuleSignature(fqn, config.kind, str(config.recipe), bool(config.emulate), _freeze(fields))


def _versions() -> dict[str, str]:
    import torch

    from fp8conf.quantized.float8 import import_torchao_quietly

    import_torchao_quietly()
    import torchao

    return {"torch": str(torch.__version__), "torchao": str(getattr(torchao, "__version__", "unknown"))}


@dataclasses.dataclass(frozen=True)
class QuantizationSignature:
    """The FP8 configuration a compiled artifact depends on; see the module docstring.

    Build it with :meth:`from_model`; compare two with ``==`` or :meth:`diff`; store it as
    :meth:`to_json` and read it back with :meth:`from_json`.
    """

    modules: tuple[ModuleSignature, ...]
    strict: bool
    torch_version: str
    torchao_version: str
    schema: str = SIGNATURE_SCHEMA
    #: The FP8-relevant settings of the model's parallel layout as frozen JSON data (``None``:
    #: unsharded): ``{"kind": "data_parallel", "all_gather": {weight FQN: "float8" | "high_precision"}}``
    #: or ``{"kind": "tensor_parallel", "plan": {module FQN: "float8_colwise" | "float8_rowwise" | "colwise" | "rowwise"}}``.
    parallel: tuple | None = None

    def __post_init__(self):
        # Canonical order whatever order the modules came in.
        ordered = tuple(sorted(self.modules, key=lambda m: m.fqn))
        if len({m.fqn for m in ordered}) != len(ordered):
            raise FP8ConfigError(f"QuantizationSignature: duplicate module FQNs in {[m.fqn for m in ordered]}")
        object.__setattr__(self, "modules", ordered)

    # -- building -------------------------------------------------------------------------------
    @classmethod
    def from_model(cls, model, *, strict: bool = True, example_inputs=None) -> QuantizationSignature:
        """The signature of ``model`` (a ``torch.nn.Module``) compiled under ``strict``.

        Every name under which a quantized module is registered counts (a module shared under two
        names appears twice), so the result does not depend on registration order.

        A module that computes in FP8 but declares no quantization (see
        :func:`fp8conf.register_quantized_module`) is found by running modules on fake tensors
        (:mod:`fp8conf.quantized.probe`; the whole model on ``example_inputs`` when given, else
        each linear-like module alone). Strict refuses such a model
        (:class:`~fp8conf.errors.UndeclaredFP8ModuleError`); otherwise the module is signed as kind
        ``"undeclared"`` with its class and the low-precision ops it issued, so the model's
        signature never equals the plain model's.
        """
        import torch

        from fp8conf.quantized.probe import undeclared_fp8_modules

        if not isinstance(model, torch.nn.Module):
            raise FP8ConfigError(f"QuantizationSignature.from_model expects a torch.nn.Module, got {type(model).__qualname__}")
        modules = []
        for fqn, module in model.named_modules(remove_duplicate=False):
            signature = module_signature(fqn, module)
            if signature is not None:
                modules.append(signature)
        undeclared = undeclared_fp8_modules(model, example_inputs)
        if undeclared and strict:
            from fp8conf.errors import UndeclaredFP8ModuleError
            from fp8conf.quantized.protocol import undeclared_fp8_message

            fqn, (class_, ops) = next(iter(undeclared.items()))
            others = sorted(set(undeclared) - {fqn})
            more = f" ({len(others)} more module(s) like it: {', '.join(others[:4])}{', ...' if len(others) > 4 else ''})" if others else ""
            raise UndeclaredFP8ModuleError(
                f"quantization signature: {undeclared_fp8_message(fqn, class_, ', '.join(ops))}{more}. A signature that left it "
                "out would equal the plain model's; strict=False signs it as kind 'undeclared'",
                module_fqn=fqn,
            )
        for fqn, (class_, ops) in undeclared.items():
            modules.append(ModuleSignature(fqn, UNDECLARED_KIND, "unknown", False, _freeze({"class": class_, "fp8_ops": list(ops)})))
        versions = _versions()
        from fp8conf.parallel.layout import layout_of

        layout = layout_of(model)
        parallel = _freeze(layout.signature_fields()) if layout is not None else None
        return cls(tuple(modules), bool(strict), versions["torch"], versions["torchao"], parallel=parallel)

    @classmethod
    def from_dict(cls, data: dict) -> QuantizationSignature:
        try:
            modules = tuple(
                ModuleSignature(fqn, entry["kind"], entry["recipe"], bool(entry["emulate"]), _freeze(entry.get("config", {})))
                for fqn, entry in data["modules"].items()
            )
            parallel = _freeze(data["parallel"]) if data.get("parallel") is not None else None
            return cls(modules, bool(data["strict"]), data["versions"]["torch"], data["versions"]["torchao"], data["schema"], parallel)
        except (KeyError, TypeError, AttributeError) as exc:
            raise FP8ConfigError(f"not a quantization signature: missing or malformed {exc}") from None

    @classmethod
    def from_json(cls, text: str) -> QuantizationSignature:
        try:
            data = json.loads(text)
        except (TypeError, ValueError) as exc:
            raise FP8ConfigError(f"QuantizationSignature.from_json: not JSON ({exc}); pass the text QuantizationSignature.to_json() wrote") from None
        return cls.from_dict(data)

    # -- views ----------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        data = {
            "schema": self.schema,
            "strict": self.strict,
            "versions": {"torch": self.torch_version, "torchao": self.torchao_version},
            "modules": {m.fqn: m.to_dict() for m in self.modules},
        }
        if self.parallel is not None:
            data["parallel"] = _thaw(self.parallel)
        return data

    def to_json(self, *, indent: int | None = None) -> str:
        """Canonical JSON: sorted keys, ``(",", ":")`` separators, ASCII. ``indent`` is for people;
        only the default form is canonical (and hashed)."""
        if indent is not None:
            return json.dumps(self.to_dict(), sort_keys=True, indent=indent, ensure_ascii=True)
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=True)

    @functools.cached_property
    def sha256(self) -> str:
        """Hex sha256 of :meth:`to_json`: the fingerprint."""
        return hashlib.sha256(self.to_json().encode("ascii")).hexdigest()

    @property
    def fingerprint(self) -> str:
        return self.sha256

    def fields(self) -> dict[str, Any]:
        """Every leaf field of the signature by field path (``modules[layers.0].config.pad_inner_dim``)."""
        flat: dict[str, Any] = {}
        _flatten(self.to_dict(), "", flat)
        return flat

    def diff(self, other: QuantizationSignature) -> list[tuple[str, Any, Any]]:
        """``(field_path, self's value, other's value)`` for every field that differs, sorted by path.

        A module only one side has is one entry ``modules[fqn]`` whose other value is
        :data:`ABSENT`; otherwise every differing leaf is its own entry.
        """
        mine, theirs = self.to_dict(), other.to_dict()
        out: list[tuple[str, Any, Any]] = []
        for fqn in sorted(set(mine["modules"]) | set(theirs["modules"])):
            a, b = mine["modules"].get(fqn, ABSENT), theirs["modules"].get(fqn, ABSENT)
            if a is ABSENT or b is ABSENT:
                out.append((f"modules[{fqn}]", a, b))
        rest_a, rest_b = {}, {}
        _flatten({**mine, "modules": {k: v for k, v in mine["modules"].items() if k in theirs["modules"]}}, "", rest_a)
        _flatten({**theirs, "modules": {k: v for k, v in theirs["modules"].items() if k in mine["modules"]}}, "", rest_b)
        for path in set(rest_a) | set(rest_b):
            a, b = rest_a.get(path, ABSENT), rest_b.get(path, ABSENT)
            if a != b or type(a) is not type(b):
                out.append((path, a, b))
        return sorted(out, key=lambda d: d[0])

    def summary(self) -> str:
        """One line per quantized module, for people."""
        lines = [f"quantization signature {self.sha256[:16]} (strict={self.strict}, torch {self.torch_version}, torchao {self.torchao_version})"]
        for m in self.modules:
            lines.append(f"  {m.fqn or '<root>'}: {m.kind} recipe={m.recipe} emulate={m.emulate}")
        if self.parallel is not None:
            parallel = _thaw(self.parallel)
            if "plan" in parallel:
                plan = parallel["plan"]
                fp8 = sum(1 for v in plan.values() if v.startswith("float8_"))
                lines.append(f"  parallel: {parallel.get('kind')}, {len(plan)} module(s) sharded, {fp8} of them with FP8 styles")
            gathers = parallel.get("all_gather", {})
            if "all_gather" in parallel:
                fp8 = sum(1 for v in gathers.values() if v == "float8")
                lines.append(f"  parallel: {parallel.get('kind')}, {fp8} of {len(gathers)} quantized weight(s) all-gathered as FP8")
        if not self.modules:
            lines.append("  no quantized modules")
        return "\n".join(lines)


def _flatten(value: Any, path: str, out: dict) -> None:
    if isinstance(value, dict) and value:
        for key, item in value.items():
            if path == "modules":
                child = f"modules[{key}]"
            else:
                child = f"{path}.{key}" if path else str(key)
            _flatten(item, child, out)
    else:
        out[path] = value


def format_differences(differences, *, left: str = "artifact", right: str = "current", limit: int | None = None) -> str:
    """The lines of a field diff: ``  modules[layers.0].recipe: 'tensorwise' (artifact) -> 'rowwise' (current)``."""
    shown = list(differences)[:limit] if limit else list(differences)
    lines = [f"  {path}: {_short(old)} ({left}) -> {_short(new)} ({right})" for path, old, new in shown]
    if limit and len(differences) > limit:
        lines.append(f"  ... and {len(differences) - limit} more")
    return "\n".join(lines)


def _short(value: Any) -> str:
    """A diff value for people: a whole module entry as kind/recipe/emulate, anything else as repr."""
    if isinstance(value, dict) and {"kind", "recipe", "emulate"} <= set(value):
        return f"<{value['kind']} recipe={value['recipe']!r} emulate={value['emulate']}>"
    return repr(value)


_MODULE_FIELD = re.compile(r"modules\[(?P<fqn>[^\]]*)\](?:\.(?P<field>.+))?")


def _plain(value: Any) -> str:
    return value if isinstance(value, str) else repr(value) if isinstance(value, (bool, type(None))) else json.dumps(value, sort_keys=True)


def _module_change(fields: dict[str, tuple[Any, Any]]) -> str:
    """What changed in one module, as its owner would say it."""
    if "" in fields:  # quantized on one side only
        old, new = fields[""]
        if old is ABSENT:
            return f"now quantized ({new['kind']} recipe {new['recipe']}, emulate={new['emulate']})"
        return f"no longer quantized (was {old['kind']} recipe {old['recipe']}, emulate={old['emulate']})"
    said = [f"{name} {_plain(fields[name][0])} \u2192 {_plain(fields[name][1])}" for name in ("kind", "recipe", "emulate") if name in fields]
    config = sorted(name[len("config."):] for name in fields if name.startswith("config."))
    if config and not said:  # a config edited by hand rather than a recipe change: its fields are the change
        if len(config) == 1:
            old, new = fields["config." + config[0]]
            said.append(f"config {config[0]} {_plain(old)} \u2192 {_plain(new)}")
        else:
            said.append(f"{len(config)} config fields ({', '.join(config[:3])}{', ...' if len(config) > 3 else ''})")
    return "; ".join(said)


def describe_changes(differences) -> list[str]:
    """The changes a :meth:`QuantizationSignature.diff` records, once each, as a person made them:
    ``["fc1, fc2: recipe tensorwise \u2192 rowwise", "strict True \u2192 False"]``. Modules
    with the same change share a line; the field-level detail is :func:`format_differences`'s."""
    per_module: dict[str, dict[str, tuple[Any, Any]]] = {}
    lines = []
    for path, old, new in differences:
        found = _MODULE_FIELD.fullmatch(path)
        if found:
            per_module.setdefault(found["fqn"], {})[found["field"] or ""] = (old, new)
        elif path.startswith("versions."):
            lines.append(f"{path[len('versions.'):]} {_plain(old)} \u2192 {_plain(new)}")
        else:
            lines.append(f"{path} {_plain(old)} \u2192 {_plain(new)}")
    by_change: dict[str, list[str]] = {}
    for fqn in sorted(per_module):
        by_change.setdefault(_module_change(per_module[fqn]), []).append(fqn or "<root>")
    return [f"{', '.join(fqns)}: {change}" for change, fqns in by_change.items()] + lines
