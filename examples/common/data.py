"""Missing datasets: a clear message (exit code 2) when the data is not where it was looked for."""

import sys
from typing import Sequence

MISSING_DATA_EXIT_CODE = 2


def missing_dataset(name: str, looked_for: Sequence[str], how_to_get: str) -> SystemExit:
    """Print where ``name`` was looked for and how to get it; return the SystemExit to raise."""
    lines = [f"error: the {name} dataset was not found. Looked for:"]
    lines += [f"  {path}" for path in looked_for]
    lines.append(how_to_get)
    print("\n".join(lines), file=sys.stderr)
    return SystemExit(MISSING_DATA_EXIT_CODE)
