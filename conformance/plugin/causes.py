"""Root causes of a failing run, decided on evidence: which failures are consequences of another
failing property, and which are one defect seen by several properties.

That a property relies on a failing one (``Property.relies_on``: a validator counts FP8 compute
by its provenance) makes its failure a suspect consequence, not a proven one: a backend may have
a validation defect of its own beside its provenance defect, and labelling it a consequence hides
it until the first is fixed. So the verdict reads what each property did on each example (drawn
model, by key), from the ``evidence`` of the report rows (:func:`~conformance.plugin.report.property_row`):

* **Consequence.** A failing property B is a consequence of a failing property A it relies on
  (directly or through others) when both failed on at least one example and B failed on no
  example that A passed. An example only one of them ran is evidence neither way. B names the
  root causes behind A (A itself when A is no consequence) and the examples both failed on.
* **Root cause of its own.** A failing property that relies on a failing one without that
  evidence is a root cause of its own, and says why: it failed on an example the other passed,
  or no example failed both.
* **One defect.** Root causes are one defect when they failed on the same examples (an example
  one failed and the other ran, the other failed too; at least one in common) and their failures
  there name a common module of the model or node of the graph. A property joins a defect only
  when this holds with every property already in it and something is named by all of them on an
  example all of them failed. Properties that rely on one another never group: relying is
  decided by the first rule. Each failure names where its property first saw the defect (a
  forward check the first layer, a backward check the last), so a common name on one shared
  example is asked for, not on each.

Plain data in, plain data out: :func:`decide` takes the rows and the spec registry.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping

__all__ = ["FAILED", "Defect", "Evidence", "Verdict", "consequence_evidence", "decide", "same_defect"]

#: Statuses of a property that count as a defect of the backend.
FAILED = ("fail", "error")


@dataclasses.dataclass(frozen=True)
class Evidence:
    """What one property did on the examples it ran: ``failed`` maps an example key to the
    modules and nodes its failure there named; ``passed`` holds the examples it never failed."""

    failed: Mapping[str, frozenset[str]]
    passed: frozenset[str]

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> "Evidence":
        found = row.get("evidence") or {}
        failed = {
            key: frozenset(f"module {m}" for m in named.get("modules", ()))
            | frozenset(f"node {n}" for n in named.get("nodes", ()))
            for key, named in found.get("failed", {}).items()
        }
        return cls(failed, frozenset(found.get("passed", ())) - failed.keys())


def consequence_evidence(dependent: Evidence, upstream: Evidence) -> tuple[list[str], list[str]]:
    """``(shared, contrary)``: the examples both failed, and those ``dependent`` failed while
    ``upstream`` passed. ``dependent`` is a consequence of ``upstream`` when ``shared`` is not
    empty and ``contrary`` is."""
    shared = sorted(dependent.failed.keys() & upstream.failed.keys())
    contrary = sorted(dependent.failed.keys() & upstream.passed)
    return shared, contrary


def same_defect(a: Evidence, b: Evidence) -> tuple[list[str], dict[str, list[str]]] | None:
    """``(examples, named)`` when ``a`` and ``b`` look like one defect: they failed on the same
    examples (of those both ran), and on some of them named something in common (``named``:
    example key -> what both named there); None otherwise."""
    shared = sorted(a.failed.keys() & b.failed.keys())
    if not shared or a.failed.keys() & b.passed or b.failed.keys() & a.passed:
        return None
    named = {key: sorted(a.failed[key] & b.failed[key]) for key in shared}
    named = {key: common for key, common in named.items() if common}
    return (shared, named) if named else None


@dataclasses.dataclass
class Defect:
    """One root cause: the properties that see it, the failures that follow from it, its
    ``examples`` (those its property failed; for several properties, those all of them failed
    naming something in common, ``named``), and ``why``: what makes several properties one
    defect, or why a property relying on a failing one stands alone."""

    properties: list[str]
    consequences: list[str] = dataclasses.field(default_factory=list)
    examples: list[str] = dataclasses.field(default_factory=list)
    named: list[str] = dataclasses.field(default_factory=list)
    why: str | None = None
    #: Property relied on -> examples this defect's property failed and that one passed.
    contrary: dict[str, list[str]] = dataclasses.field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Verdict:
    """The decision over a run: its defects, and per failing property its root causes and the
    examples it failed with the properties it relies on (``caused_by``, ``caused_on``:
    consequences only), and a sentence saying how that was decided (``causes``)."""

    defects: list[Defect]
    caused_by: dict[str, list[str]]
    causes: dict[str, str]
    caused_on: dict[str, list[str]] = dataclasses.field(default_factory=dict)

    def root_causes(self) -> dict[str, list[str]]:
        """The first property of each defect with consequences -> those consequences (the
        report's ``summary.root_causes``)."""
        return {d.properties[0]: d.consequences for d in self.defects if d.consequences}


def _relied_on(property_id: str, properties: Mapping[str, Any]) -> list[str]:
    """What ``property_id`` relies on, directly or through others, nearest first."""
    found: list[str] = []
    pending = list(getattr(properties.get(property_id), "relies_on", ()))
    while pending:
        other = pending.pop(0)
        if other not in found and other != property_id and other in properties:
            found.append(other)
            pending.extend(getattr(properties[other], "relies_on", ()))
    return found


def _listed(ids: Iterable[str]) -> str:
    ids = list(ids)
    return ids[0] if len(ids) == 1 else ", ".join(ids[:-1]) + " and " + ids[-1]


def _models(keys: list[str], limit: int = 3) -> str:
    shown = ", ".join(keys[:limit]) + (f" and {len(keys) - limit} more" if len(keys) > limit else "")
    return f"model{'s' if len(keys) > 1 else ''} {shown}"


def _own_reason(upstream: list[str], contrary: Mapping[str, list[str]]) -> str:
    """Why a property relying on the failing ``upstream`` is a root cause of its own, given the
    examples it failed and each of those passed (``contrary``; an empty list: no example failed
    both, an absent entry: evidence of a consequence, which led to no root)."""
    verb = "fails" if len(upstream) == 1 else "fail"
    clauses = []
    passing = [pid for pid in upstream if contrary.get(pid)]
    for key in dict.fromkeys(contrary[pid][0] for pid in passing):
        which = [pid for pid in passing if contrary[pid][0] == key]
        clauses.append(f"fails on model {key}, which {_listed(which)} {'passes' if len(which) == 1 else 'pass'}")
    unshared = [pid for pid in upstream if pid in contrary and not contrary[pid]]
    if unshared:
        clauses.append(f"no model failed both it and {_listed(unshared)}")
    return f"relies on {_listed(upstream)}, which {verb} too, but " + "; ".join(clauses)


def _consequence(roots: list[str], shared: Mapping[str, list[str]]) -> str:
    """Why a property is a consequence of ``roots``: the properties it relies on that it failed
    with (``shared``: property -> examples both failed), and on no example they passed."""
    direct = list(shared)
    examples = sorted({key for keys in shared.values() for key in keys})
    return (
        f"consequence of {_listed(roots)}: fails with {_listed(direct)} on {_models(examples)} "
        f"and on no model {'it passes' if len(direct) == 1 else 'they pass'}"
    )


def decide(rows: Mapping[str, Mapping[str, Any]], properties: Mapping[str, Any]) -> Verdict:
    """The defects of a run from its report ``rows`` (see the module docstring for the rules)."""
    failing = [pid for pid, row in rows.items() if row["status"] in FAILED]
    evidence = {pid: Evidence.of(rows[pid]) for pid in failing}
    upstream = {pid: [u for u in _relied_on(pid, properties) if u in evidence] for pid in failing}
    shared: dict[str, dict[str, list[str]]] = {}
    contrary: dict[str, dict[str, list[str]]] = {}
    for pid in failing:
        for other in upstream[pid]:
            both, against = consequence_evidence(evidence[pid], evidence[other])
            if both and not against:
                shared.setdefault(pid, {})[other] = both
            else:
                contrary.setdefault(pid, {})[other] = against
    roots_of: dict[str, list[str]] = {}

    def roots(pid: str, seen: frozenset[str] = frozenset()) -> list[str]:
        if pid not in shared:
            return [pid]
        if pid not in roots_of:
            found: list[str] = []
            for other in shared[pid]:
                if other not in seen:
                    found += [r for r in roots(other, seen | {pid}) if r not in found]
            # A root the property itself failed where it passed explains nothing of it.
            found = [r for r in found if r in shared[pid] or not contrary.get(pid, {}).get(r)]
            roots_of[pid] = found
        return roots_of[pid]

    consequences = [pid for pid in failing if pid in shared and roots(pid)]
    causes: dict[str, str] = {}
    caused_by = {pid: roots(pid) for pid in consequences}
    for pid in consequences:
        causes[pid] = _consequence(caused_by[pid], shared[pid])
    related = {pid: set(upstream[pid]) for pid in failing}
    defects = _group([pid for pid in failing if pid not in caused_by], evidence, related)
    for defect in defects:
        defect.consequences = [pid for pid in consequences if set(caused_by[pid]) & set(defect.properties)]
        if len(defect.properties) > 1:
            every = "both" if len(defect.properties) == 2 else f"all {len(defect.properties)}"
            defect.why = (
                f"{every} fail on the same models and name the same {_listed(defect.named)} on "
                f"{_models(defect.examples)}"
            )
            for pid in defect.properties:
                others = [other for other in defect.properties if other != pid]
                causes[pid] = f"one defect with {_listed(others)}: {defect.why}"
                if upstream[pid]:
                    causes[pid] += f"; it {_own_reason(upstream[pid], contrary.get(pid, {}))}"
        elif upstream[defect.properties[0]]:
            pid = defect.properties[0]
            defect.why = _own_reason(upstream[pid], contrary.get(pid, {}))
            defect.contrary = {other: keys for other, keys in contrary.get(pid, {}).items() if keys}
            causes[pid] = f"root cause of its own: {defect.why}"
    caused_on = {pid: sorted({key for keys in shared[pid].values() for key in keys}) for pid in consequences}
    return Verdict(defects, caused_by, causes, caused_on)


def _group(roots: list[str], evidence: Mapping[str, Evidence], related: Mapping[str, set[str]]) -> list[Defect]:
    """The root causes as defects: a property joins the first defect it shares with every
    property in it (:func:`same_defect`, and something named by all on one example all failed),
    or starts its own. ``related``: what each property relies on."""
    defects: list[Defect] = []
    named_by: dict[int, dict[str, set[str]]] = {}  # defect index -> example -> named by all
    for pid in roots:
        for index, defect in enumerate(defects):
            members = defect.properties
            if any(other in related[pid] or pid in related[other] for other in members):
                continue
            found = [same_defect(evidence[pid], evidence[other]) for other in members]
            if not all(found):
                continue
            # Named by all of them on one example all of them failed, not pair by pair only.
            common = {
                key: set.intersection(*(set(f[1].get(key, ())) for f in found))
                for key in set.intersection(*(set(f[0]) for f in found))
            }
            if index in named_by:
                common = {key: names & named_by[index].get(key, set()) for key, names in common.items()}
            common = {key: names for key, names in common.items() if names}
            if common:
                members.append(pid)
                named_by[index] = common
                defect.examples = sorted(common)
                defect.named = sorted(set().union(*common.values()))
                break
        else:
            defects.append(Defect([pid], examples=sorted(evidence[pid].failed)))
    return defects
