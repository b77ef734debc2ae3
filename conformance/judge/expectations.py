"""Expected failures: the file ``--fp8-expectations`` reads.

A JSON object (or, with suffix ``.toml``, a TOML document) whose keys are property IDs or
pytest node IDs and whose values say why the failure is expected::

    {
      "PROV-003": {"reason": "backward provenance lands in 2.1", "link": "https://example.org/issues/12"},
      "test_regions.py::test_REG_005_partial_region_is_not_tagged": {"reason": "partial regions are tagged"}
    }

A value may also be the reason alone (``"PROV-003": "backward provenance lands in 2.1"``). A
node ID matches a test whose node ID equals it, or ends with ``/`` followed by it, with or
without the test's ``[parameters]``. A property ID matches every test citing that property.

The plugin marks the tests under an entry ``xfail`` (not strict: one that passes is reported
``xpass``), runs their Hypothesis tests without the shrink phase, and turns an entry that
matches no collected test into an error naming it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Iterable, Mapping

__all__ = ["Expectation", "ExpectationsError", "load", "matching"]

_PROPERTY_ID = re.compile(r"^[A-Z][A-Z0-9]*-\d+$")


class ExpectationsError(ValueError):
    """The expectations file cannot be read or names something unknown."""


@dataclasses.dataclass(frozen=True)
class Expectation:
    key: str  # a property ID or a node ID, as written in the file
    reason: str
    link: str | None = None

    @property
    def is_property(self) -> bool:
        return bool(_PROPERTY_ID.match(self.key))

    def describe(self) -> str:
        text = f"expected failure ({self.key}): {self.reason}"
        return f"{text} <{self.link}>" if self.link else text

    def as_json(self) -> dict[str, Any]:
        return {"reason": self.reason, "link": self.link}


def _parse(path: Path) -> Any:
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".toml":
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            try:
                import tomli as tomllib  # type: ignore[no-redef]
            except ModuleNotFoundError:
                raise ExpectationsError(
                    f"{path}: reading TOML needs Python 3.11+ or the tomli package; write the file as JSON"
                ) from None
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ExpectationsError(f"{path}: not valid TOML: {exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ExpectationsError(f"{path}: not valid JSON: {exc}") from None


def load(path: Path, known_properties: Iterable[str]) -> dict[str, Expectation]:
    """Read and check the file; raises :class:`ExpectationsError` with one clear sentence."""
    try:
        data = _parse(path)
    except OSError as exc:
        raise ExpectationsError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ExpectationsError(
            f"{path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}); "
            "save it as UTF-8"
        ) from None
    if not isinstance(data, Mapping):
        raise ExpectationsError(f"{path}: expected an object mapping property or test IDs to reasons")
    known = set(known_properties)
    found: dict[str, Expectation] = {}
    for key, value in data.items():
        if isinstance(value, str):
            value = {"reason": value}
        if not isinstance(value, Mapping):
            raise ExpectationsError(f"{path}: entry {key!r} must be a reason or {{reason, link}}")
        extra = set(value) - {"reason", "link"}
        if extra:
            raise ExpectationsError(f"{path}: entry {key!r} has unknown fields {sorted(extra)}; allowed: reason, link")
        reason, link = value.get("reason"), value.get("link")
        if not isinstance(reason, str) or not reason.strip():
            raise ExpectationsError(f"{path}: entry {key!r} needs a non-empty reason")
        if link is not None and not isinstance(link, str):
            raise ExpectationsError(f"{path}: entry {key!r}: link must be a string")
        entry = Expectation(str(key), reason.strip(), link)
        if entry.is_property and entry.key not in known:
            raise ExpectationsError(f"{path}: entry {key!r} is not a property of the spec")
        found[entry.key] = entry
    return found


def _node_matches(key: str, nodeid: str) -> bool:
    base = nodeid.split("[", 1)[0]
    return any(name == key or name.endswith("/" + key) for name in (nodeid, base))


def matching(expectations: Mapping[str, Expectation], nodeid: str, property_ids: Iterable[str]) -> list[Expectation]:
    """The entries that apply to the test ``nodeid`` citing ``property_ids``."""
    cited = set(property_ids)
    return [
        entry
        for entry in expectations.values()
        if (entry.key in cited if entry.is_property else _node_matches(entry.key, nodeid))
    ]
