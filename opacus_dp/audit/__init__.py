"""Empirical privacy auditing of DP-SGD: white-box canaries and lower bounds on ε.

:func:`run_audit` trains through the real engine with Dirac gradient canaries (Nasr et al.
2023, "Tight Auditing of Differentially Private Machine Learning") and returns an
:class:`AuditReport`: the accountant's ε next to high-confidence empirical lower bounds —
GDP-based and (ε, δ) bounds from Clopper–Pearson limits on the membership test's error
rates, and the one-run bound of Steinke, Nasr & Jagielski 2023 ("Privacy Auditing with One
(1) Training Run"). A lower bound above the accountant's ε refutes the privacy claim.
``AuditConfig(privacy_unit="user", ...)`` audits a user-level claim with canary users
(:mod:`~opacus_dp.audit.user_canaries`).
Command line: ``python -m opacus_dp.audit --help``. What this does and does not prove:
``docs/auditing.md``.
"""

from opacus_dp.audit.canaries import CanaryLayout, CanaryLoss, canary_dataset, canary_model
from opacus_dp.audit.claimed_model import model_thresholds
from opacus_dp.audit.config import AuditConfig
from opacus_dp.audit.one_run import OneRunBound, one_run_audit, one_run_epsilon_lower_bound
from opacus_dp.audit.report import format_report, report_to_dict
from opacus_dp.audit.runner import RunRecord, run_with_canaries
from opacus_dp.audit.scores import membership_scores
from opacus_dp.audit.statistics import (
    clopper_pearson_lower,
    clopper_pearson_upper,
    gdp_epsilon,
    mu_lower_bound,
    plain_epsilon_lower_bound,
)
from opacus_dp.audit.threshold_test import ErrorRateBound, threshold_audit
from opacus_dp.audit.user_canaries import UserCanaryDataset, user_canary_dataset
from opacus_dp.audit.white_box import AuditReport, analyse, run_audit

__all__ = [
    "AuditConfig",
    "AuditReport",
    "CanaryLayout",
    "CanaryLoss",
    "ErrorRateBound",
    "OneRunBound",
    "RunRecord",
    "UserCanaryDataset",
    "analyse",
    "canary_dataset",
    "canary_model",
    "clopper_pearson_lower",
    "clopper_pearson_upper",
    "format_report",
    "gdp_epsilon",
    "membership_scores",
    "model_thresholds",
    "mu_lower_bound",
    "one_run_audit",
    "one_run_epsilon_lower_bound",
    "plain_epsilon_lower_bound",
    "report_to_dict",
    "run_audit",
    "run_with_canaries",
    "threshold_audit",
    "user_canary_dataset",
]

from opacus_dp.submodules import submodule_getattr  # noqa: E402

__getattr__ = submodule_getattr(__name__)  # sub-modules as attributes, as in Opacus
