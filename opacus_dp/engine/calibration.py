"""Calibration: the plan whose σ spends at most a target ε over the planned run.

``make_private_with_epsilon`` calibrates the :class:`~opacus_dp.engine.plan.PrivatePlan` it built
(with the mechanism's plan, computed once) and hands the calibrated plan to ``make_private``'s
assembly: nothing is planned twice.
"""

import warnings
from typing import Optional

from opacus_dp.accountants import get_noise_multiplier
from opacus_dp.accountants.validation import warn_if_delta_not_small
from opacus_dp.data.loader_facts import planned_steps, sample_rate_of
from opacus_dp.engine.plan import PrivatePlan
from opacus_dp.mechanisms.engine import MechanismPlan, calibrated_noise_multiplier


def calibrated_plan(plan: PrivatePlan, *, data_loader, mechanism: Optional[MechanismPlan], accountant,
                    target_epsilon: float, target_delta: float, epochs, epsilon_tolerance: float = 0.01,
                    **epsilon_kwargs) -> PrivatePlan:
    """``plan`` with the σ that spends at most ``target_epsilon`` at ``target_delta`` over
    ``epochs`` passes of ``data_loader`` (``⌈epochs · len(loader)⌉`` steps at ``q = 1/len(loader)``,
    or the mechanism's planned steps), found by the accountant's bisection; ``epsilon_kwargs`` go
    to its ``get_epsilon`` (``alphas`` for RDP, ``eps_error`` for PRV). With ``clipping="adaptive"``
    the σ is the total one (the released count's share included)."""
    if len(accountant) > 0:
        warnings.warn("make_private_with_epsilon: privacy already spent by this engine is not "
                      "included in the calibration; the final epsilon will be higher", UserWarning)
    warn_if_delta_not_small(target_delta, len(data_loader.dataset))
    if mechanism is not None:
        sigma = calibrated_noise_multiplier(mechanism, accountant=accountant.mechanism(),
                                            target_epsilon=target_epsilon, target_delta=target_delta,
                                            epsilon_tolerance=epsilon_tolerance, **epsilon_kwargs)
    else:
        sigma = get_noise_multiplier(target_epsilon=target_epsilon, target_delta=target_delta,
                                     sample_rate=sample_rate_of(data_loader),
                                     steps=planned_steps(data_loader, epochs), accountant=accountant.mechanism(),
                                     epsilon_tolerance=epsilon_tolerance, **epsilon_kwargs)
    return plan.calibrated(sigma)
