"""Missing datasets: a clear message (exit code 2) when the data is not where it was looked for."""

import sys
from contextlib import contextmanager
from typing import Sequence

MISSING_DATA_EXIT_CODE = 2


def missing_dataset(name: str, looked_for: Sequence[str], how_to_get: str) -> SystemExit:
    """Print where ``name`` was looked for and how to get it; return the SystemExit to raise."""
    lines = [f"error: the {name} dataset was not found. Looked for:"]
    lines += [f"  {path}" for path in looked_for]
    lines.append(how_to_get)
    print("\n".join(lines), file=sys.stderr)
    return SystemExit(MISSING_DATA_EXIT_CODE)


@contextmanager
def download_errors(name: str, source: str, *, enabled: bool):
    """A failed download (no network, a refused or corrupted transfer) ends in one line on
    stderr and exit code 2 instead of a traceback."""
    if not enabled:
        yield
        return
    try:
        yield
    except (OSError, RuntimeError) as error:
        reason = " ".join(str(getattr(error, "reason", None) or error).split())  # one line
        print(f"error: could not download {name} from {source} ({reason}); check the network "
              "connection, place the files under --data-root yourself, or try --synthetic",
              file=sys.stderr)
        raise SystemExit(MISSING_DATA_EXIT_CODE) from None
