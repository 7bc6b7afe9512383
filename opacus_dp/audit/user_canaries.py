"""Canary users: the audit at user level (``AuditConfig(privacy_unit="user", ...)``).

A user-level guarantee protects everything one user contributes, so a membership trial must add
or remove a whole user. Canary user i owns ``m = canary_examples_per_user`` examples, all equal to
the Dirac canary of :mod:`~opacus_dp.audit.canaries` on coordinate ``d_b + i``: each has gradient
``s·C·e_{d_b+i}`` (``s ≥ 1``), and no other example touches that coordinate. A present user's
``m`` rows come first in the dataset (consecutive, present users in index order); an absent user
has none (add/remove adjacency at user level). The background examples form users of ``m``
consecutive examples each. The user of every row is ``dataset.user_ids`` (canary user i has id
i, whether or not it is present; background users follow), which ``make_private`` reads.

What a step adds to coordinate ``d_b + i`` (in the runner's units: ``C`` per observation unit):

* user-level sampling (``user_mechanism="uls"``, i.e. ``make_private(privacy_unit="user")``): the
  sampled user's gradient, the mean (or sum) of its ``min(m, k)`` sampled examples' gradients,
  is ``s·C·e`` (or ``min(m, k)·s·C·e``) and is clipped to norm ``C`` as one unit: the
  observation is ``b_t + N(0, σ²)`` with ``b_t ~ Bernoulli(q)``, the mechanism the accountant's
  user-level ε is computed for;
* ``user_mechanism="per_example"``, a deliberately broken user-level implementation: examples
  are sampled at rate ``q`` and clipped one by one (example-level ``make_private`` over the same
  rows) while the accountant's ε for ``(σ, q)`` is claimed per user. The observation is then
  ``Binomial(m, q) + N(0, σ²)``: up to ``m·C`` per step, which a correct audit must flag.
"""

from typing import Optional

import torch
from torch.utils.data import TensorDataset

from opacus_dp.accountants.group_privacy import PRIVACY_UNITS
from opacus_dp.audit.canaries import CanaryLayout, canary_dataset
from opacus_dp.maths.unit_groups import UNIT_GRADIENTS

USER_MECHANISMS = ("uls", "per_example")


class UserCanaryDataset(TensorDataset):
    """A ``TensorDataset`` whose ``user_ids[j]`` is the user of row ``j`` (module doc)."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor, user_ids: torch.Tensor):
        super().__init__(inputs, targets)
        if user_ids.shape != (len(inputs),):
            raise ValueError(f"user_ids must have one entry per row ({len(inputs)}), got {tuple(user_ids.shape)}")
        self.user_ids = user_ids


def user_canary_dataset(layout: CanaryLayout, membership: torch.Tensor, *, examples_per_user: int,
                        max_grad_norm: float, generator: torch.Generator,
                        dtype: torch.dtype = torch.float64) -> UserCanaryDataset:
    """``m`` rows per present canary user, then the background rows (module doc)."""
    if isinstance(examples_per_user, bool) or not isinstance(examples_per_user, int) or examples_per_user < 1:
        raise ValueError(f"examples_per_user must be an int ≥ 1, got {examples_per_user!r}")
    base = canary_dataset(layout, membership, max_grad_norm=max_grad_norm, generator=generator, dtype=dtype)
    inputs, targets = base.tensors
    present = torch.as_tensor(membership, dtype=torch.bool).nonzero().view(-1)
    count = len(present)
    m = examples_per_user
    canary_ids = present.repeat_interleave(m)
    background_ids = layout.num_canaries + torch.arange(layout.num_background) // m
    return UserCanaryDataset(torch.cat([inputs[:count].repeat_interleave(m, dim=0), inputs[count:]]),
                             torch.cat([targets[:count].repeat_interleave(m), targets[count:]]),
                             torch.cat([canary_ids, background_ids]))


def canary_data(config, layout: CanaryLayout, membership: torch.Tensor, generator: torch.Generator):
    """The run's dataset: one row per present canary, or ``m`` per present canary user."""
    if config.privacy_unit == "example":
        return canary_dataset(layout, membership, max_grad_norm=config.max_grad_norm, generator=generator)
    return user_canary_dataset(layout, membership, examples_per_user=config.canary_examples_per_user,
                               max_grad_norm=config.max_grad_norm, generator=generator)


def unit_options(config) -> dict:
    """The privacy-unit keywords of ``make_private`` for the run (none for example level and for
    the ``per_example`` variant, which trains at example level)."""
    if config.privacy_unit == "example" or config.user_mechanism == "per_example":
        return {}
    return {"privacy_unit": "user", "max_examples_per_user": config.max_examples_per_user,
            "unit_gradient": config.unit_gradient}


def _refuse_user_fields(config) -> None:
    defaults = {"canary_examples_per_user": 1, "max_examples_per_user": None, "unit_gradient": "mean",
                "user_mechanism": "uls"}
    for name, default in defaults.items():
        if getattr(config, name) != default:
            raise ValueError(f"{name} applies to the user-level audit only: pass privacy_unit='user'")


def check_user_settings(config) -> None:
    """The user-level fields of an :class:`~opacus_dp.audit.config.AuditConfig`, each refused by name."""
    if config.privacy_unit not in PRIVACY_UNITS:
        raise ValueError(f"privacy_unit must be one of {PRIVACY_UNITS}, got {config.privacy_unit!r}")
    if config.privacy_unit == "example":
        _refuse_user_fields(config)
        return
    m = config.canary_examples_per_user
    if isinstance(m, bool) or not isinstance(m, int) or m < 2:
        raise ValueError(f"canary_examples_per_user must be an int ≥ 2 (a canary user of one example is the "
                         f"example-level audit), got {m!r}")
    k = config.max_examples_per_user
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise ValueError(f"max_examples_per_user must be None or an int ≥ 1, got {k!r}")
    if config.unit_gradient not in UNIT_GRADIENTS:
        raise ValueError(f"unit_gradient must be one of {UNIT_GRADIENTS}, got {config.unit_gradient!r}")
    if config.user_mechanism not in USER_MECHANISMS:
        raise ValueError(f"user_mechanism must be one of {USER_MECHANISMS}, got {config.user_mechanism!r}")
    if config.api != "modern" or config.noise_mechanism != "independent":
        raise ValueError("the user-level audit runs make_private (api='modern') with "
                         "noise_mechanism='independent'")


def describe_units(config) -> Optional[str]:
    """One line on the canary users for the report (None at example level)."""
    if config.privacy_unit == "example":
        return None
    cap = "all" if config.max_examples_per_user is None else f"at most {config.max_examples_per_user}"
    mechanism = ("user-level sampling" if config.user_mechanism == "uls"
                 else "per-example sampling and clipping claimed per user")
    return (f"privacy unit: user ({config.canary_examples_per_user} canary examples per canary user, "
            f"{cap} per step, {config.unit_gradient} of a user's gradients; {mechanism})")
