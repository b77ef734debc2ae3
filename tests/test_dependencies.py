"""Dependencies by use: the passes need torch and TorchAO alone; the suite is an extra.

A trainer that installs fp8conf for its passes does not get pytest and Hypothesis with it; a run
of the suite without them is told which extra to install, before anything runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# A None entry in sys.modules is how Python marks a module as absent: `import` raises
# ModuleNotFoundError and importlib.util.find_spec answers None, as for a package not installed.
_BLOCKER = "import sys\nfor _name in {blocked!r}:\n    sys.modules[_name] = None\n"


def _run(blocked, body: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH")])))
    code = _BLOCKER.format(blocked=sorted(blocked)) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_the_package_requires_torch_and_torchao_only_and_the_suite_is_an_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert sorted(d.split(">")[0].split("=")[0] for d in project["dependencies"]) == ["torch", "torchao"]
    suite = {d.split(">")[0] for d in project["optional-dependencies"]["conformance"]}
    assert {"pytest", "hypothesis", "pytest-xdist"} <= suite
    assert "fp8conf[conformance]" in project["optional-dependencies"]["test"]


def test_the_passes_run_without_the_test_stack():
    result = _run(("pytest", "hypothesis", "xdist", "pytest_timeout", "_pytest"), """
        import torch, fp8conf
        from stack_steps import traced
        model, x, gm = traced(1)
        fp8conf.validate_fp8_graph(gm)
        compiled = fp8conf.compile_joint(gm, mode="regional", remainder="eager")
        fp8conf.run_joint(gm, model, (x,), (torch.randn_like(x),), fn=compiled)
        print("PASSES RAN")
    """)
    assert "PASSES RAN" in result.stdout, result.stderr[-3000:]


def test_a_suite_run_without_hypothesis_names_the_extra_before_any_test():
    result = _run(("hypothesis",), """
        import sys, pytest
        # Hypothesis's own pytest plugin would be absent with it (its entry point stays in this venv).
        # (assertion rewriting off: it would look up the absent package's modules to mark them.)
        sys.exit(pytest.main(["--assert=plain", "-p", "no:hypothesispytest", "--fp8-backend=reference", "-q", "-p", "no:cacheprovider",
                              "conformance/properties/test_provenance.py"]))
    """)
    assert result.returncode == 4, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    assert "pip install 'fp8conf[conformance]'" in result.stderr + result.stdout


def test_fp8conf_check_without_the_suite_names_the_extra():
    result = _run(("hypothesis",), """
        import sys
        from fp8conf.tools.cli import main
        sys.exit(main(["check", "--backend", "reference"]))
    """)
    assert result.returncode == 2 and "pip install 'fp8conf[conformance]'" in result.stderr, (result.returncode, result.stderr[-2000:])
