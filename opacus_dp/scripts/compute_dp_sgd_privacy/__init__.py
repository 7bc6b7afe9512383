"""Opacus 0.x's import path ``opacus.scripts.compute_dp_sgd_privacy`` (re-exports only): ε of a
DP-SGD run by RDP accounting (:mod:`opacus_dp.compat.dp_sgd_privacy`).

``python -m opacus_dp.scripts.compute_dp_sgd_privacy -r 0.004 -n 1.1 -e 60 -d 1e-5`` (0.x's flags).
"""

from opacus_dp.compat.dp_sgd_privacy import compute_dp_sgd_privacy, main

__all__ = ["compute_dp_sgd_privacy", "main"]
