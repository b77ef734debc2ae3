"""The plugin, installed, changes nothing in a project that has nothing to do with FP8.

The project below registers and loads a Hypothesis profile ``ci`` of its own and has a ``gpu``
marker of its own; run with fp8conf's plugin loaded (its entry point) and without
``--fp8-backend``, its profile must stay loaded and its GPU test must run, also where torch
cannot be imported at all.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest_plugins = ["pytester"]

# A sitecustomize module, found first on PYTHONPATH, makes `import torch` fail in the process.
TORCH_BLOCKER = """
    import sys

    class _NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, _NoTorch())
"""

FOREIGN_CONFTEST = """
    from hypothesis import settings

    settings.register_profile("ci", max_examples=500)
    settings.load_profile("ci")
"""

FOREIGN_TESTS = """
    import os
    import sys

    import pytest
    from hypothesis import settings


    def test_its_own_profile_stays_loaded():
        assert settings.get_current_profile_name() == "ci"
        assert settings.default.max_examples == 500


    @pytest.mark.gpu
    def test_its_own_gpu_marker_runs():
        pass


    def test_fp8conf_plugin_is_loaded_and_inert(request):
        assert request.config.pluginmanager.has_plugin("fp8conf")
        assert request.config.getoption("fp8_backend") is None  # its options stay registered
        assert "torch" not in sys.modules


    def test_torch_is_importable_as_the_run_says():  # last: it imports torch
        try:
            import torch  # noqa: F401
        except ImportError:
            importable = False
        else:
            importable = True
        assert importable == (os.environ["EXPECT_TORCH"] == "1")
"""


@pytest.fixture
def foreign_project(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeini("[pytest]\nmarkers =\n    gpu: the project's own GPU tests\n")
    pytester.makeconftest(FOREIGN_CONFTEST)
    pytester.makepyfile(test_foreign=FOREIGN_TESTS)
    return pytester


def _without_torch(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = pytester.mkdir("no_torch")
    (blocker / "sitecustomize.py").write_text(textwrap.dedent(TORCH_BLOCKER))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(blocker), os.environ.get("PYTHONPATH", "")]))


@pytest.mark.parametrize("torch_importable", [True, False], ids=["torch", "no-torch"])
def test_a_foreign_project_keeps_its_profile_and_its_gpu_marker(
    foreign_project, monkeypatch, torch_importable
):
    monkeypatch.delenv("FP8CONF_HYPOTHESIS_PROFILE", raising=False)
    monkeypatch.setenv("EXPECT_TORCH", "1" if torch_importable else "0")
    if not torch_importable:
        _without_torch(foreign_project, monkeypatch)
    result = foreign_project.runpytest_subprocess(
        "-p", "no:cacheprovider", "-p", "no:randomly", "-rs", "test_foreign.py",
    )
    result.assert_outcomes(passed=4)
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()


def test_the_plugin_imports_without_torch_or_hypothesis(pytester, monkeypatch):
    _without_torch(pytester, monkeypatch)
    code = (
        "import sys, conformance.plugin\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "assert 'hypothesis' not in sys.modules, 'hypothesis imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=pytester.path)
    assert proc.returncode == 0, proc.stderr
