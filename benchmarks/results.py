"""Appending a measured table to ``benchmarks/RESULTS.md`` with its date and conditions."""

from __future__ import annotations

import datetime
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


def append(benchmark: str, conditions: str, table: str) -> None:
    """Add a section ``## <benchmark>, <today>`` holding ``conditions`` and ``table``."""
    with open(RESULTS, "a", encoding="utf-8") as f:
        f.write(f"\n## {benchmark}, {datetime.date.today()}\n\n{conditions}\n\n{table}\n")
