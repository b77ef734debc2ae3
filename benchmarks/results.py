"""Appending a measured table to ``benchmarks/RESULTS.md`` with its date and conditions."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


def append(benchmark: str, conditions: str, table: str) -> None:
    """Add a section ``## <benchmark>, <today>`` holding ``conditions`` and ``table``."""
    with open(RESULTS, "a", encoding="utf-8") as f:
        f.write(f"\n## {benchmark}, {datetime.date.today()}\n\n{conditions}\n\n{table}\n")


def jsonl_arguments(parser, what: str = "row") -> None:
    """``--jsonl FILE`` (keep each measured ``what`` as it comes) and ``--from-jsonl FILE ...``
    (measure nothing, tabulate what was kept), for benchmarks measured in parts."""
    parser.add_argument("--jsonl", help=f"append each {what} to this file as it is measured")
    parser.add_argument("--from-jsonl", nargs="+", metavar="FILE", help=f"measure nothing: tabulate {what}s saved by --jsonl")


def read_jsonl(paths) -> list[dict]:
    return [json.loads(line) for path in paths for line in Path(path).read_text().splitlines() if line.strip()]


def append_jsonl(path: str | None, row: dict) -> None:
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
