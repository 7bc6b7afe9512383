#!/usr/bin/env python
"""Accountant figures next to Google dp-accounting and Opacus 1.6, computed in the same run.

Prints, for standard DP-SGD settings:
  * RDP: largest relative difference to Opacus's RDP (per order and in ε);
  * PRV: ε next to dp-accounting's PLD (pessimistic, grid 1e-4) and its optimistic estimate,
    and Opacus's PRV; the ratio to the PLD value;
  * GDP next to Opacus's GDP;
  * time for ε after 100 000 steps (RDP, PRV) and extreme settings (large ε, tiny δ, q = 1,
    σ = 0, q = 0) next to dp-accounting or the exact Gaussian mechanism.

Needs the test extras (``pip install -e .[test]``).  Usage: ``python scripts/benchmark_accountants.py``.
"""

import logging
import math
import time
import warnings

import numpy as np
from scipy import optimize, special

import dp_accounting
from dp_accounting import pld as dp_pld
from dp_accounting.pld import privacy_loss_distribution
from opacus.accountants import GaussianAccountant as OpacusGDP
from opacus.accountants import PRVAccountant as OpacusPRV
from opacus.accountants import RDPAccountant as OpacusRDP
from opacus.accountants.analysis import rdp as opacus_rdp

from opacus_dp.accountants import GaussianAccountant, PRVAccountant, RDPAccountant
from opacus_dp.accountants.analysis.rdp import DEFAULT_ALPHAS, compute_rdp
from opacus_dp.accountants.rdp import _rdp_per_step

SETTINGS = [  # (σ, q, steps, δ)
    (1.1, 256 / 60000, 14063, 1e-5),
    (1.0, 0.01, 1000, 1e-5),
    (0.8, 0.05, 100, 1e-6),
    (2.0, 0.001, 20000, 1e-6),
    (1.5, 0.01, 5000, 1e-5),
    (0.6, 0.1, 50, 1e-5),
]


def _timed(function):
    start = time.perf_counter()
    value = function()
    return value, time.perf_counter() - start


def ours(cls, segment, delta):
    accountant = cls()
    accountant.history = [segment]
    return accountant.get_epsilon(delta)


def theirs(cls, segment, delta):
    accountant = cls()
    accountant.history = [segment]
    return accountant.get_epsilon(delta=delta)


def pld_pessimistic(segment, delta):
    sigma, q, steps = segment
    accountant = dp_pld.PLDAccountant(
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, value_discretization_interval=1e-4
    )
    accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return accountant.get_epsilon(delta)


def pld_optimistic(segment, delta):
    sigma, q, steps = segment
    distribution = privacy_loss_distribution.from_gaussian_mechanism(
        sigma, sampling_prob=q, pessimistic_estimate=False, value_discretization_interval=1e-4, use_connect_dots=False
    )
    return distribution.self_compose(steps).get_epsilon_for_delta(delta)


def rdp_section():
    print("RDP vs Opacus 1.6 (default orders)")
    print(f"{'sigma':>6} {'q':>9} {'steps':>6} {'max rel diff RDP':>17} {'eps ours':>10} {'eps opacus':>10} {'rel diff':>9}")
    for sigma, q, steps, delta in SETTINGS:
        ours_rdp = compute_rdp(q, sigma, steps, DEFAULT_ALPHAS)
        ref_rdp = opacus_rdp.compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=DEFAULT_ALPHAS)
        rel = float(np.max(np.abs(ours_rdp - ref_rdp) / ref_rdp))
        eps, ref = ours(RDPAccountant, (sigma, q, steps), delta), theirs(OpacusRDP, (sigma, q, steps), delta)
        print(f"{sigma:6.2f} {q:9.6f} {steps:6d} {rel:17.2e} {eps:10.5f} {ref:10.5f} {abs(eps - ref) / ref:9.1e}")


def prv_section():
    print("\nPRV vs dp-accounting PLD (grid 1e-4) and Opacus 1.6 PRV")
    header = f"{'sigma':>6} {'q':>9} {'steps':>6} {'delta':>7} {'ours':>9} {'PLD':>9} {'ratio':>10} {'PLD low':>9} {'opacus':>9}"
    print(header + f" {'t ours':>7} {'t PLD':>7}")
    for sigma, q, steps, delta in SETTINGS:
        segment = (sigma, q, steps)
        eps, t_ours = _timed(lambda: ours(PRVAccountant, segment, delta))
        ref, t_ref = _timed(lambda: pld_pessimistic(segment, delta))
        low = pld_optimistic(segment, delta)
        opacus = theirs(OpacusPRV, segment, delta)
        print(
            f"{sigma:6.2f} {q:9.6f} {steps:6d} {delta:7.0e} {eps:9.5f} {ref:9.5f} {eps / ref:10.7f} "
            f"{low:9.5f} {opacus:9.5f} {t_ours:7.2f} {t_ref:7.2f}"
        )


def gdp_section():
    print("\nGDP (CLT approximation) vs Opacus 1.6 GDP")
    for sigma, q, steps, delta in SETTINGS[:3]:
        eps, ref = ours(GaussianAccountant, (sigma, q, steps), delta), theirs(OpacusGDP, (sigma, q, steps), delta)
        print(f"  sigma={sigma} q={q:.6f} steps={steps}: ours {eps:.6f}  opacus {ref:.6f}")


def _gaussian_epsilon(mu, delta):
    """Exact ε of the Gaussian mechanism with μ = √T/σ (the q = 1 case), by bisection."""
    def delta_of(eps):
        return special.ndtr(-eps / mu + mu / 2) - math.exp(eps + special.log_ndtr(-eps / mu - mu / 2))
    return optimize.brentq(lambda e: delta_of(e) - delta, 0.0, 10 * mu * mu + 50, xtol=1e-12)


def timing_and_extremes_section():
    print("\nTime for epsilon after 100 000 steps (sigma=1.1, q=256/60000, delta=1e-5), fresh caches")
    for name, cls in (("rdp", RDPAccountant), ("prv", PRVAccountant)):
        _rdp_per_step.cache_clear()
        eps, seconds = _timed(lambda: ours(cls, (1.1, 256 / 60000, 100_000), 1e-5))
        print(f"  {name}: eps = {eps:.5f} in {seconds:.3f} s")
    print("\nExtreme settings (reference: dp-accounting PLD, or the exact Gaussian mechanism when q = 1)")
    cases = [((0.3, 0.5, 10_000), 1e-5), ((1.1, 256 / 60000, 14063), 1e-12), ((0.7, 1e-4, 1_000_000), 1e-10),
             ((1.0, 1.0, 100), 1e-5), ((20.0, 1.0, 1000), 1e-12), ((0.0, 0.1, 10), 1e-5), ((1.0, 0.0, 10), 1e-5)]
    for segment, delta in cases:
        values = []
        for cls in (RDPAccountant, PRVAccountant):
            eps, seconds = _timed(lambda: ours(cls, segment, delta))
            values.append((eps, seconds))
        sigma, q, steps = segment
        if q == 1.0:
            reference = f"exact {_gaussian_epsilon(math.sqrt(steps) / sigma, delta):.6g}"
        elif sigma > 0 and q > 0:
            reference = f"PLD {pld_pessimistic(segment, delta):.6g}"
        else:
            reference = "exact " + ("inf" if q > 0 else "0")
        nan = any(math.isnan(eps) for eps, _ in values)
        print(f"  (sigma, q, steps)={segment}, delta={delta:g}: rdp {values[0][0]:.6g} ({values[0][1]:.2f} s), "
              f"prv {values[1][0]:.6g} ({values[1][1]:.2f} s), {reference}{'  NaN!' if nan else ''}")


def main():
    logging.getLogger().setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    rdp_section()
    prv_section()
    gdp_section()
    timing_and_extremes_section()


if __name__ == "__main__":
    main()
