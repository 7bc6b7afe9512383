"""The privacy unit of a run: its settings' checks, its loader, and the ε it reports.

``privacy_unit="example"`` (default): each row is one unit, today's DP-SGD. ``privacy_unit="user"``
with ``user_ids`` (``user_ids[i]`` the user of example ``i``; or ``None`` to read
``dataset.user_ids``): user-level sampling (ULS) — Poisson sampling of users at rate ``q``, at most
``max_examples_per_user`` examples of each sampled user, the user's gradient (``unit_gradient``:
the mean or sum of its examples') clipped as one, and the accountant records ``(σ, q)`` for users.
``augmentation_multiplicity=K``: every sampled example is ``K`` rows (``K`` augmentations by the
dataset's random transform), averaged before clipping; accounted as one example (De et al. 2022).
Both group rows (:mod:`opacus_dp.maths.unit_groups`, :mod:`opacus_dp.data.unit_sampling`).
"""

from numbers import Integral
from typing import Callable, Optional

from opacus_dp.accountants.group_privacy import PRIVACY_UNITS, epsilon_for_privacy_unit
from opacus_dp.maths.unit_groups import UNIT_GRADIENTS


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
        raise ValueError(f"{name} must be an int ≥ 1, got {value!r}")
    return int(value)


def check_unit_settings(plan) -> None:
    """The unit settings of ``plan`` (a :class:`~opacus_dp.engine.plan.PrivatePlan`) and what
    they do not combine with, each refused with the argument named."""
    if plan.privacy_unit not in PRIVACY_UNITS:
        raise ValueError(f"privacy_unit must be one of {PRIVACY_UNITS}, got {plan.privacy_unit!r}")
    if plan.unit_gradient not in UNIT_GRADIENTS:
        raise ValueError(f"unit_gradient must be one of {UNIT_GRADIENTS}, got {plan.unit_gradient!r}")
    _positive_int(plan.augmentation_multiplicity, "augmentation_multiplicity")
    if plan.privacy_unit == "example":
        for name in ("user_ids", "max_examples_per_user"):
            if getattr(plan, name) is not None:
                raise ValueError(f"{name} applies only to privacy_unit='user'; pass privacy_unit='user' "
                                 "to train with users as the privacy unit, or drop it")
    elif plan.max_examples_per_user is not None:
        _positive_int(plan.max_examples_per_user, "max_examples_per_user")
    if not plan.groups_rows:
        return
    what = "privacy_unit='user'" if plan.privacy_unit == "user" else "augmentation_multiplicity > 1"
    if not plan.poisson_sampling:
        raise ValueError(f"{what} samples its units with Poisson sampling: poisson_sampling=False is not "
                         "supported with it")
    if plan.noise_mechanism != "independent":
        raise NotImplementedError(f"{what} with noise_mechanism={plan.noise_mechanism!r}: correlated noise "
                                  "samples examples cyclically; use noise_mechanism='independent'")


def user_ids_of(plan, dataset):
    """The user of every example: ``plan.user_ids``, or ``dataset.user_ids`` when not given."""
    if plan.user_ids is not None:
        return plan.user_ids
    ids = getattr(dataset, "user_ids", None)
    if ids is None:
        raise ValueError("privacy_unit='user' needs user_ids (the user of every example of the dataset, "
                         "in order), or a dataset with a user_ids attribute")
    return ids


def unit_epsilon(epsilon_at: Callable[[float], float], delta: float, run_unit: str,
                 privacy_unit: Optional[str], max_examples_per_user: Optional[int]) -> float:
    """ε at ``delta`` for ``privacy_unit`` (None: the run's own unit). A run sampled by users
    (``run_unit="user"``) reports its accountant's ε, which is per user; for an example-level run,
    ``privacy_unit="user"`` converts by group privacy (:mod:`opacus_dp.accountants.group_privacy`)."""
    if run_unit == "example":
        return epsilon_for_privacy_unit(epsilon_at, delta, privacy_unit or "example", max_examples_per_user)
    if privacy_unit not in (None, "user"):
        raise ValueError(
            "this run samples and clips users (privacy_unit='user'): its ε is per user, with a user's "
            "examples added or removed together; an example-level ε is not reported for it (call "
            "get_epsilon(delta))")
    if max_examples_per_user is not None:
        raise ValueError("max_examples_per_user converts an example-level run's ε by group privacy; this run "
                         "already accounts per user: call get_epsilon(delta)")
    return float(epsilon_at(delta))


def connect_units(wrapper, loader) -> None:
    """Let the per-sample wrapper group the rows of each pass as ``loader`` delivers them."""
    target = getattr(wrapper, "_orig_mod", wrapper)  # a compiled wrapper
    configure = getattr(target, "configure_units", None)
    if configure is None:
        raise NotImplementedError(f"{type(target).__name__} cannot group rows into privacy units; "
                                  "use make_private's own per-sample wrapper")
    configure(loader.unit_channel)

