"""Every MUST property bites: the suite, run against each mutant backend, fails the property
that mutant breaks, while the reference passes the same properties.

Each run is the suite's own pytest session with the ``fp8conf-mutants`` Hypothesis profile
(derandomized, no shrinking) at ``POWER_EXAMPLES`` models per property, the reference's as each
mutant's, and a JSON report that is read back (``tests/suite_runs.py``).
The reference's whole-suite run, every selected mutant (each on the property it must break only)
and the v2 mutants again without capability ``scaled_mm_v2`` are one plan, run one session after
the other in one process when a test of this file first asks for a verdict: torch is paid for
once, and a mutant that traces as the reference does takes the graphs the reference's run traced
(``tests/shared_traces.py``). Each mutant is still judged by a test of its own. All these tests
are one ``xdist_group``, so that under ``-n`` the plan is made once, on one worker
(tests/xdist_groups.py); ``-k`` picks which runs the plan holds.
"""

from __future__ import annotations

import pytest

from conformance.api.spec import PROPERTIES
from mutants import POWER_KEY, area_of, backends, distributed, e8m0, families, graphpp, moe, mx_swizzled, numerics, nvfp4, own_modules, peers, power_table, regions, rewrites, scaled_mm_v2  # tests/ is on sys.path (tests/conftest.py)
from suite_runs import POWER_EXAMPLES, Run, failing, reads_shared_run, run_suite, run_suites  # noqa: F401  (run_suite: other tests import it from here)
from timings import SESSIONS

MUTANTS = (
    backends.MUTANTS + regions.MUTANTS + e8m0.MUTANTS + graphpp.MUTANTS + peers.MUTANTS + moe.MUTANTS + families.MUTANTS
    + distributed.MUTANTS
    + scaled_mm_v2.MUTANTS
    + own_modules.MUTANTS
    + rewrites.MUTANTS
    + nvfp4.MUTANTS
    + mx_swizzled.MUTANTS
    + numerics.MUTANTS
)
#: Mutants of the makefx backend: the properties they break pass on makefx (tests/test_makefx.py).
ALL_MUTANTS = MUTANTS + peers.MAKEFX_MUTANTS


def _run(mutant) -> Run:
    return Run(mutant.__name__, f"{mutant.__module__}:{mutant.__name__}", (mutant.KILLED_BY,), POWER_EXAMPLES)


def test_every_must_property_of_a_claimed_capability_has_a_mutant():
    from conformance.backends.reference import ReferenceBackend
    from trainer_backend import TrainerBackend

    # MOE-008's mutant needs an sm90 GPU, like cudagraph's; it lives with the GPU run too.
    covered = {m.KILLED_BY for m in ALL_MUTANTS + moe.GPU_MUTANTS}
    # cudagraph (NUM-004) needs a GPU, which CI machines lack; its mutants live with the GPU run.
    # The worked example claims nothing the reference does not; its capabilities count all the same.
    claimed = (ReferenceBackend.capabilities | TrainerBackend.capabilities) - {"cudagraph"}
    wanted = {p.id for p in PROPERTIES.values() if p.level == "MUST" and p.capability in claimed}
    assert wanted <= covered, f"MUST properties without a mutant: {sorted(wanted - covered)}"


#: The xdist group, and time-summary area, of every test that reads the plan.
GROUP = "suite-reference-and-mutants"
_REFERENCE_TESTS = (
    "test_reference_passes_every_property_it_claims",
    "test_reference_passes_every_property_a_mutant_breaks",
    "test_the_reference_run_shows_the_moe_properties_experts_on_the_second_grouped_api",
)
_WITHOUT_V2_TEST = "test_the_v2_mutants_pass_their_property_when_no_v2_linear_is_drawn"



@pytest.fixture(scope="module")
def verdicts(request, tmp_path_factory):
    """The verdicts of the plan, by run label, made when a test first asks: the reference's
    whole run if a test reading it was selected, then every selected mutant, then the v2
    mutants without v2 if their test was selected."""
    selected = [item for item in request.session.items if item.module is request.module]
    names = {getattr(item, "originalname", item.name) for item in selected}
    mutants = {item.callspec.params["mutant"] for item in selected if getattr(item, "originalname", None) == "test_mutant_is_caught_by_its_property"}
    runs = [Run("reference", "reference", examples=POWER_EXAMPLES)] if names & set(_REFERENCE_TESTS) else []
    runs += [_run(m) for m in ALL_MUTANTS if m in mutants]
    if _WITHOUT_V2_TEST in names and _has_v2():
        runs += [_run(m) for m in scaled_mm_v2.WITHOUT_V2]
    return run_suites(runs, tmp_path_factory.mktemp("reference-and-mutants"))


def _has_v2() -> bool:
    return scaled_mm_v2.MUTANTS[0].capabilities >= {"scaled_mm_v2"}


@pytest.fixture(scope="module")
def reference_run(verdicts):
    """The whole suite against the reference, read by several tests."""
    return verdicts["reference"]


@reads_shared_run(GROUP)
def test_reference_passes_every_property_it_claims(reference_run, record_property):
    record_property(SESSIONS, ("suite-reference", reference_run.seconds or 0.0))
    statuses, out = reference_run.require()
    # "skipped" is a GPU property on a machine without one; anything else must pass.
    failed = failing(statuses)
    assert not failed, f"reference fails {failed}:\n{out[-4000:]}"


@reads_shared_run(GROUP)
def test_reference_passes_every_property_a_mutant_breaks(reference_run):
    # Otherwise a mutant "caught" by a property would only show that the property fails anyway.
    # A property of a capability the reference does not claim (rewrites) is passed by the worked
    # example, on which its mutants are built (tests/test_worked_example.py).
    from conformance.backends.reference import ReferenceBackend

    statuses, out = reference_run.require()
    passed = {k for k, v in statuses.items() if v["status"] == "pass"}
    wanted = {m.KILLED_BY for m in MUTANTS if PROPERTIES[m.KILLED_BY].capability in ReferenceBackend.capabilities}
    assert wanted <= passed, f"not passed: {sorted(wanted - passed)}"


@reads_shared_run(GROUP)
def test_the_reference_run_shows_the_moe_properties_experts_on_the_second_grouped_api(reference_run):
    from conformance.backends.reference import ReferenceBackend

    if "scaled_grouped_mm_v2" not in ReferenceBackend.capabilities:
        pytest.skip("this torch has no F.scaled_grouped_mm: the reference claims no scaled_grouped_mm_v2")
    statuses, _ = reference_run.require()
    for property_id in ("MOE-001", "MOE-002", "MOE-003", "MOE-004", "MOE-005"):
        notes = statuses[property_id].get("notes", ())
        assert any("experts on F.scaled_grouped_mm drawn" in n for n in notes), (property_id, notes)
    # The properties that run experts say why they ran none on the second API here (CPU: emulated).
    for property_id in ("MOE-006", "MOE-007"):
        notes = statuses[property_id].get("notes", ())
        assert any(n.startswith(("experts on F.scaled_grouped_mm not run", "each model run with")) for n in notes), (property_id, notes)


@reads_shared_run(GROUP)
def test_the_reference_run_draws_every_family_in_every_area_the_matrix_says(reference_run):
    # The coverage matrix (conformance/report/coverage.py, SPEC's Coverage): each family the reference
    # claims is built by every area the matrix marks drawn, and by no area it marks N/A (a stale
    # reason). Areas of capabilities the reference does not claim (RWR: rewrites) are the worked
    # example's to draw.
    from conformance.backends.reference import ReferenceBackend
    from conformance.report.coverage import DRAWN, EXPECTED, area_of

    reference_run.require()
    seen = reference_run.coverage or {}
    claimed = {area_of(p.id) for p in PROPERTIES.values() if p.capability in ReferenceBackend.capabilities}
    missing = {row: [a for a, cell in cells.items() if cell == DRAWN and a in claimed and a not in seen.get(row, ())]
               for row, cells in EXPECTED.items()}
    stale = {row: [a for a in seen.get(row, ()) if EXPECTED[row].get(a, DRAWN) != DRAWN] for row in EXPECTED}
    unknown = sorted(set(seen) - set(EXPECTED))
    assert not any(missing.values()), f"families an area should draw but did not: { {r: a for r, a in missing.items() if a} }"
    assert not any(stale.values()), f"cells marked N/A that the run drew: { {r: a for r, a in stale.items() if a} }"
    assert not unknown, f"families the run built that the matrix has no row for: {unknown}"


@reads_shared_run(GROUP)
@pytest.mark.parametrize("mutant", [pytest.param(m, id=m.name) for m in ALL_MUTANTS])
def test_mutant_is_caught_by_its_property(mutant, verdicts, record_property):
    verdict = verdicts[mutant.__name__]
    status = verdict.status(mutant.KILLED_BY)
    # Read back by tests/conftest.py, which prints the suite's power per area at the end; a run
    # that left no report counts as a mutant not caught.
    record_property(POWER_KEY, (area_of(mutant.KILLED_BY), status == "fail"))
    record_property(SESSIONS, (f"mutants-{area_of(mutant.KILLED_BY)}", verdict.seconds or 0.0))
    _, out = verdict.require()
    assert status == "fail", f"{mutant.name} survived {mutant.KILLED_BY} (status {status}):\n{out[-4000:]}"


@reads_shared_run(GROUP)
def test_the_v2_mutants_pass_their_property_when_no_v2_linear_is_drawn(verdicts, record_property):
    # Each mutant of tests/mutants/scaled_mm_v2.py again without capability scaled_mm_v2: the
    # property that catches it passes, so what catches it is the v2 draw, not another defect.
    if not _has_v2():
        pytest.skip("this torch has no F.scaled_mm: the reference claims no scaled_mm_v2")
    for mutant in scaled_mm_v2.WITHOUT_V2:
        verdict = verdicts[mutant.__name__]
        record_property(SESSIONS, ("v2 mutants without v2", verdict.seconds or 0.0))
        _, out = verdict.require()
        assert verdict.status(mutant.KILLED_BY) == "pass", f"{mutant.__name__} failed {mutant.KILLED_BY}:\n{out[-4000:]}"


def test_the_power_table_counts_per_area():
    table = power_table([("REG", True), ("REG", False), ("BND", True)])
    assert table.splitlines()[2:] == ["| BND | 1 / 1 |", "| REG | 1 / 2 |", "| all | 2 / 3 |"]
