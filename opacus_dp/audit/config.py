"""What an audit runs: the DP-SGD configuration under test and the size of the canary experiment."""

import math
from dataclasses import dataclass
from typing import Optional

from opacus_dp.audit.canaries import CanaryLayout
from opacus_dp.audit.statistics import check_confidence, check_delta
from opacus_dp.audit.user_canaries import check_user_settings

APIS = ("modern", "classic")
ACCOUNTANTS = ("prv", "rdp", "gdp")
LOSS_REDUCTIONS = ("mean", "sum")
MECHANISMS = ("independent", "banded", "blt")  # opacus_dp.audit.correlated scores the last two


def _check_number(value, name: str, *, low: float, low_inclusive: bool, high: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if (value < low if low_inclusive else value <= low) or value > high:
        bracket = "[" if low_inclusive else "("
        raise ValueError(f"{name} must lie in {bracket}{low}, {high}], got {value!r}")
    return float(value)


def _check_int(value, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int ≥ {minimum}, got {value!r}")
    return value


def _check_choice(value, choices, name: str) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


@dataclass(frozen=True)
class AuditConfig:
    """DP-SGD settings under test (σ, C, q, steps, engine path) and the canary experiment.

    ``num_runs`` independent trainings with ``canaries_per_run`` Dirac canaries each (see
    :mod:`~opacus_dp.audit.canaries`); every canary is a membership trial. ``api`` "classic"
    uses ``PrivacyEngine(model, ...).attach(optimizer)`` (RDP accounting, so ``accountant``
    must be "rdp"); "modern" uses ``make_private``. ``max_physical_batch_size`` splits each
    logical batch with ``BatchMemoryManager`` (virtual steps). ``grad_sample_mode`` is passed
    to ``make_private`` (modern API only), as are ``noise_mechanism`` and ``bands`` (the run is
    planned for ``steps``; scores: :mod:`~opacus_dp.audit.correlated`).
    ``privacy_unit`` "user" audits the user-level guarantee with canary users of
    ``canary_examples_per_user`` examples each (``max_examples_per_user``, ``unit_gradient`` go to
    ``make_private``; ``user_mechanism`` "per_example" is a broken variant for detection tests):
    :mod:`~opacus_dp.audit.user_canaries`. ``sample_rate`` is then the users' rate.
    """

    noise_multiplier: float
    steps: int
    max_grad_norm: float = 1.0
    sample_rate: float = 1.0
    canaries_per_run: int = 1000
    num_runs: int = 1
    num_background: int = 32
    background_dim: int = 8
    canary_gradient_scale: float = 4.0
    learning_rate: float = 1.0
    delta: float = 1e-5
    confidence: float = 0.95
    api: str = "modern"
    accountant: str = "prv"
    grad_sample_mode: str = "hooks"
    loss_reduction: str = "mean"
    max_physical_batch_size: Optional[int] = None
    seed: int = 0
    noise_mechanism: str = "independent"
    bands: Optional[int] = None
    privacy_unit: str = "example"
    canary_examples_per_user: int = 1
    max_examples_per_user: Optional[int] = None
    unit_gradient: str = "mean"
    user_mechanism: str = "uls"

    def __post_init__(self):
        _check_number(self.noise_multiplier, "noise_multiplier", low=0.0, low_inclusive=True)
        _check_int(self.steps, "steps")
        _check_number(self.max_grad_norm, "max_grad_norm", low=0.0, low_inclusive=False, high=1e12)
        _check_number(self.sample_rate, "sample_rate", low=0.0, low_inclusive=False, high=1.0)
        _check_int(self.num_runs, "num_runs")
        _check_number(self.learning_rate, "learning_rate", low=0.0, low_inclusive=False)
        check_delta(self.delta)
        check_confidence(self.confidence)
        _check_choice(self.api, APIS, "api")
        _check_choice(self.accountant, ACCOUNTANTS, "accountant")
        _check_choice(self.loss_reduction, LOSS_REDUCTIONS, "loss_reduction")
        if self.api == "classic" and self.accountant != "rdp":
            raise ValueError("api='classic' accounts with RDP (as Opacus 0.x): pass accountant='rdp'")
        if self.api == "classic" and self.grad_sample_mode != "hooks":
            raise ValueError("api='classic' computes per-sample gradients with hooks only: "
                             "pass grad_sample_mode='hooks' (or use api='modern')")
        if self.max_physical_batch_size is not None:
            _check_int(self.max_physical_batch_size, "max_physical_batch_size")
        _check_int(self.seed, "seed", minimum=0)
        _check_choice(self.noise_mechanism, MECHANISMS, "noise_mechanism")
        if self.noise_mechanism != "independent" and (self.api != "modern" or self.noise_multiplier == 0):
            raise ValueError("a correlated noise_mechanism is audited through make_private (api='modern') "
                             "with noise_multiplier > 0")
        check_user_settings(self)
        self.layout()  # validates the canary sizes

    def layout(self) -> CanaryLayout:
        """The canary task of one run."""
        return CanaryLayout(num_canaries=self.canaries_per_run, num_background=self.num_background,
                            background_dim=self.background_dim,
                            gradient_scale=self.canary_gradient_scale)

    @property
    def num_canaries(self) -> int:
        """Membership trials in the whole audit: ``num_runs · canaries_per_run``."""
        return self.num_runs * self.canaries_per_run
