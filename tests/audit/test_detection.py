"""Detection figure: deliberately broken engines are flagged (lower bound > claimed ε).

The breakages are installed here only, with ``monkeypatch``, on the real engine code:

* the noise std is divided by √2 (the engine still claims σ): true μ = √2·√T/σ;
* clipping is skipped for the first example of every batch (an off-by-one in the clipper);
  each run has a single canary, stored first, so it escapes clipping whenever it is sampled
  and its gradient (norm 4·C) enters the sum whole.
"""

import math

import pytest
import torch

from opacus_dp.audit import AuditConfig, run_audit
from opacus_dp.optim import dp_optimizer
from opacus_dp.optim.clipping import FlatClipper
from tests.audit.configurations import assert_never_above_the_accountant

HALF_NOISE = dict(noise_multiplier=2.2, steps=4, canaries_per_run=1000, num_runs=2, seed=41)
ONE_CANARY_PER_RUN = dict(noise_multiplier=1.1, steps=1, canaries_per_run=1, num_runs=150,
                          num_background=7, seed=42)


def _noise_divided_by_sqrt2(monkeypatch):
    honest = dp_optimizer.noise_std
    monkeypatch.setattr(dp_optimizer, "noise_std", lambda sigma, clipper: honest(sigma, clipper) / math.sqrt(2))


def _first_example_unclipped(monkeypatch):
    honest = FlatClipper.clip_factors

    def clip_factors(self, per_param_norms):
        factors = [f.clone() for f in honest(self, per_param_norms)]
        for factor in factors:
            if factor.numel():
                factor[0] = 1.0
        return factors

    monkeypatch.setattr(FlatClipper, "clip_factors", clip_factors)


@pytest.mark.slow
@pytest.mark.parametrize("config,breakage", [
    (HALF_NOISE, _noise_divided_by_sqrt2),
    (ONE_CANARY_PER_RUN, _first_example_unclipped),
], ids=["noise divided by sqrt(2)", "first example unclipped"])
def test_broken_engine_is_flagged_and_honest_engine_is_not(config, breakage, monkeypatch):
    honest = run_audit(AuditConfig(**config))
    assert_never_above_the_accountant(honest)
    breakage(monkeypatch)
    broken = run_audit(AuditConfig(**config))
    assert broken.accountant_epsilon == honest.accountant_epsilon  # the claim is unchanged
    assert broken.violates_claim, broken
    assert broken.epsilon_lower_bound > broken.accountant_epsilon


def test_clipper_breakage_really_skips_one_example(monkeypatch):
    _first_example_unclipped(monkeypatch)
    factors = FlatClipper(1.0).clip_factors([torch.tensor([5.0, 5.0, 0.5])])[0]
    torch.testing.assert_close(factors, torch.tensor([1.0, 1.0 / (5.0 + 1e-6), 1.0]))
