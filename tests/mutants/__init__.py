"""Mutant backends: the reference with one deliberate defect each, to prove the suite bites."""

#: The user property each mutant's test records: ``(area, caught)``.
POWER_KEY = "fp8conf_mutant_power"


def area_of(property_id: str) -> str:
    return property_id.rsplit("-", 1)[0]


def power_table(outcomes) -> str:
    """Markdown: per area, the mutants its properties caught out of those run against them."""
    counts: dict[str, list[int]] = {}
    for area, caught in outcomes:
        tally = counts.setdefault(area, [0, 0])
        tally[0] += bool(caught)
        tally[1] += 1
    rows = [f"| {area} | {caught} / {total} |" for area, (caught, total) in sorted(counts.items())]
    caught, total = sum(c for c, _ in counts.values()), sum(t for _, t in counts.values())
    return "\n".join(["| area | mutants caught / total |", "|---|---|", *rows, f"| all | {caught} / {total} |"])
