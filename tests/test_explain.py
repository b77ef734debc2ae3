"""The region map: every region in the table, incomplete ones marked with their reason."""

from __future__ import annotations

import pytest

import fp8conf
from conformance.draw.models import LayerSpec, ModelSpec, build_model
from conformance.judge.rewrites import rebuild_without_meta
from fp8conf.tools.cli import main
from fp8conf.tools.explain import render_region_map


def test_map_lists_regions_and_marks_incomplete_ones():
    model, args = build_model(ModelSpec(32, (LayerSpec(32, "tensorwise"), LayerSpec(16, "rowwise"))))
    gm = fp8conf.trace_joint(model, args)
    cast = next(n for n in gm.graph.nodes if fp8conf.classify_node(n) is fp8conf.OpRole.CAST)
    rebuild_without_meta(gm, cast)
    regions = fp8conf.identify_fp8_regions(gm)
    page = render_region_map(gm, regions)
    assert page.startswith("<!doctype html>") and "<script" not in page
    for region in regions:
        assert region.id in page
    broken = [r for r in regions if not r.complete]
    assert len(broken) == 1 and "incomplete" in page and broken[0].reason.split(":")[0] in page
    assert page.count('class="c') == sum(1 for n in gm.graph.nodes if n.op == "call_function")


def test_cli_writes_the_example_map(tmp_path, capsys):
    out = tmp_path / "map.html"
    assert main(["explain", "--out", str(out)]) == 0
    assert "24 FP8 regions, 24 complete" in capsys.readouterr().out
    assert "blocks.5.down" in out.read_text()


def test_cli_names_a_bad_factory(capsys):
    assert main(["explain", "no.such.module:make"]) == 2
    assert "cannot load 'no.such.module:make'" in capsys.readouterr().err


FACTORIES = '''
def raises():
    raise RuntimeError("no weights\\nhere")

def wrong():
    return 3

def needs(width, depth=2):
    return None

not_a_function = 7
'''


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("badfactories:raises", "'badfactories:raises' raised RuntimeError: no weights here"),
        ("badfactories:wrong", "'badfactories:wrong' returned int; it must return (model, args)"),
        ("badfactories:needs", "'badfactories:needs' needs arguments (width, depth=2); give a function taking none"),
        ("badfactories:not_a_function", "'badfactories:not_a_function' is int, not a function"),
        ("badfactories", "cannot load 'badfactories' (AttributeError"),
    ],
)
def test_cli_reports_a_bad_factory_in_one_line(tmp_path, monkeypatch, capsys, spec, message):
    (tmp_path / "badfactories.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["explain", spec, "--out", str(tmp_path / "map.html")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fp8conf explain: ") and message in err and err.count("\n") == 1


def test_cli_reports_a_missing_out_folder(tmp_path, capsys):
    out = tmp_path / "missing" / "map.html"
    assert main(["explain", "--out", str(out)]) == 2
    assert capsys.readouterr().err == f"fp8conf explain: --out {out}: folder {out.parent} does not exist\n"


@pytest.mark.parametrize("args", [["--help"], ["check", "--help"]])
def test_help_answers_without_importing_torch(args):
    import subprocess
    import sys

    code = (
        "import sys\nfrom fp8conf.tools.cli import main\ntry:\n    main(sys.argv[1:])\n"
        "except SystemExit:\n    pass\nprint('torch imported' if 'torch' in sys.modules else 'no torch')"
    )
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True)
    assert done.stdout.rstrip().endswith("no torch")
    assert "examples:" in done.stdout and "fp8conf check --backend" in done.stdout
