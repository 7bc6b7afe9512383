#!/usr/bin/env python
"""Empirical privacy audit of the DP-SGD engine (same as ``python -m opacus_dp.audit``).

Example (full-batch DP-SGD, accountant epsilon about 3.9 at delta=1e-5):

    python scripts/audit.py --noise-multiplier 2.2 --steps 4 --canaries-per-run 1000 --runs 4

prints the accountant's epsilon next to the empirical lower bounds and their confidence.
"""

import sys

from opacus_dp.audit.cli import main

if __name__ == "__main__":
    sys.exit(main())
