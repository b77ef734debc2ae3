"""The runs of the suite fp8conf's own tests read (tests/suite_runs.py): several backends in one
process, each a session of its own, and a hang reported as one."""

from __future__ import annotations

import pytest

from suite_runs import Run, run_suites


@pytest.mark.slow
def test_a_backend_defect_stays_in_its_own_session(tmp_path):
    # The mutant strips provenance from the graphs it traces; were traced graphs shared between
    # the sessions of one process, the reference after it would fail PROV-001 on them. Both
    # draw the same first models (derandomized), and the mutant fails on its first: three
    # examples show it, the reference's other 22 models would show nothing more here.
    runs = [
        Run("mutant", "mutants.backends:NoBackwardProvenance", ("PROV-001",), examples=3),
        Run("reference", "reference", ("PROV-001",), examples=3),
    ]
    verdicts = run_suites(runs, tmp_path)
    assert verdicts["mutant"].status("PROV-001") == "fail", verdicts["mutant"].output[-3000:]
    assert verdicts["reference"].status("PROV-001") == "pass", verdicts["reference"].output[-3000:]
    assert verdicts["reference"].output.count("MUST score:") == 1  # its own session's output, not the mutant's too


def test_a_run_that_does_not_end_is_reported_as_a_hang(tmp_path):
    # The backend never returns: the guard, not the machine's speed, ends the run.
    run = Run("hangs", "mutants.misbehaving:TraceHangs", ("PROV-001",))
    verdict = run_suites([run], tmp_path, guard_s=10)["hangs"]
    assert verdict.statuses is None
    assert verdict.problem.startswith(
        "hang guard: the suite against mutants.misbehaving:TraceHangs (PROV-001) did not finish in 10 s"
    ), verdict.problem
    with pytest.raises(pytest.fail.Exception, match="hang guard"):
        verdict.require()
