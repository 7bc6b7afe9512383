"""The plan of a private run: every setting, in one frozen record validated once.

``make_private``, ``make_private_with_epsilon``, the classic ``PrivacyEngine(model, ...)`` and the
integrations build a :class:`PrivatePlan` from their keyword arguments (:meth:`PrivatePlan.of`)
and the engine assembles the run from it (:mod:`opacus_dp.engine.assembly`); the calculator CLI
checks its noise settings with the same :meth:`PrivatePlan.check_noise`. Calibration
(``make_private_with_epsilon``) returns a plan with the calibrated σ
(:func:`opacus_dp.engine.calibration.calibrated_plan`). A new option is one field here, its check
in :meth:`PrivatePlan.__post_init__`, and the part that uses it.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import torch

from opacus_dp.distributed.step_wait import timeout_seconds
from opacus_dp.engine.arguments import check_choice, check_opacus_flags, check_privacy_arguments
from opacus_dp.engine.fast_noise import is_fast_noise
from opacus_dp.engine.privacy_units import check_unit_settings
from opacus_dp.grad_sample.mode_selection import MODE_NAMES
from opacus_dp.mechanisms.strategies import KINDS
from opacus_dp.optim.adaptive_clipping import SETTINGS as ADAPTIVE_SETTINGS

# the options of a clipping rule given as keyword arguments of make_private
CLIPPING_OPTIONS = {"adaptive": ADAPTIVE_SETTINGS}


@dataclass(frozen=True)
class PrivatePlan:
    """Everything a private run is (module doc). Fields, by the part that uses them:

    * clipping (the clipper): ``max_grad_norm`` (a bound, or a tuple of per-tensor bounds),
      ``clipping`` (a rule of :mod:`~opacus_dp.optim.clipper_registry`), ``clipping_options``;
    * noise (the mechanism): ``noise_multiplier`` σ, ``noise_mechanism`` with ``bands`` and
      ``epochs``, ``noise_generator``, ``secure_mode``, ``fast_noise`` (``True``: draws by parallel threads on
      CPU, :class:`~opacus_dp.optim.parallel_noise.ParallelGaussianNoise`; ``"philox"``: counter-based
      draws fused with the add, :class:`~opacus_dp.optim.philox_noise.PhiloxGaussianNoise`);
    * sampling and the loss: ``poisson_sampling``, ``loss_reduction``, ``batch_first``;
    * per-sample gradients (the gradient source): ``grad_sample_mode``, ``skip_weight_grads``,
      ``check_sample_independence``, ``public_buffers``, ``criterion`` (ghost);
    * the privacy unit (:mod:`~opacus_dp.engine.privacy_units`): ``privacy_unit``, ``user_ids``,
      ``max_examples_per_user``, ``augmentation_multiplicity``, ``unit_gradient``;
    * reduction: ``step_timeout`` (seconds), ``fsdp``;
    * Opacus 1.6 flags: ``wrap_model``, ``rand_on_empty``.
    """

    noise_multiplier: float
    max_grad_norm: Union[float, Tuple[float, ...]]
    clipping: str = "flat"
    clipping_options: Tuple[Tuple[str, float], ...] = ()
    noise_mechanism: str = "independent"
    bands: Optional[int] = None
    epochs: Optional[float] = None
    noise_generator: Optional[torch.Generator] = field(default=None, compare=False)
    secure_mode: bool = False
    fast_noise: Union[bool, str] = False
    poisson_sampling: bool = True
    loss_reduction: str = "mean"
    batch_first: bool = True
    grad_sample_mode: str = "hooks"
    skip_weight_grads: Optional[bool] = None
    check_sample_independence: bool = True
    public_buffers: Tuple[str, ...] = ()
    criterion: Any = field(default=None, compare=False)
    step_timeout: Optional[float] = None
    fsdp: Any = field(default=False, compare=False)
    wrap_model: bool = True
    rand_on_empty: bool = False
    privacy_unit: str = "example"
    user_ids: Any = field(default=None, compare=False)
    max_examples_per_user: Optional[int] = None
    augmentation_multiplicity: int = 1
    unit_gradient: str = "mean"

    def __post_init__(self):
        check_opacus_flags(self.wrap_model, self.rand_on_empty)
        check_unit_settings(self)
        self.check_noise(self.noise_mechanism, self.bands)
        check_privacy_arguments(noise_multiplier=self.noise_multiplier, max_grad_norm=self.max_grad_norm,
                                loss_reduction=self.loss_reduction, clipping=self.clipping)
        allowed = CLIPPING_OPTIONS.get(self.clipping, ())
        given = sorted(name for name, _ in self.clipping_options if name not in allowed)
        if given:
            raise ValueError(f"{', '.join(given)} only apply to clipping='adaptive' (clipping={self.clipping!r} "
                             "keeps max_grad_norm fixed): pass clipping='adaptive' or drop them")
        check_choice(self.grad_sample_mode, MODE_NAMES, "grad_sample_mode")
        if self.noise_generator is not None and self.secure_mode:
            raise ValueError("noise_generator must be None in secure_mode (noise is seeded by the OS)")
        if not is_fast_noise(self.fast_noise):
            raise ValueError(f"fast_noise must be False (one generator), True (parallel threads) or 'philox' "
                             f"(counter-based, fused with the add), got {self.fast_noise!r}")
        for name in ("poisson_sampling", "batch_first", "check_sample_independence", "secure_mode"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        object.__setattr__(self, "step_timeout", timeout_seconds(self.step_timeout))
        for name in ("public_buffers", "max_grad_norm"):  # lists as tuples (other types are checked where used)
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))

    @staticmethod
    def check_noise(noise_mechanism: str, bands: Optional[int]) -> None:
        """The noise mechanism's name, and ``bands`` only for ``banded`` (the loader-dependent
        checks are :func:`~opacus_dp.mechanisms.engine.plan_mechanism`'s)."""
        if noise_mechanism not in KINDS:
            raise ValueError(f"noise_mechanism must be one of {KINDS}, got {noise_mechanism!r}")
        if noise_mechanism != "banded" and bands not in (None, 1):
            raise ValueError(f"noise_mechanism={noise_mechanism!r}: bands only apply to "
                             "noise_mechanism='banded'; nothing was changed")

    @classmethod
    def of(cls, arguments: Mapping[str, Any], **engine_settings) -> "PrivatePlan":
        """The plan of a call's keyword ``arguments`` (e.g. ``make_private``'s ``locals()``;
        names that are no field of the plan, such as the model, are ignored): the options of the
        clipping rule (``target_unclipped_quantile``, ...) given a value become
        ``clipping_options``. ``engine_settings``: the engine's own (``secure_mode``)."""
        names = {f.name for f in dataclasses.fields(cls)}
        options = tuple((name, arguments[name]) for name in _all_clipping_options()
                        if arguments.get(name) is not None)
        values = {name: value for name, value in arguments.items() if name in names}
        return cls(**values, clipping_options=options, **engine_settings)

    @property
    def groups_rows(self) -> bool:
        """Whether a privacy unit is several rows (users, or augmentations of one example)."""
        return self.privacy_unit == "user" or self.augmentation_multiplicity > 1

    @property
    def options(self) -> Dict[str, float]:
        """The clipping rule's options as keyword arguments."""
        return dict(self.clipping_options)

    def calibrated(self, noise_multiplier: float) -> "PrivatePlan":
        """This plan with σ = ``noise_multiplier`` (what calibration returns)."""
        return dataclasses.replace(self, noise_multiplier=noise_multiplier)


def _all_clipping_options() -> Tuple[str, ...]:
    return tuple(name for names in CLIPPING_OPTIONS.values() for name in names)
