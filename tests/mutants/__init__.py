"""Mutant backends: the reference with one deliberate defect each, to prove the suite bites."""
