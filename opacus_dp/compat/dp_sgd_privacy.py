"""Opacus 0.x's script ``opacus.scripts.compute_dp_sgd_privacy``: ε of a DP-SGD run by RDP accounting.

``python -m opacus_dp.scripts.compute_dp_sgd_privacy -r 0.004 -n 1.1 -e 60 -d 1e-5`` (0.x's flags);
the richer calculator is ``python -m opacus_dp.cli``. ε is converted from RDP with Balle et al.
(2020), tighter than 0.x's conversion (see :mod:`opacus_dp.accountants.analysis.rdp`).
"""

import argparse
import math
from typing import List, Optional, Sequence, Tuple

from opacus_dp.accountants.analysis.rdp import DEFAULT_ALPHAS, compute_rdp, get_privacy_spent


def _report(sample_rate: float, noise_multiplier: float, steps: int, alphas, delta: float, eps, best) -> None:
    print(f"DP-SGD with\n\tsampling rate = {100 * sample_rate:.3g}%,\n\tnoise_multiplier = {noise_multiplier},"
          f"\n\titerated over {steps} steps,\nsatisfies differential privacy with\n\tepsilon = {eps:.3g},"
          f"\n\tdelta = {delta}.\nThe optimal alpha is {best}.")
    if best in (min(alphas), max(alphas)):
        print("The privacy estimate is likely to be improved by expanding the set of alpha orders.")


def compute_dp_sgd_privacy(sample_rate: float, noise_multiplier: float, epochs: int, delta: float,
                           alphas: Sequence[float] = DEFAULT_ALPHAS, verbose: bool = True) -> Tuple[float, float]:
    """``(ε, best order)`` of ``epochs · ⌈1/sample_rate⌉`` steps at ``(noise_multiplier, sample_rate)``;
    ``verbose`` prints a summary (as 0.x)."""
    if not 0 < sample_rate <= 1:
        raise ValueError(f"sample_rate must lie in (0, 1], got {sample_rate}")
    steps = int(epochs) * math.ceil(1 / sample_rate)
    alphas = list(alphas)
    rdp = compute_rdp(sample_rate, noise_multiplier, steps, alphas)
    eps, best = get_privacy_spent(alphas, rdp, delta)
    if verbose:
        _report(sample_rate, noise_multiplier, steps, alphas, delta, eps, best)
    return float(eps), float(best)


def main(argv: Optional[List[str]] = None) -> None:
    """The command line of Opacus 0.x's script (module doc)."""
    parser = argparse.ArgumentParser(description="RDP computation",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("-r", "--sample-rate", type=float, required=True,
                        help="probability of each example to be in a batch")
    parser.add_argument("-n", "--noise-multiplier", type=float, required=True, help="noise multiplier")
    parser.add_argument("-e", "--epochs", type=int, required=True, help="number of epochs")
    parser.add_argument("-d", "--delta", type=float, default=1e-5, help="target delta")
    parser.add_argument("-a", "--alphas", type=float, nargs="+", default=DEFAULT_ALPHAS, help="RDP orders")
    args = parser.parse_args(argv)
    compute_dp_sgd_privacy(args.sample_rate, args.noise_multiplier, args.epochs, args.delta, args.alphas)
