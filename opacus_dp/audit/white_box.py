"""White-box canary audit: run the engine with canaries, score them, bound ε from below.

Pipeline (:func:`run_audit`): ``num_runs`` trainings with Dirac canaries (:mod:`runner`) →
per-canary log-likelihood-ratio scores (:mod:`scores`) → three lower bounds on ε at δ:

* ``gdp``: Nasr et al. 2023 — μ lower bound from Clopper–Pearson limits on FPR/FNR, converted
  to ε(δ). It refutes μ-GDP claims; it bounds ε itself when the mechanism's privacy curve is
  Gaussian, which full-batch DP-SGD's is (q = 1: μ = √T/σ exactly);
* ``plain``: the (ε, δ)-DP inequalities on the same limits — no assumption on the curve;
* ``one_run``: Steinke, Nasr & Jagielski 2023 — valid even for dependent canaries.

The first two treat the canaries as independent trials; for a correct engine they are (each
canary has its own coordinate, independent noise and independent Poisson draws).
The headline :attr:`AuditReport.epsilon_lower_bound` is ``gdp`` when q = 1, else ``plain``.
"""

from dataclasses import dataclass
from typing import Optional, Tuple, Union

import numpy as np
import torch

from opacus_dp.audit.claimed_model import model_thresholds
from opacus_dp.audit.config import AuditConfig
from opacus_dp.audit.correlated import MechanismRecord, correlated_scores
from opacus_dp.audit.one_run import OneRunBound, one_run_audit
from opacus_dp.audit.runner import ModelWrapper, run_with_canaries
from opacus_dp.audit.scores import membership_scores
from opacus_dp.audit.statistics import gaussian_mechanism_mu, gdp_epsilon
from opacus_dp.audit.threshold_test import ErrorRateBound, threshold_audit

Threshold = Union[str, float, Tuple[float, float]]


@dataclass(frozen=True)
class AuditReport:
    """The accountant's ε next to the empirical lower bounds (each at ``config.confidence``)."""

    config: AuditConfig
    accountant_epsilon: float
    gaussian_epsilon: Optional[float]
    gdp: ErrorRateBound
    plain: ErrorRateBound
    one_run: OneRunBound
    gaussian_curve: bool = False  # a correlated mechanism whose groups are taken whole

    @property
    def headline_method(self) -> str:
        """"gdp" when every step is full-batch (a Gaussian mechanism; also a correlated
        mechanism whose group rate is 1), else "plain"."""
        return "gdp" if self.config.sample_rate == 1.0 or self.gaussian_curve else "plain"

    @property
    def epsilon_lower_bound(self) -> float:
        """The headline bound (see the module doc)."""
        return self.gdp.epsilon_gdp if self.headline_method == "gdp" else self.plain.epsilon_plain

    @property
    def violates_claim(self) -> bool:
        """True when the headline lower bound exceeds the accountant's ε: the claim is refuted."""
        return self.epsilon_lower_bound > self.accountant_epsilon


def _resolve_threshold(threshold, membership: np.ndarray, config: AuditConfig):
    if isinstance(threshold, str) and threshold == "model":
        return model_thresholds(
            noise_multiplier=config.noise_multiplier, sample_rate=config.sample_rate,
            steps=config.steps, negatives=int((~membership).sum()), positives=int(membership.sum()),
            delta=config.delta, confidence=config.confidence)
    return threshold


def analyse(observations, membership, *, config: AuditConfig, accountant_epsilon: float,
            threshold: Threshold = "model", mechanism: Optional[MechanismRecord] = None,
            groups=None) -> AuditReport:
    """Bounds from ``(T, m)`` observations and ``(m,)`` membership (see the module doc).

    ``threshold``: "model" (chosen in advance from the claimed mechanism, see
    :mod:`claimed_model`), "split" or fixed values (see :func:`threshold_audit`). With a
    correlated ``mechanism`` (and the canaries' ``groups``) the scores are those of
    :mod:`~opacus_dp.audit.correlated` and "model" means "split".
    """
    if mechanism is None:
        scores = membership_scores(observations, noise_multiplier=config.noise_multiplier,
                                   sample_rate=config.sample_rate)
    else:
        scores = correlated_scores(observations, groups, record=mechanism, noise_multiplier=config.noise_multiplier)
        threshold = "split" if isinstance(threshold, str) else threshold
    membership = np.asarray(torch.as_tensor(membership).cpu(), dtype=bool)
    threshold = _resolve_threshold(threshold, membership, config)
    gdp, plain = threshold_audit(scores, membership, delta=config.delta,
                                 confidence=config.confidence, threshold=threshold)
    one_run = one_run_audit(scores, membership, delta=config.delta, confidence=config.confidence)
    gaussian = None
    if config.sample_rate == 1.0:
        mu = gaussian_mechanism_mu(noise_multiplier=config.noise_multiplier, steps=config.steps)
        gaussian = gdp_epsilon(mu, config.delta) if config.delta > 0 else float("inf")
    whole_groups = mechanism is not None and mechanism.group_rate == 1.0
    return AuditReport(config, float(accountant_epsilon), gaussian, gdp, plain, one_run, whole_groups)


def run_audit(config: AuditConfig, model_wrapper: Optional[ModelWrapper] = None,
              threshold: Threshold = "model") -> AuditReport:
    """Train ``config.num_runs`` times with canaries through the engine and analyse the runs.

    The runs are configured alike, so their privacy histories must agree (checked); the
    accountant's ε is computed from the first.
    """
    records = [run_with_canaries(config, run, model_wrapper, report_epsilon=run == 0)
               for run in range(config.num_runs)]
    history = records[0].privacy_history
    steps = sum(entry[2] for entry in history)
    if steps != config.steps or any(r.privacy_history != history for r in records):
        raise RuntimeError(f"the accountant recorded {[r.privacy_history for r in records]} for "
                           f"{config.steps} trained steps: the privacy history is inconsistent")
    observations = torch.cat([r.observations for r in records], dim=1)
    membership = torch.cat([r.membership for r in records])
    groups = None if records[0].mechanism is None else torch.cat([r.canary_groups for r in records])
    return analyse(observations, membership, config=config, accountant_epsilon=records[0].accountant_epsilon,
                   threshold=threshold, mechanism=records[0].mechanism, groups=groups)
