"""What the README, the adopting guide and the packaging metadata state about the project agrees
with the code.

The adapter examples of the README and of ``docs/adopting.md`` are what a backend author copies;
a signature that drifts from :class:`conformance.Backend` sends them to write a method the suite
calls differently.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from pathlib import Path

import pytest

import conformance

ROOT = Path(__file__).resolve().parent.parent
_CODE_BLOCK = re.compile(r"```python\n(.*?)^ *```", re.DOTALL | re.MULTILINE)


#: The pages whose Python examples hold adapters.
_ADAPTER_PAGES = ("README.md", "docs/adopting.md")


def _adapter_methods(page: str) -> list[tuple[str, ast.FunctionDef]]:
    """Every method of a ``conformance.Backend`` subclass in ``page``'s Python examples."""
    found = []
    for block in _CODE_BLOCK.findall((ROOT / page).read_text(encoding="utf-8")):
        block = textwrap.dedent(block)  # a block under a list item is indented
        if "conformance.Backend)" not in block:
            continue
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ClassDef) and any(ast.unparse(b) == "conformance.Backend" for b in node.bases):
                found += [(node.name, item) for item in node.body if isinstance(item, ast.FunctionDef)]
    return found


def _of_example(func: ast.FunctionDef) -> list[tuple[str, str, str | None]]:
    args = func.args
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + [ast.unparse(d) for d in args.defaults]
    shape = [(a.arg, "positional", d) for a, d in zip(positional, defaults)]
    shape += [(a.arg, "keyword", None if d is None else ast.unparse(d)) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    return shape


def _of_contract(method) -> list[tuple[str, str, str | None]]:
    shape = []
    for p in inspect.signature(method).parameters.values():
        kind = "keyword" if p.kind is p.KEYWORD_ONLY else "positional"
        shape.append((p.name, kind, None if p.default is p.empty else repr(p.default)))
    return shape


@pytest.mark.parametrize("page", _ADAPTER_PAGES)
def test_the_documented_adapter_methods_take_the_contracts_parameters(page):
    methods = _adapter_methods(page)
    assert {"run_joint", "trace_joint", "validate"} <= {func.name for _, func in methods}, methods
    for cls, func in methods:
        contract = getattr(conformance.Backend, func.name, None)
        if contract is None:
            continue  # a helper of the example's own
        assert _of_example(func) == _of_contract(contract), (
            f"{page} {cls}.{func.name}({ast.unparse(func.args)}) differs from "
            f"conformance.Backend.{func.name}{inspect.signature(contract)}"
        )


def test_the_license_is_an_spdx_expression_setuptools_can_read():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    data = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert data["project"]["license"] == "BSD-3-Clause"
    # setuptools reads a license expression (PEP 639) from version 77 on.
    requirement = next(r for r in data["build-system"]["requires"] if r.startswith("setuptools"))
    minimum = re.fullmatch(r"setuptools>=(\d+)(\.\d+)*", requirement)
    assert minimum and int(minimum.group(1)) >= 77, requirement
