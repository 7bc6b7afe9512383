"""Package version (single source of truth, read by setup.py)."""

__version__ = "0.1.0"
