"""On-disk cache of optimised strategies, keyed by their configuration.

One JSON file per configuration, named by the SHA-256 of the canonical JSON of the key, under
``cache_dir``, else ``$OPACUS_DP_CACHE_DIR``, else ``~/.cache/opacus_dp/strategies`` (the
user cache directory; ``$XDG_CACHE_HOME`` is honoured). A file that cannot be read or does
not hold the same key counts as absent; a directory that cannot be written is skipped.
"""

import hashlib
import json
import os
from typing import Optional

VERSION = 1  # bump when the optimisation changes, so old results are not reused


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
    return entry.get("value") if entry.get("key") == {"version": VERSION, **key} else None


def store(key: dict, value: dict, cache_dir: Optional[str] = None) -> None:
    """Write ``value`` for ``key`` (atomically: a temporary file renamed into place)."""
    path = _path(key, cache_dir)
    if os.path.exists(path):
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temporary = f"{path}.{os.getpid()}.tmp"
        with open(temporary, "w") as handle:
            json.dump({"key": {"version": VERSION, **key}, "value": value}, handle)
        os.replace(temporary, path)
    except OSError:
        return
