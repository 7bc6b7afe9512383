"""On-disk cache of optimised strategies, keyed by their configuration.

One JSON file per configuration, named by the SHA-256 of the canonical JSON of the key, under
``cache_dir``, else ``$OPACUS_DP_CACHE_DIR``, else ``~/.cache/opacus_dp/strategies`` (the
user cache directory; ``$XDG_CACHE_HOME`` is honoured). A file that cannot be read, does not
hold the same key (version included) or whose value is not a dict of lists of finite numbers
counts as absent; a directory that cannot be written is skipped. What a value means is checked
by its reader too (:func:`opacus_dp.mechanisms.strategy_validation.defect`), so an entry is never
trusted for being in the cache.
"""

import hashlib
import json
import math
import os
from typing import Optional

# Bump when the optimisation or the meaning of a value changes, so old results are not reused.
# 2: version 1 could store non-finite or unstable strategies (banded b = 2 beyond ~400 steps, BLT).
VERSION = 2


def cache_directory(cache_dir: Optional[str] = None) -> str:
    """The directory in use (module doc)."""
    if cache_dir is not None:
        return str(cache_dir)
    if os.environ.get("OPACUS_DP_CACHE_DIR"):
        return os.environ["OPACUS_DP_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "opacus_dp", "strategies")


def _path(key: dict, cache_dir: Optional[str]) -> str:
    text = json.dumps({"version": VERSION, **key}, sort_keys=True)
    return os.path.join(cache_directory(cache_dir), hashlib.sha256(text.encode()).hexdigest() + ".json")


def load(key: dict, cache_dir: Optional[str] = None) -> Optional[dict]:
    """The stored value for ``key``, or None."""
    try:
        with open(_path(key, cache_dir)) as handle:
            entry = json.load(handle)
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or entry.get("key") != {"version": VERSION, **key}:
        return None
    value = entry.get("value")
    return value if _well_formed(value) else None


def _well_formed(value) -> bool:
    """A non-empty dict of str → non-empty list of finite numbers (bool excluded)."""
    return isinstance(value, dict) and bool(value) and all(
        isinstance(name, str) and isinstance(numbers, list) and numbers
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in numbers)
        for name, numbers in value.items())


def store(key: dict, value: dict, cache_dir: Optional[str] = None) -> None:
    """Write ``value`` for ``key`` (atomically: a temporary file renamed into place), replacing
    an existing entry (the caller found it absent or invalid); a value :func:`load` would
    refuse is not written."""
    if not _well_formed(value):
        return
    path = _path(key, cache_dir)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temporary = f"{path}.{os.getpid()}.tmp"
        with open(temporary, "w") as handle:
            json.dump({"key": {"version": VERSION, **key}, "value": value}, handle)
        os.replace(temporary, path)
    except OSError:
        return
