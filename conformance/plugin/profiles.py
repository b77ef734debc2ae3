"""The suite's Hypothesis profiles: ``fp8conf-dev``, ``fp8conf-ci``, ``fp8conf-thorough`` and the
internal ``fp8conf-mutants``.

They carry fp8conf's name so that they cannot replace a project's own ``dev`` or ``ci``. The
plugin registers and loads them only for a run with ``--fp8-backend``; fp8conf's own tests ask
for them from their ``conftest.py`` (:func:`register_profiles`, :func:`load_profile`).
Hypothesis is imported only when a profile is registered, not when this module is.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

__all__ = ["DEFAULT_PROFILE", "DEFAULT_SHRINKS", "DEFAULT_SHRINK_SECONDS", "PROFILE_ENV", "PROFILE_NAMES", "load_profile", "register_profiles"]

#: Environment variable naming the Hypothesis profile to load instead of ``fp8conf-ci``.
PROFILE_ENV = "FP8CONF_HYPOTHESIS_PROFILE"
#: The profile of ``pytest --fp8-backend`` and ``fp8conf check`` alike: derandomized, so the
#: same backend gets the same verdict from either entry point and from one run to the next.
DEFAULT_PROFILE = "fp8conf-ci"
#: Default of ``--fp8-shrinks``: how many times Hypothesis may shrink the failing example of one
#: test. A count, not a time: the example a failure shows, and so which failures the report
#: groups as one defect, must not depend on how busy the machine is.
DEFAULT_SHRINKS = 30
#: Default of ``--fp8-shrink-seconds``: a guard against a shrink that makes no progress, not the
#: bound that usually ends it (:data:`DEFAULT_SHRINKS` is); the report says when it ended one.
DEFAULT_SHRINK_SECONDS = 120.0
PROFILE_NAMES = ("fp8conf-dev", "fp8conf-ci", "fp8conf-thorough", "fp8conf-mutants")
#: The names these profiles had before they carried fp8conf's prefix.
_LEGACY_NAMES = {name.removeprefix("fp8conf-"): name for name in PROFILE_NAMES}


def _profiles() -> dict[str, dict[str, Any]]:
    from hypothesis import Phase

    no_shrink = (Phase.explicit, Phase.reuse, Phase.generate)
    return {
        "fp8conf-dev": {"max_examples": 10},
        "fp8conf-ci": {"derandomize": True, "max_examples": 25, "database": None, "print_blob": True},
        "fp8conf-thorough": {"max_examples": 200},
        # For proving that a mutant backend is caught: a failure is enough, a minimal one is not
        # needed, so shrinking (minutes on traced models) is skipped, and the test stops at its
        # first failing example (explicit or drawn) instead of running the rest for other bugs.
        # A property that passes runs every example, as under fp8conf-ci.
        "fp8conf-mutants": {
            "derandomize": True, "max_examples": 25, "database": None, "phases": no_shrink,
            "report_multiple_bugs": False,
        },
    }


def _health_checks() -> tuple[Any, ...]:
    from hypothesis import HealthCheck

    return (
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
        HealthCheck.differing_executors,
        # A derandomized profile draws the shared corpus of models (conformance.draw.strategies) with
        # Hypothesis, once per process, when a test first asks for it, possibly from inside its
        # own @given: a one-time nesting, not the per-example kind this check is about.
        *[c for c in (getattr(HealthCheck, "nested_given", None),) if c is not None],
    )


def register_profiles() -> None:
    """Register the ``fp8conf-*`` profiles with Hypothesis; loads none of them."""
    from hypothesis import settings

    # Without an explicit parent a profile inherits whatever profile is loaded right now.
    base = settings.get_profile("default")
    for name, values in _profiles().items():
        settings.register_profile(
            name, base, deadline=None, suppress_health_check=_health_checks(), **values
        )


def load_profile(config: pytest.Config, *, accept_legacy_names: bool = False) -> None:
    """Load ``$FP8CONF_HYPOTHESIS_PROFILE`` or :data:`DEFAULT_PROFILE`, unless ``--hypothesis-profile``
    names one (Hypothesis's own plugin loads that one after this hook).

    Call it from a ``pytest_configure`` that runs before Hypothesis's (``tryfirst``), after
    :func:`register_profiles`. The old names ``dev``/``ci``/``thorough``/``mutants``, where the
    project registered no profile of that name (Hypothesis's own ``ci`` does not count), are taken for the new ones when
    ``accept_legacy_names`` (the plugin's ``--fp8-backend`` runs) and are a usage error naming
    the new name otherwise.
    """
    given = config.getoption("--hypothesis-profile", None)
    if given:
        new = _renamed(given, "--hypothesis-profile", config, accept_legacy_names)
        if new != given:
            config.option.hypothesis_profile = new
        return
    from hypothesis import settings
    from hypothesis.errors import InvalidArgument

    name = os.environ.get(PROFILE_ENV) or DEFAULT_PROFILE
    name = _renamed(name, PROFILE_ENV, config, accept_legacy_names)
    try:
        settings.load_profile(name)
    except InvalidArgument as exc:
        raise pytest.UsageError(f"{PROFILE_ENV}={name!r}: {exc}") from None


def _renamed(name: str, where: str, config: pytest.Config, accept: bool) -> str:
    new = _LEGACY_NAMES.get(name)
    if new is None or _is_projects_own(name):
        return name  # not an old name, or a profile of the project's own
    if not accept:
        raise pytest.UsageError(
            f"{where}={name}: fp8conf's Hypothesis profile {name!r} is now called {new!r}"
        )
    message = f"{where}={name}: fp8conf's profile {name!r} is now {new!r}; using {new!r}"
    config.issue_config_time_warning(pytest.PytestWarning(message), stacklevel=2)
    return new


def _is_projects_own(name: str) -> bool:
    """Whether a profile ``name`` is registered, other than the ``ci`` Hypothesis registers."""
    from hypothesis import _settings, settings
    from hypothesis.errors import InvalidArgument

    try:
        profile = settings.get_profile(name)
    except InvalidArgument:
        return False
    # Hypothesis's own `ci` (derandomized, default max_examples) is not fp8conf's old `ci`:
    # taking it for that would run the suite with four times the examples, unnoticed.
    return profile is not getattr(_settings, "CI", None)
