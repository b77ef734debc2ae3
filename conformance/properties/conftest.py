"""What every property test of the suite runs inside: the backend under test, served."""

from __future__ import annotations

import pytest

from conformance.run.harness import serving


# Session scope: one backend serves the whole session, and Hypothesis refuses function-scoped
# fixtures around its tests.
@pytest.fixture(scope="session", autouse=True)
def _served_backend(fp8_backend, fp8_device):
    """Draw only models the backend can be shown (no MX layers unless it claims ``mx``), build
    them on ``--fp8-device``, and print failing models as code that builds them with it."""
    with serving(fp8_backend, fp8_device):
        yield
