"""The suite depends on its own contract, not on fp8conf.

Outside ``conformance/backends/`` (the adapters, which may wrap any implementation) no module of
``conformance`` imports fp8conf, not even lazily inside a function; and the contract,
``conformance.api``, re-exported by ``conformance``, imports neither torch nor fp8conf nor the
test machinery, so a backend author can import it anywhere.

The other way round, fp8conf imports nothing of the suite: what both need (the contract's errors,
types and spec, and two standard-library helpers) is fp8contract, a leaf both import. The suite's
folders follow its pipeline (draw, run, observe, judge, report), with few loose modules left at
its top, no cycles between its stages, and its plugin imported by nobody else.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFORMANCE = ROOT / "conformance"


def _fp8conf_imports(path: Path, root: Path = ROOT) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            if name == "fp8conf" or name.startswith("fp8conf."):
                found.append(f"{path.relative_to(root)}:{node.lineno}: imports {name}")
    return found


def test_the_suite_outside_its_backends_never_imports_fp8conf():
    scanned = [p for p in sorted(CONFORMANCE.rglob("*.py")) if "backends" not in p.relative_to(CONFORMANCE).parts]
    assert len(scanned) > 10, scanned  # the scan sees the suite, not an empty directory
    found = [line for path in scanned for line in _fp8conf_imports(path)]
    assert not found, "conformance modules that import fp8conf (only conformance/backends/ may):\n" + "\n".join(found)


def test_the_scan_sees_lazy_imports(tmp_path):
    module = tmp_path / "lazy.py"
    module.write_text("import fp8config\n\ndef f():\n    from fp8conf.mx import MXLinear\n    import fp8conf.ops, os\n")
    assert _fp8conf_imports(module, tmp_path) == ["lazy.py:4: imports fp8conf.mx", "lazy.py:5: imports fp8conf.ops"]


_BLOCKED_IMPORT = textwrap.dedent(
    """
    import importlib.abc
    import sys

    BLOCKED = ("torch", "fp8conf", "hypothesis", "pytest")

    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{name} is blocked: the contract must not import it")
            return None

    sys.meta_path.insert(0, Blocker())
    import {module}
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not loaded, loaded
    print("imported", {module}.Backend.__name__, len({module}.__all__))
    """
)


def _import_blocked(module: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _BLOCKED_IMPORT.replace("{module}", module)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_the_contract_imports_without_torch_fp8conf_hypothesis_or_pytest():
    for module in ("conformance.api", "conformance"):
        proc = _import_blocked(module)
        assert proc.returncode == 0 and proc.stdout.startswith("imported Backend"), f"import {module}:\n{proc.stderr[-3000:]}"


def test_the_blocker_blocks():
    proc = _import_blocked("conformance.run.harness")
    assert proc.returncode != 0 and "is blocked" in proc.stderr, proc.stderr[-2000:]


# --- no import cycles, lazy imports included -------------------------------------------------


def _import_graph(root: Path, packages=("fp8conf", "fp8contract", "conformance")) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` it imports, at module level or inside a function
    (a lazy import hides a cycle from Python, not from a reader)."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                # A module importing its own package's __init__ (or a parent's) is no cycle edge.
                if target and target != name and not name.startswith(target + "."):
                    edges[name].add(target)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_round_a_cycle():
    edges = _import_graph(ROOT)
    assert len(edges) > 50 and any(edges.values()), "the scan sees the packages"
    cycles = _cycles(edges)
    assert not cycles, "import cycles (lazy imports count):\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_scan_sees_a_cycle_through_a_lazy_import(tmp_path):
    package = tmp_path / "fp8conf"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from fp8conf import b\n")
    (package / "b.py").write_text("def f():\n    from fp8conf.a import x\n")
    (package / "c.py").write_text("from . import a\n")
    assert _cycles(_import_graph(tmp_path, ("fp8conf",))) == [["fp8conf.a", "fp8conf.b"]]


# --- the pipeline stages know nothing of the compile engine ------------------------------------


def _imports_of_package(edges: dict[str, set[str]], importer: str, imported: str) -> list[str]:
    return sorted(
        f"{name} imports {target}"
        for name, targets in edges.items()
        if name == importer or name.startswith(importer + ".")
        for target in targets
        if target == imported or target.startswith(imported + ".")
    )


def test_the_pipeline_stages_never_import_the_compile_engine():
    # The engine (fp8conf.compile) takes the stages' results as arguments; a stage that reached
    # into it would let the layers run both ways again.
    edges = _import_graph(ROOT)
    assert "fp8conf.compile.joint" in edges and "fp8conf.graph.trace" in edges, "the scan sees both packages"
    assert _imports_of_package(edges, "fp8conf.compile", "fp8conf.graph"), "the engine is seen taking the stages' results"
    found = _imports_of_package(edges, "fp8conf.graph", "fp8conf.compile")
    assert not found, "pipeline stages that import the compile engine:\n" + "\n".join(found)


def test_artifacts_use_only_the_engines_entry_point():
    # Artifacts ask the engine through fp8conf.compile's own names, never through its modules.
    edges = _import_graph(ROOT)
    found = [line for line in _imports_of_package(edges, "fp8conf.artifacts", "fp8conf.compile")
             if not line.endswith(" imports fp8conf.compile")]
    assert not found, "artifact modules that reach inside the compile engine:\n" + "\n".join(found)


def test_the_layer_scan_sees_a_stage_importing_the_engine(tmp_path):
    package = tmp_path / "fp8conf"
    for sub in ("graph", "compile"):
        (package / sub).mkdir(parents=True)
        (package / sub / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "compile" / "joint.py").write_text("")
    (package / "graph" / "regions.py").write_text("def f():\n    from fp8conf.compile.joint import x\n")
    edges = _import_graph(tmp_path, ("fp8conf",))
    assert _imports_of_package(edges, "fp8conf.graph", "fp8conf.compile") == ["fp8conf.graph.regions imports fp8conf.compile.joint"]


# --- the library never imports the suite; both share fp8contract as a leaf --------------------

FP8CONF = ROOT / "fp8conf"
CONTRACT = ROOT / "fp8contract"
_IMPORTERS = ("import_module", "__import__", "find_spec", "import_plugin")


def _names_imported(path: Path) -> list[tuple[int, str]]:
    """Every module ``path`` imports (module level or lazily), and every string it hands to an
    importer (``importlib.import_module("x")``, ``__import__``, ``find_spec``) or that reads as a
    dotted module path of the suite (``"-p", "conformance.plugin"`` for pytest)."""
    found = []
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in _IMPORTERS and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            text = node.value.strip()
            if text.split(".")[0].split(":")[0] == "conformance" and text.replace(".", "").replace(":", "").replace("_", "").isalnum():
                found.append((node.lineno, text.partition(":")[0]))
    return sorted(set(found))


def _suite_imports(path: Path, root: Path = ROOT) -> list[str]:
    return [f"{path.relative_to(root)}:{line}: imports {name}" for line, name in _names_imported(path)
            if name == "conformance" or name.startswith("conformance.")]


def test_fp8conf_never_imports_the_suite():
    scanned = sorted(FP8CONF.rglob("*.py"))
    assert len(scanned) > 50, scanned
    found = [line for path in scanned for line in _suite_imports(path)]
    assert not found, "fp8conf modules that import the conformance suite (the contract is fp8contract):\n" + "\n".join(found)


def test_the_suite_import_scan_sees_lazy_and_string_imports(tmp_path):
    module = tmp_path / "tool.py"
    module.write_text(
        '"""conformance.plugin is named in a docstring only."""\n'
        "import importlib\n\n"
        "def f():\n    from conformance.api import Backend\n"
        "    importlib.import_module('conformance.run.harness')\n"
        "    return ['-p', 'conformance.plugin', 'the conformance suite']\n"
    )
    assert _suite_imports(module, tmp_path) == [
        "tool.py:5: imports conformance.api", "tool.py:6: imports conformance.run.harness", "tool.py:7: imports conformance.plugin",
    ]


def test_fp8contract_is_a_leaf():
    # It imports the standard library and itself only (rank processes import torch lazily, to
    # start torch's own process launcher): never fp8conf, the suite, pytest or Hypothesis.
    scanned = sorted(CONTRACT.rglob("*.py"))
    assert len(scanned) >= 4, scanned
    found = [f"{path.relative_to(ROOT)}:{line}: imports {name}" for path in scanned for line, name in _names_imported(path)
             if name.split(".")[0] in ("fp8conf", "conformance", "pytest", "hypothesis", "torchao")]
    assert not found, "fp8contract must import neither fp8conf nor the suite:\n" + "\n".join(found)
    proc = subprocess.run(
        [sys.executable, "-c", _BLOCKED_IMPORT.split("import {module}")[0].replace('"fp8conf",', '"fp8conf", "conformance",')
         + "import fp8contract, fp8contract.errors, fp8contract.types, fp8contract.spec, fp8contract.writing, fp8contract.rank_processes\n"
         + "loaded = sorted(m for m in sys.modules if m.split('.')[0] in BLOCKED)\nassert not loaded, loaded\n"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_conformance_api_reexports_the_contract_unchanged():
    import fp8contract.errors
    import fp8contract.spec
    import fp8contract.types

    import conformance
    import conformance.api
    import fp8conf.errors

    for leaf in (fp8contract.errors, fp8contract.types, fp8contract.spec):
        suite = __import__(f"conformance.api.{leaf.__name__.rpartition('.')[2]}", fromlist=["_"])
        assert list(suite.__all__) == list(leaf.__all__)
        for name in leaf.__all__:
            assert getattr(suite, name) is getattr(leaf, name), name
            if name in conformance.api.__all__:
                assert getattr(conformance.api, name) is getattr(leaf, name) is getattr(conformance, name), name
    # fp8conf's errors subclass the very classes a backend's adapter and the suite catch.
    assert issubclass(fp8conf.errors.FP8ValidationError, conformance.api.ValidationFailure)


# --- conformance/ by role: few loose modules, the plugin imported by nobody else ---------------

#: Old top-level paths kept as deprecated aliases of the modules now under draw/.
SHIMS = {"models": "conformance.draw.models", "moe": "conformance.draw.moe", "families": "conformance.draw.families",
         "e8m0": "conformance.draw.e8m0", "strategies": "conformance.draw.strategies"}
PLUGIN_SHIMS = {"gating": "conformance.run.gating", "loading": "conformance.run.loading"}


def test_conformance_has_few_loose_modules():
    # The suite's folders show its pipeline (draw, run, observe, judge, report); what stays loose at
    # the top is the package's __init__ and the deprecated aliases of moved modules.
    loose = sorted(p.name for p in CONFORMANCE.glob("*.py"))
    assert len(loose) <= 6, f"{len(loose)} loose modules at conformance/'s top level: {loose}"
    stages = {p.name for p in CONFORMANCE.iterdir() if (p / "__init__.py").is_file()}
    assert {"api", "backends", "draw", "run", "observe", "judge", "report", "plugin"} <= stages, stages


def test_nothing_outside_the_plugin_imports_it():
    plugin = CONFORMANCE / "plugin"
    scanned = [p for root in (CONFORMANCE, FP8CONF, CONTRACT) for p in sorted(root.rglob("*.py")) if plugin not in p.parents]
    assert len(scanned) > 100, len(scanned)
    found = [f"{path.relative_to(ROOT)}:{line}: imports {name}" for path in scanned for line, name in _names_imported(path)
             if name == "conformance.plugin" or name.startswith("conformance.plugin.")]
    assert not found, "modules outside conformance/plugin that import it:\n" + "\n".join(found)


def test_no_import_cycles_between_the_suites_stages():
    # Stage by stage (api, draw, run, observe, judge, report, plugin, ...), not only module by
    # module: the stages import one another one way only.
    edges = _import_graph(ROOT)
    stages: dict[str, set[str]] = {}
    for name, targets in edges.items():
        if not name.startswith("conformance.") or name.count(".") < 2:
            continue
        stage = ".".join(name.split(".")[:2])
        for target in targets:
            other = ".".join(target.split(".")[:2])
            if target.startswith("conformance.") and target.count(".") >= 1 and other != stage:
                stages.setdefault(stage, set()).add(other)
        stages.setdefault(stage, set())
    for targets in stages.values():
        targets &= set(stages)
    assert {"conformance.draw", "conformance.run", "conformance.judge"} <= set(stages), sorted(stages)
    cycles = _cycles(stages)
    assert not cycles, "cycles between the suite's stages:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_moved_modules_keep_their_old_paths_with_a_warning():
    lines = [f"import importlib, warnings\nwarnings.simplefilter('always')\n"]
    for old, new in [(f"conformance.{k}", v) for k, v in SHIMS.items()] + [(f"conformance.plugin.{k}", v) for k, v in PLUGIN_SHIMS.items()]:
        lines.append(
            f"with warnings.catch_warnings(record=True) as seen:\n"
            f"    old = importlib.import_module({old!r})\n"
            f"assert old is importlib.import_module({new!r}), {old!r}\n"
            f"assert [w for w in seen if issubclass(w.category, DeprecationWarning) and {new!r} in str(w.message)], {old!r}\n"
        )
    lines.append("from conformance.models import *\nassert callable(build_model) and ModelSpec.__module__ == 'conformance.draw.models'\nprint('ok')\n")
    proc = subprocess.run([sys.executable, "-c", "".join(lines)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
    assert {p.stem for p in CONFORMANCE.glob("*.py")} - {"__init__"} == set(SHIMS)
