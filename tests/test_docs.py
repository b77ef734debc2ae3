"""What the README and the guides in ``docs/`` say exists, exists.

* every relative link of ``README.md`` and ``docs/**/*.md`` names a file of the repository, and
  an ``#anchor`` in it a heading of the Markdown file it names;
* every ``fp8conf <subcommand>`` they show, and each ``--option`` given to it, is in the
  command's argparse parser (``fp8conf/tools/cli.py``);
* every ``--fp8-*`` pytest option they name is one the plugin adds (``pytest_addoption``);
* the ``python`` snippets of the passes guide run, in order, in one namespace (``py`` blocks
  are shown only: they compile, start processes or need a GPU);
* the results table of ``docs/performance.md`` is what ``benchmarks/results_table.py`` writes
  from the benchmarks' JSONL files now.

Everything here reads files and parsers; only the passes guide's snippets run torch (a few
seconds on CPU).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
_LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^ *```.*?^ *```", re.DOTALL | re.MULTILINE)
_INLINE_CODE = re.compile(r"`[^`\n]+`")


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks (links there are code, not links)."""
    return _FENCE.sub("", text)


def _slug(heading: str) -> str:
    """The anchor of a heading, as GitHub and MkDocs make it (lower case, punctuation dropped,
    spaces to hyphens)."""
    text = re.sub(r"`|\*\*|\*|_(?=\w)|(?<=\w)_|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading)
    text = unicodedata.normalize("NFKD", text).lower()
    text = re.sub(r"[^\w\s-]", "", text)
    return re.sub(r"[\s]+", "-", text.strip())


def _anchors(page: Path) -> set[str]:
    headings = re.findall(r"^#{1,6} +(.+?) *#*$", _prose(page.read_text(encoding="utf-8")), re.MULTILINE)
    return {_slug(h) for h in headings}


def _links(page: Path) -> list[str]:
    text = _INLINE_CODE.sub("", _prose(page.read_text(encoding="utf-8")))
    return [a or b for a, b in _LINK.findall(text)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in _links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        named = (page.parent / path).resolve() if path else page
        if not named.exists():
            broken.append(f"{target}: no file {named.relative_to(ROOT) if named.is_relative_to(ROOT) else named}")
        elif anchor and named.suffix == ".md" and anchor not in _anchors(named):
            broken.append(f"{target}: no heading #{anchor} in {named.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_the_link_check_sees_links_and_anchors():
    assert _slug("6. Options, profiles and how long a verdict takes") == "6-options-profiles-and-how-long-a-verdict-takes"
    assert _slug("`fp8conf doctor`") == "fp8conf-doctor"
    assert _slug("Exit status of `fp8conf precompile`") == "exit-status-of-fp8conf-precompile"
    assert _links(ROOT / "README.md"), "the README links its guides"


# -- commands and options -------------------------------------------------------------------

def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


def _cli() -> argparse.ArgumentParser:
    from fp8conf.tools.cli import _parser

    return _parser()


#: A line or code span that is an ``fp8conf`` command (after environment assignments, if any),
#: and the words after ``fp8conf``.
_COMMAND = re.compile(r"^\s*(?:\$ )?(?:[A-Z_][A-Z0-9_]*=\S* +)*fp8conf((?: +[^ ]+)+)")
#: Words that end a command in a line: a pipe, a comment, an alternative.
_ENDS = {"|", "||", "&&", ";", "or", "#"}


def _documented_commands() -> list[tuple[str, list[str]]]:
    """``(page, words after 'fp8conf')`` of every ``fp8conf <subcommand> ...`` in the code spans
    and code blocks of the pages."""
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        snippets = [m.group(0).strip("`") for m in _INLINE_CODE.finditer(_prose(text))]
        snippets += [line for block in _FENCE.findall(text) for line in block.splitlines()]
        for snippet in snippets:
            for match in _COMMAND.finditer(snippet.strip()):
                words = []
                for word in match.group(1).split():
                    if word in _ENDS or word.startswith("#"):
                        break
                    words.append(word.strip("()[]"))
                found.append((str(page.relative_to(ROOT)), words))
    return found


def test_every_documented_fp8conf_command_and_option_exists():
    commands = _subparsers(_cli())
    unknown = []
    seen = set()
    for page, words in _documented_commands():
        name = words[0]
        if name not in commands:
            unknown.append(f"{page}: fp8conf {' '.join(words)}: {name!r} is no subcommand")
            continue
        parser, rest = commands[name], words[1:]
        nested = _subparsers(parser)
        if nested and rest and not rest[0].startswith("-"):
            if rest[0] not in nested:
                unknown.append(f"{page}: fp8conf {' '.join(words)}: {rest[0]!r} is no subcommand of fp8conf {name}")
                continue
            parser, rest = nested[rest[0]], rest[1:]
        if "--" in rest:
            rest = rest[: rest.index("--")]  # pytest's own options follow
        for word in rest:
            option = word.split("=")[0]
            if option.startswith("-") and option not in _options(parser):
                unknown.append(f"{page}: fp8conf {' '.join(words)}: {option} is not an option of {parser.prog!r}")
        seen.add(name)
    assert not unknown, "\n".join(unknown)
    assert {"check", "precompile", "explain", "doctor"} <= seen, seen


def _plugin_options() -> set[str]:
    import pytest as _pytest

    from conformance.plugin.hooks import pytest_addoption

    parser = _pytest.Parser(processopt=lambda option: None)
    pytest_addoption(parser)
    return {name for group in parser._groups for option in group.options for name in option.names()}


def test_every_documented_fp8_pytest_option_exists():
    options = _plugin_options()
    assert "--fp8-backend" in options, options
    unknown = []
    for page in PAGES:
        for option in sorted(set(re.findall(r"--fp8-[a-z][a-z0-9-]*", page.read_text(encoding="utf-8")))):
            if option not in options:
                unknown.append(f"{page.relative_to(ROOT)}: {option}")
    assert not unknown, "not options of the plugin:\n" + "\n".join(unknown)


# -- the passes guide's snippets ------------------------------------------------------------

def test_the_passes_guide_snippets_run():
    text = (ROOT / "docs" / "passes.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.DOTALL | re.MULTILINE)
    assert len(blocks) >= 5, "the passes guide shows each stage as a snippet that runs"
    namespace: dict = {"__name__": "passes_guide"}
    for number, block in enumerate(blocks, 1):
        code = compile(block, f"docs/passes.md, python block {number}", "exec")
        exec(code, namespace)  # noqa: S102 - the guide's own code, run as a reader would


# -- the results table ----------------------------------------------------------------------

def _results_table():
    spec = importlib.util.spec_from_file_location("results_table", ROOT / "benchmarks" / "results_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_results_table_is_current():
    results_table = _results_table()
    text = results_table.PERFORMANCE.read_text(encoding="utf-8")
    rows = results_table.goals()
    assert rows, "no goal has a figure"
    assert results_table.render(text, rows) == text, (
        "docs/performance.md's results table is not what the benchmarks' JSONL files give now: "
        "run python benchmarks/results_table.py"
    )
    for row in rows:
        assert all(row[k] for k in ("goal", "bound", "figure", "verdict", "date", "commit", "device", "torch", "command")), row


def test_the_results_table_regenerates_idempotently():
    results_table = _results_table()
    text = results_table.PERFORMANCE.read_text(encoding="utf-8")
    once = results_table.render(text, results_table.goals())
    assert results_table.render(once, results_table.goals()) == once


def test_depth_goals_keep_dense_and_experts_models_apart(tmp_path):
    """A dense and an experts model of one recipe on one device are different models: each gets
    its own goals, the experts' named so and with the command that measures them."""
    results_table = _results_table()
    common = {"path": "fp8conf regional", "recipe": "rowwise", "device": "cpu", "dim": 64, "heads": 4, "vocab": 256,
              "tokens": 256, "environment": "2-core CPU, torch 2.13.0+cpu", "date": "2026-12-07", "commit": "abc1234"}
    rows = [dict(common, blocks=2, first_step_s=10.0), dict(common, blocks=32, first_step_s=20.0),
            dict(common, blocks=2, first_step_s=30.0, ffn="experts", experts=4, top_k=2),
            dict(common, blocks=32, first_step_s=120.0, ffn="experts", experts=4, top_k=2)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    found = {g["goal"]: g for g in results_table.depth_goals(path)}
    dense = found["fp8conf regional first step against depth: fitted exponent (rowwise, cpu)"]
    experts = found["fp8conf regional first step against depth: fitted exponent (rowwise, experts, cpu)"]
    assert dense["figure"].startswith("0.25") and experts["figure"].startswith("0.50")
    assert "--ffn" not in dense["command"] and experts["command"].endswith("--ffn experts --experts 4 --top-k 2")


def test_depth_goals_compare_rows_of_one_host_only(tmp_path):
    """Two hosts of one GPU model differ by 1.4x: a row of one is never divided by a row of the
    other, and the latest host's goals come first."""
    results_table = _results_table()
    common = {"recipe": "tensorwise", "device": "cuda", "dim": 256, "heads": 16, "vocab": 2048, "tokens": 2048,
              "environment": "NVIDIA H100 80GB HBM3, torch 2.11.0+cu130", "date": "2026-12-07", "commit": "abc1234"}
    nested = "torch.compile + nested_compile_region"
    rows = [dict(common, path="fp8conf regional", blocks=32, first_step_s=20.0, step_s=0.05, host="a"),
            dict(common, path=nested, blocks=32, first_step_s=100.0, step_s=0.05, host="a"),
            dict(common, path="fp8conf regional", blocks=32, first_step_s=30.0, step_s=0.11, host="b"),
            dict(common, path="torch.compile", blocks=32, first_step_s=160.0, step_s=0.08, host="b")]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    goals = results_table.depth_goals(path)
    versus_nested = [g for g in goals if g["goal"].startswith("fp8conf regional first step vs torch.compile + nested")]
    assert [(g["figure"], g["device"]) for g in versus_nested] == [("0.20 at 32 blocks", "NVIDIA H100 80GB HBM3 (a)")]
    steady = [g for g in goals if "steady step time vs torch.compile (" in g["goal"]]
    assert [(g["figure"], g["device"]) for g in steady] == [("1.38 at 32 blocks", "NVIDIA H100 80GB HBM3 (b)")]
    assert goals[0]["device"].endswith("(b)")  # the latest host first
    # One host name on another day may be another machine: its rows are not compared either.
    rows[1]["date"] = "2026-12-08"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    assert not [g for g in results_table.depth_goals(path) if "nested_compile_region" in g["goal"] and "(a)" in g["device"]]
