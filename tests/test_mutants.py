"""Every MUST property bites: the suite, run against each mutant backend, fails the property
that mutant breaks, while the reference passes the same properties.

Each run is a real ``pytest --fp8-backend=...`` subprocess with the ``mutants`` Hypothesis
profile (derandomized, no shrinking) and a JSON report that is read back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.api.spec import PROPERTIES
from mutants import POWER_KEY, area_of, backends, e8m0, graphpp, moe, peers, power_table, regions  # tests/ is on sys.path (tests/conftest.py)

MUTANTS = backends.MUTANTS + regions.MUTANTS + e8m0.MUTANTS + graphpp.MUTANTS + peers.MUTANTS + moe.MUTANTS
#: Mutants of the makefx backend: the properties they break pass on makefx (tests/test_makefx.py).
ALL_MUTANTS = MUTANTS + peers.MAKEFX_MUTANTS

ROOT = Path(__file__).resolve().parent.parent


def _test_name(property_id: str) -> str:
    return "test_" + property_id.replace("-", "_") + "_"


def run_suite(backend: str, property_ids, tmp_path: Path) -> dict:
    """Run the suite (only ``property_ids``' tests, or all when None) and read its report back."""
    report = tmp_path / f"{backend.rsplit(':', 1)[-1]}.json"
    selection = " or ".join(_test_name(p) for p in property_ids) if property_ids else ""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", f"--fp8-backend={backend}", f"--fp8-report={report}",
         "--hypothesis-profile=fp8conf-mutants", "-k", selection, "-q", "-p", "no:cacheprovider", "-p", "no:randomly"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert report.exists(), f"no report from {backend}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(report.read_text())["properties"], proc.stdout


def test_every_must_property_of_a_claimed_capability_has_a_mutant():
    from conformance.backends.reference import ReferenceBackend

    # MOE-008's mutant needs an sm90 GPU, like cudagraph's; it lives with the GPU run too.
    covered = {m.KILLED_BY for m in ALL_MUTANTS + moe.GPU_MUTANTS}
    # cudagraph (NUM-004) needs a GPU, which CI machines lack; its mutants live with the GPU run.
    claimed = ReferenceBackend.capabilities - {"cudagraph"}
    wanted = {p.id for p in PROPERTIES.values() if p.level == "MUST" and p.capability in claimed}
    assert wanted <= covered, f"MUST properties without a mutant: {sorted(wanted - covered)}"


def test_reference_passes_every_property_it_claims(tmp_path):
    statuses, out = run_suite("reference", None, tmp_path)
    # "skipped" is a GPU property on a machine without one; anything else must pass.
    failing = {k: v["status"] for k, v in statuses.items() if v["status"] not in ("pass", "not_supported", "skipped")}
    assert not failing, f"reference fails {failing}:\n{out[-4000:]}"
    assert {m.KILLED_BY for m in MUTANTS} <= {k for k, v in statuses.items() if v["status"] == "pass"}


@pytest.mark.parametrize("mutant", ALL_MUTANTS, ids=lambda m: m.name)
def test_mutant_is_caught_by_its_property(mutant, tmp_path, record_property):
    statuses, out = run_suite(f"{mutant.__module__}:{mutant.__name__}", [mutant.KILLED_BY], tmp_path)
    status = statuses.get(mutant.KILLED_BY, {}).get("status")
    # Read back by tests/conftest.py, which prints the suite's power per area at the end.
    record_property(POWER_KEY, (area_of(mutant.KILLED_BY), status == "fail"))
    assert status == "fail", f"{mutant.name} survived {mutant.KILLED_BY} (status {status}):\n{out[-4000:]}"


def test_the_power_table_counts_per_area():
    table = power_table([("REG", True), ("REG", False), ("BND", True)])
    assert table.splitlines()[2:] == ["| BND | 1 / 1 |", "| REG | 1 / 2 |", "| all | 2 / 3 |"]
