import sys
from pathlib import Path

# The mutant backends live in tests/mutants and are loaded by name (mutants.backends:Class).
sys.path.insert(0, str(Path(__file__).resolve().parent))
