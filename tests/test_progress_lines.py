"""The per-test progress lines of a conformance run: one per test that checked something."""

from __future__ import annotations

import pytest

from conformance.plugin.progress import progress_line
from conformance.plugin.report import EXAMPLES_KEY, NOT_SUPPORTED, PROPERTY_KEY


def _report(outcome, longrepr=None, when="call"):
    return pytest.TestReport(
        "conformance/properties/test_x.py::test_PROV_001_x", ("x", 1, "x"), {}, outcome, longrepr, when,
        user_properties=[(PROPERTY_KEY, "PROV-001"), (EXAMPLES_KEY, 25)], duration=1.25,
    )


def test_a_test_that_ran_gets_its_line():
    assert progress_line(_report("passed")) == "PROV-001   test_PROV_001_x  pass  25 examples  1.2 s"


def test_a_not_supported_test_gets_no_line_of_its_own():
    # A backend claiming few capabilities used to get a line for each of dozens of tests that
    # ran nothing; the summary names them once per capability.
    skipped = _report("skipped", ("x.py", 1, f"Skipped: {NOT_SUPPORTED} capability 'mx' not claimed"), when="setup")
    assert progress_line(skipped) is None
    gpu = _report("skipped", ("x.py", 1, "Skipped: needs a CUDA device"), when="setup")
    assert progress_line(gpu).startswith("PROV-001   test_PROV_001_x  skipped")
