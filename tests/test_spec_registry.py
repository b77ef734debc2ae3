"""The property registry (fp8contract/spec.py) against the suite's tests, read statically.

Every ``fp8_property("...")`` citation in conformance/properties/*.py names a registered
property, and every property of a capability the reference backend claims has a test. A
property without a test is allowed only on the TODO list below, and only while its capability
is unclaimed: claiming a capability means writing its tests first.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import conformance
from conformance.backends.reference import ReferenceBackend
from conformance.api.spec import PROPERTIES, SPEC_VERSION
from conformance.api.types import CAPABILITIES

PROPERTIES_DIR = Path(conformance.__file__).resolve().parent / "properties"
SPEC_MD = Path(conformance.__file__).resolve().parent / "SPEC.md"

#: TODO: properties without a test yet (none now; a new property may sit here while its test is
#: written, never when the reference claims its capability).
UNTESTED_TODO: frozenset[str] = frozenset()


def _citations() -> list[tuple[str, int, object]]:
    """(file, line, first argument) of every ``fp8_property(...)`` call, however spelled."""
    found = []
    for path in sorted(PROPERTIES_DIR.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name != "fp8_property":
                continue
            arg = node.args[0] if len(node.args) == 1 and not node.keywords else None
            value = arg.value if isinstance(arg, ast.Constant) else arg
            found.append((path.name, node.lineno, value))
    return found


CITATIONS = _citations()
CITED = {value for _, _, value in CITATIONS if isinstance(value, str)}


def test_the_suite_cites_properties():
    assert len(CITATIONS) >= len(PROPERTIES) - len(UNTESTED_TODO)


def test_every_citation_is_one_literal_registered_id():
    bad = [
        f"{name}:{line}: fp8_property({value!r})"
        for name, line, value in CITATIONS
        if not isinstance(value, str) or value not in PROPERTIES
    ]
    assert not bad, "citations of unknown property IDs (or not one string literal):\n" + "\n".join(bad)


def test_every_property_of_a_claimed_capability_has_a_test():
    claimed = ReferenceBackend.capabilities
    untested = sorted(pid for pid, p in PROPERTIES.items() if p.capability in claimed and pid not in CITED)
    assert not untested, f"properties of capabilities the reference claims, without a test: {untested}"


def test_every_must_property_has_a_test_or_is_a_todo_of_an_unclaimed_capability():
    untested = {pid for pid, p in PROPERTIES.items() if p.level == "MUST" and pid not in CITED}
    assert untested <= UNTESTED_TODO, f"MUST properties without a test: {sorted(untested - UNTESTED_TODO)}"


def test_the_todo_list_is_current():
    stale = sorted(UNTESTED_TODO & CITED)
    assert not stale, f"these have tests now; remove them from UNTESTED_TODO: {stale}"
    unknown = sorted(UNTESTED_TODO - set(PROPERTIES))
    assert not unknown, f"UNTESTED_TODO names unknown properties: {unknown}"
    claimed = sorted(pid for pid in UNTESTED_TODO if PROPERTIES[pid].capability in ReferenceBackend.capabilities)
    assert not claimed, f"the reference claims the capability of these, so they need tests: {claimed}"


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


@pytest.mark.parametrize("pid", sorted(PROPERTIES))
def test_registry_entry_is_well_formed(pid):
    prop = PROPERTIES[pid]
    assert prop.id == pid
    assert re.fullmatch(r"[A-Z][A-Z0-9]*-\d{3}", pid)
    assert prop.level in ("MUST", "SHOULD")
    assert prop.capability in CAPABILITIES
    assert re.fullmatch(r"\d+\.\d+", prop.since), prop.since
    assert _version(prop.since) <= _version(SPEC_VERSION), f"{pid} is since {prop.since}, after the spec"
    assert prop.title.strip()


def test_spec_md_lists_every_tested_property_with_its_level():
    text = SPEC_MD.read_text(encoding="utf-8")
    missing = [
        pid for pid in sorted(CITED)
        if not re.search(rf"^\| {re.escape(pid)} \| {PROPERTIES[pid].level} \| {re.escape(PROPERTIES[pid].capability)} \|", text, re.M)
    ]
    assert not missing, f"conformance/SPEC.md lacks rows (or has another level/capability) for {missing}"


def test_relies_on_names_registered_properties_without_cycles():
    from conformance.api.spec import relied_on

    for prop in PROPERTIES.values():
        assert set(prop.relies_on) <= set(PROPERTIES), prop.id
        assert prop.id not in relied_on(prop.id), f"{prop.id} relies on itself"
    # What the report groups under a provenance defect.
    assert "PROV-003" in relied_on("VAL-003") and "PROV-003" in relied_on("BND-005")
    assert relied_on("PROV-003") == () and relied_on("FPR-001") == ()


_SPEC_ROW = re.compile(r"^\| ([A-Z][A-Z0-9]*-\d{3}) \| (MUST|SHOULD) \| ([a-z0-9.]+) \| (.*) \|$", re.M)


def test_spec_md_and_the_registry_state_each_rule_in_one_wording():
    # A rule said two ways is two rules: SPEC.md's table row `| ID | level | capability | rule |`
    # and the registry's (level, capability, title) must be the same text, for every property.
    rows = {m.group(1): m.groups()[1:] for m in _SPEC_ROW.finditer(SPEC_MD.read_text(encoding="utf-8"))}
    registry = {pid: (p.level, p.capability, p.title) for pid, p in PROPERTIES.items()}
    assert sorted(rows) == sorted(registry), (
        f"SPEC.md rows without a registry entry: {sorted(set(rows) - set(registry))}; "
        f"registry entries without a SPEC.md row: {sorted(set(registry) - set(rows))}"
    )
    differing = {pid: (rows[pid], registry[pid]) for pid in rows if rows[pid] != registry[pid]}
    assert not differing, "SPEC.md and fp8contract/spec.py word these rules differently:\n" + "\n".join(
        f"{pid}:\n  SPEC.md:  {spec}\n  registry: {reg}" for pid, (spec, reg) in sorted(differing.items())
    )


def _tests_citing() -> dict[str, list[tuple[str, str | None]]]:
    """Property ID -> ``(test name, docstring)`` of every test function citing it."""
    found: dict[str, list] = {}
    for path in sorted(PROPERTIES_DIR.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef):
                continue
            for decorator in node.decorator_list:
                if isinstance(decorator, ast.Call) and getattr(decorator.func, "attr", None) == "fp8_property":
                    found.setdefault(decorator.args[0].value, []).append((node.name, ast.get_docstring(node)))
    return found


def test_every_must_property_test_names_the_cheapest_defect_it_fails():
    # Each MUST property's test says, in its docstring, which cheapest defect would still pass
    # the rule as tested and why the test fails it: the suite's account of its own power.
    undocumented = [
        f"{pid}: {name}"
        for pid, tests in sorted(_tests_citing().items())
        if PROPERTIES[pid].level == "MUST"
        for name, doc in tests
        if not doc or "defect" not in doc
    ]
    assert not undocumented, "MUST property tests without an adversary docstring:\n" + "\n".join(undocumented)
