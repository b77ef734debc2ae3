"""The pytest plugin of the conformance suite (entry point ``pytest11: fp8conf``).

Installed, it changes nothing in a pytest run without ``--fp8-backend``: it registers its
``--fp8-*`` options and the names of its markers, loads no Hypothesis profile, gates no test and
imports neither torch nor Hypothesis. With ``--fp8-backend=NAME`` (an entry point of the group
``fp8conf.backends``) or ``--fp8-backend=package.module:Class`` it (an empty value, as an unset
variable gives, is a usage error, not a run that checks nothing):

* registers the Hypothesis profiles ``fp8conf-dev`` / ``fp8conf-ci`` / ``fp8conf-thorough``
  and loads ``fp8conf-ci`` unless ``--hypothesis-profile`` or ``$FP8CONF_HYPOTHESIS_PROFILE``
  picks another (:mod:`~conformance.plugin.profiles`);
* checks ``--fp8-report`` (by creating its files), ``--fp8-expectations`` and ``--fp8-property``
  before any test runs (:mod:`~conformance.plugin.usage`) and keeps only the tests of
  ``--fp8-property``;
* loads and instantiates the backend once per session (fixture ``fp8_backend``;
  :mod:`~conformance.run.loading`);
* collects ``conformance/properties/`` of the installed package when no test path is given;
* checks every ``@pytest.mark.fp8_property(ID)`` against :mod:`conformance.api.spec`, skips a
  test as ``not_supported`` when the backend does not claim the property's capability or the
  property is newer than the spec version checked, and skips ``fp8_gpu`` / ``fp8_sm89`` /
  ``fp8_sm90`` / ``fp8_sm100`` tests the local device cannot run
  (:mod:`~conformance.run.gating`);
* marks the tests under an entry of ``--fp8-expectations`` xfail, not strict, and runs their
  Hypothesis tests without shrinking (:mod:`conformance.judge.expectations`);
* bounds every example by ``--fp8-timeout`` (:mod:`conformance.run.watchdog`) and shrinking by
  ``--fp8-shrink-seconds``, counts the examples Hypothesis ran and adds to every failure the
  command that replays it (:mod:`~conformance.plugin.instrumentation`,
  :mod:`conformance.report.replay`); a crashed xdist worker's report names the backend method it was
  in (:mod:`~conformance.plugin.crashes`); an xdist worker freezes its heap once its reports
  are sent, so that its exit is not slowed by the interpreter's last collections
  (:mod:`~conformance.plugin.worker_end`);
* prints a line per test as it finishes (:mod:`~conformance.plugin.progress`) and keeps
  torch's and torchao's chatter out of captured logs (:mod:`~conformance.plugin.quiet`);
* prints a per-property summary, failures and root causes first, and, with ``--fp8-report=PATH``, writes it as JSON at PATH and
  as Markdown beside it (:mod:`~conformance.plugin.report`, :mod:`~conformance.plugin.render`);
  root causes and consequences are decided from what each property did on each example
  (:mod:`~conformance.plugin.causes`);
* says in the report how the run ended, and gives no MUST score to a run cut short (Ctrl-C,
  ``-x``): it lists the properties not reached (:mod:`~conformance.plugin.ending`); writes the
  report's files whole or not at all, and leaves no earlier report behind a run that ends before
  its first test (:mod:`~conformance.plugin.report_files`).

A project that wants fp8conf's profiles or GPU gating without a backend (fp8conf's own tests
do) calls :func:`register_profiles`, :func:`load_profile` and :func:`skip_unavailable_gpu_tests`
from its ``conftest.py``.
"""

from conformance.run.gating import GPU_MARKERS, add_markers, skip_unavailable_gpu_tests
# pytest looks for hooks and fixtures on the module the entry point names: this one.
from conformance.plugin.hooks import (
    DEFAULT_TIMEOUT,
    PROPERTIES_DIR,
    fp8_backend,
    fp8_device,
    pytest_addoption,
    pytest_configure,
    pytest_load_initial_conftests,
    warm_inductor,
)
from conformance.run.loading import ENTRY_POINT_GROUP, load_backend
from conformance.plugin.profiles import (
    DEFAULT_PROFILE,
    PROFILE_ENV,
    PROFILE_NAMES,
    load_profile,
    register_profiles,
)
from conformance.plugin.report import PROPERTY_KEY, REPORT_SCHEMA_VERSION, STATUSES

__all__ = [
    "DEFAULT_PROFILE",
    "DEFAULT_TIMEOUT",
    "ENTRY_POINT_GROUP",
    "GPU_MARKERS",
    "PROFILE_ENV",
    "PROFILE_NAMES",
    "PROPERTIES_DIR",
    "PROPERTY_KEY",
    "REPORT_SCHEMA_VERSION",
    "STATUSES",
    "add_markers",
    "fp8_backend",
    "fp8_device",
    "load_backend",
    "load_profile",
    "pytest_addoption",
    "pytest_configure",
    "pytest_load_initial_conftests",
    "register_profiles",
    "skip_unavailable_gpu_tests",
    "warm_inductor",
]
