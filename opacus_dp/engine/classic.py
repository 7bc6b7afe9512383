"""Classic (Opacus 0.x) API: ``PrivacyEngine(model, batch_size, sample_size, ...).attach(optimizer)``.

After ``attach`` the user's own optimizer object performs private steps: its ``step``,
``zero_grad``, ``virtual_step`` and ``signal_skip_step`` are replaced (on the instance only)
by those of a :class:`~opacus_dp.optim.DPOptimizer`, and ``optimizer.privacy_engine`` is the
engine. The model keeps being called directly; per-sample gradient hooks sit on its layers.
``detach`` removes every hook and instance attribute that was added, restoring both exactly.

Accounting uses RDP with the engine's ``alphas`` (orders), as Opacus 0.x did; one record
``(σ, q)`` per step, including steps on empty Poisson batches.
"""

import warnings
import weakref
from typing import List, Optional, Sequence, Union

import torch
import torch.nn as nn

from opacus_dp.accountants import RDPAccountant
from opacus_dp.accountants.analysis.rdp import compute_rdp
from opacus_dp.distributed.noise_streams import own_stream_per_rank
from opacus_dp.engine.arguments import check_optimizer_params
from opacus_dp.engine.classic_arguments import (
    DEFAULT_ALPHAS,
    PoissonDrawsFollowed,
    SamplerFeed,
    calibrate_noise_multiplier,
    check_every_trainable_parameter_attached,
    check_misc_settings,
    classic_sampling,
    recognised_0x_sampler,
    refuse_sample_rate_change,
    warn_fixed_size_batches,
)
from opacus_dp.engine.classic_patching import PATCHED_ATTRIBUTES, patch_optimizer, restore_optimizer
from opacus_dp.engine.model import validate_module, wrap_module
from opacus_dp.engine.optimizer import make_dp_optimizer, secure_generator
from opacus_dp.engine.plan import PrivatePlan
from opacus_dp.engine.read_once import setting_read_once
from opacus_dp.engine.private_step import (check_distributed, connect_private_step, rebind_if_sharded, shard_if_asked,
                                           warn_if_not_secure)
from opacus_dp.optim.clipper_registry import make_clipper
from opacus_dp.optim.logical_batches import BatchingPolicy
from opacus_dp.state_views import OPACUS_0X
from opacus_dp.validators.module_errors import IncompatibleModuleException


class ClassicPrivacyEngine:
    """Opacus 0.9–0.15 ``PrivacyEngine``; created by ``PrivacyEngine(model, ...)`` (an instance
    of :class:`~opacus_dp.engine.modern.PrivacyEngine` for ``isinstance``; it composes the wiring
    of :mod:`opacus_dp.engine.private_step` with the modern engine instead of inheriting from it).

    Args (as in Opacus 0.x): ``module``; ``batch_size`` and ``sample_size`` (q = B/N) or
    ``sample_rate``; ``alphas`` (RDP orders); ``noise_multiplier`` (σ; or ``target_epsilon``
    and ``epochs`` to calibrate it); ``max_grad_norm`` (C, or a list for per-layer clipping);
    ``secure_rng``; ``batch_first``; ``target_delta``; ``loss_reduction``; ``poisson`` (the
    data loader samples Poisson batches, possibly empty: each is a real step);
    ``clip_per_layer``; ``max_epsilon`` (budget guard at ``target_delta``); Opacus 0.x's
    ``enable_stat``, ``experimental`` and its clipping settings (see :func:`check_misc_settings`
    in :mod:`~opacus_dp.engine.classic_arguments`). Beyond Opacus 0.x:
    ``grad_sample_mode`` ("hooks", "functorch", "ghost", "bk", "auto"; see
    :mod:`opacus_dp.grad_sample.mode_selection`) and its ``skip_weight_grads``; ``fsdp=True`` (or a
    dict of ``fully_shard`` options) shards the model with FSDP2 here and ``attach`` points the
    optimizer at the shards (``docs/distributed.md``); ``check_sample_independence`` and
    ``public_buffers``: as for ``make_private``; ``fast_noise`` (``True``: parallel threads,
    ``"philox"``: the counter-based noise fused with its add; as for ``make_private``). ``p.grad_sample``
    and ``p.summed_grad`` follow 0.x's lifecycle (:mod:`opacus_dp.state_views`).
    """

    def __init__(self, module: nn.Module, batch_size: Optional[int] = None,
                 sample_size: Optional[int] = None, alphas: Sequence[float] = DEFAULT_ALPHAS,
                 noise_multiplier: Optional[float] = None,
                 max_grad_norm: Union[float, List[float], None] = None, *,
                 sample_rate: Optional[float] = None, secure_rng: bool = False,
                 batch_first: bool = True, target_delta: float = 1e-6,
                 target_epsilon: Optional[float] = None, epochs: Optional[float] = None,
                 loss_reduction: str = "mean", poisson: bool = False, clip_per_layer: bool = False,
                 grad_norm_type: int = 2, max_epsilon: Optional[float] = None,
                 noise_generator: Optional[torch.Generator] = None, grad_sample_mode: str = "hooks",
                 enable_stat: bool = False, experimental: bool = False, clipping_method=None,
                 clipping_ratio=None, clipping_momentum=None, skip_weight_grads: Optional[bool] = None,
                 fsdp=False, check_sample_independence: bool = True, public_buffers: Sequence[str] = (),
                 fast_noise: Union[bool, str] = False):
        check_misc_settings(enable_stat=enable_stat, experimental=experimental, clipping_method=clipping_method,
                            clipping_ratio=clipping_ratio, clipping_momentum=clipping_momentum)
        self.secure_mode = self.secure_rng = bool(secure_rng)
        warn_if_not_secure(self.secure_mode, stacklevel=4)  # the user's PrivacyEngine(model, ...) call
        if max_grad_norm is None:
            raise ValueError("max_grad_norm is required (the per-sample clipping bound C)")
        if grad_norm_type != 2:
            raise ValueError(f"grad_norm_type must be 2 (L2 clipping), got {grad_norm_type!r}")
        self.module = module
        self._unsharded_names = shard_if_asked(module, fsdp)  # FSDP2 for the user: attach rebinds
        self.world_size = check_distributed(module)
        self.alphas = list(alphas)
        self.accountant = RDPAccountant(alphas=self.alphas)
        self.target_delta = target_delta
        self.batch_first, self.loss_reduction, self.poisson = batch_first, loss_reduction, poisson
        self._sample_rate, self.batch_size, self.sample_size, self.expected_batch_size = classic_sampling(
            batch_size=batch_size, sample_size=sample_size, sample_rate=sample_rate,
            poisson=poisson, world_size=self.world_size, loss_reduction=loss_reduction)
        if clip_per_layer and not isinstance(max_grad_norm, (list, tuple)):
            max_grad_norm = [max_grad_norm] * sum(p.requires_grad for p in module.parameters())
        self.clipping = "per_layer" if isinstance(max_grad_norm, (list, tuple)) else "flat"
        self._max_grad_norm = max_grad_norm
        self._noise_multiplier = calibrate_noise_multiplier(
            noise_multiplier, target_epsilon=target_epsilon, target_delta=target_delta, sample_rate=self.sample_rate,
            sample_size=self.sample_size, epochs=epochs, alphas=self.alphas)
        self.max_epsilon, self.max_epsilon_delta = max_epsilon, target_delta
        self.noise_generator, self.fast_noise = noise_generator, fast_noise
        self.grad_sample_mode, self.skip_weight_grads = grad_sample_mode, skip_weight_grads
        self._model_checks = (check_sample_independence, public_buffers)
        self.plan()  # every setting checked now
        self.device = None
        self.optimizer = None
        self.grad_sample_module = None
        self._dp_optimizer = None
        self._pending_noise_state = None
        self._saved_attributes = None
        self._draws_followed = None  # the empty draws and Poisson loaders of its rate, while attached
        self._sampling_given = None  # (poisson, sample_size, expected, sampler, generator) while one is taken
        self._sampler_feed = None  # checks that the taken sampler feeds the steps

    # ------------------------------------------------------------------ attach / detach
    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer.step()`` a private step (see module doc).

        Given ``sample_rate`` without ``poisson``/``batch_size``, a live
        ``UniformWithReplacementSampler`` of that rate created before ``attach`` (Opacus 0.14's
        loop) makes the engine run as ``poisson=True, sample_size=sampler.num_samples`` until
        ``detach`` (:func:`~opacus_dp.engine.classic_arguments.recognised_0x_sampler`)."""
        owner = getattr(optimizer, "privacy_engine", None)
        if owner is not None:
            if owner is self:
                warnings.warn("this optimizer is already attached to this engine; nothing to do")
                return
            raise ValueError("optimizer is already attached to another PrivacyEngine: detach it first")
        if self.optimizer is not None:
            raise ValueError("this PrivacyEngine is already attached to an optimizer: detach it first")
        rebind_if_sharded(optimizer, self._unsharded_names, self.module)
        check_optimizer_params(self.module, optimizer)
        check_every_trainable_parameter_attached(self.module, optimizer)
        validate_module(self.module, error_class=IncompatibleModuleException)  # 0.x's error type
        sampler = self._take_0x_sampler()
        try:
            self._wire(optimizer)
        except Exception:
            self._restore_sampling_given()
            raise
        if sampler is not None:
            self._sampler_feed = SamplerFeed(sampler, self.steps)
        if not self.poisson:
            warn_fixed_size_batches(self.sample_rate)
        elif self.world_size == 1:  # an empty 0.x draw is a step; a Poisson batch gets its own
            self._draws_followed = PoissonDrawsFollowed(optimizer, sample_rate=self.sample_rate)

    def _wire(self, optimizer) -> None:
        """Hooks on the model, the private step on ``optimizer``, the accountant behind it."""
        plan = self.plan()
        gsm = wrap_module(self.module, grad_sample_mode=plan.grad_sample_mode, batch_first=plan.batch_first,
                          loss_reduction=plan.loss_reduction, skip_weight_grads=plan.skip_weight_grads)
        try:
            gsm.configure_model_checks(plan.check_sample_independence, plan.public_buffers)
            dp_optimizer = make_dp_optimizer(
                plan, optimizer, module=self.module, grad_sample_module=gsm,
                clipper=make_clipper(plan.clipping, plan.max_grad_norm), expected_batch_size=self.expected_batch_size,
                batching=self._limit_logical_batches(gsm), state_views=OPACUS_0X)
            connect_private_step(self.module, dp_optimizer, accountant=self.accountant,
                                 sample_rate=self.sample_rate, max_epsilon=self.max_epsilon,
                                 max_epsilon_delta=self.target_delta, epsilon_of=self._budget_epsilon)
            if self._pending_noise_state is not None:  # from load_state_dict before attach, or detach
                dp_optimizer.load_noise_state_dict(self._pending_noise_state)
                own_stream_per_rank(dp_optimizer)
        except Exception:
            gsm.close()
            raise
        self.grad_sample_module, self._dp_optimizer, self._pending_noise_state = gsm, dp_optimizer, None
        self._saved_attributes = patch_optimizer(optimizer, self)
        self.optimizer = optimizer

    def plan(self) -> PrivatePlan:
        """The :class:`~opacus_dp.engine.plan.PrivatePlan` of this engine's settings (the record
        ``make_private`` builds; its sampling stays the classic one: ``sample_rate``,
        ``expected_batch_size``)."""
        return PrivatePlan(
            noise_multiplier=self._noise_multiplier, max_grad_norm=self._max_grad_norm, clipping=self.clipping,
            noise_generator=self.noise_generator, secure_mode=self.secure_mode, fast_noise=self.fast_noise,
            poisson_sampling=bool(self.poisson),
            loss_reduction=self.loss_reduction, batch_first=self.batch_first, grad_sample_mode=self.grad_sample_mode,
            skip_weight_grads=self.skip_weight_grads, check_sample_independence=self._model_checks[0],
            public_buffers=self._model_checks[1])

    def _take_0x_sampler(self):
        """Opacus 0.14's loop (:func:`recognised_0x_sampler`): run as ``poisson=True,
        sample_size=N`` while attached — the mean divides by q·N, empty draws are accounted
        steps. With ``secure_rng`` its draws come from an OS-seeded generator until ``detach``.
        Returns the sampler taken, or None."""
        sampler = recognised_0x_sampler(poisson=self.poisson, world_size=self.world_size,
                                        batch_size=self.batch_size, sample_size=self.sample_size,
                                        sample_rate=self.sample_rate)
        if sampler is not None:
            self._sampling_given = (self.poisson, self.sample_size, self.expected_batch_size,
                                    weakref.ref(sampler), sampler.generator)
            self.poisson, self.sample_size = True, sampler.num_samples
            self.expected_batch_size = self.sample_rate * sampler.num_samples
            if self.secure_mode:  # the run's Poisson sampling, secured as make_private's
                sampler.generator = secure_generator()
        return sampler

    def _restore_sampling_given(self) -> None:
        if self._sampling_given is not None:
            self.poisson, self.sample_size, self.expected_batch_size, taken, generator = self._sampling_given
            if taken() is not None:
                taken().generator = generator
        self._sampling_given = self._sampler_feed = None

    def _limit_logical_batches(self, gsm) -> BatchingPolicy:
        """Opacus 0.x: everything between two steps is one logical batch of ``batch_size``.

        So several backward passes never multiply q; with fixed-size batches a step on more
        than ``batch_size`` samples is refused; with Poisson batches a second backward pass
        before the step is refused by ``gsm`` (cut a Poisson batch with ``virtual_step``
        instead). Returns the optimizer's :class:`BatchingPolicy`.
        """
        if self.poisson:
            gsm.forbid_grad_accumulation()
        return BatchingPolicy(count_iterations=False, max_batch_size=None if self.poisson else self.batch_size)

    def detach(self) -> None:
        """Restore the optimizer (step, zero_grad, ...) and the model exactly; σ, C (as a schedule
        left them) and the noise stream carry over to the next ``attach``."""
        if self.optimizer is None:
            raise ValueError("this PrivacyEngine is not attached to an optimizer")
        if self._draws_followed is not None:
            self._draws_followed.remove()
            self._draws_followed = None
        restore_optimizer(self.optimizer, self._saved_attributes)
        self._restore_sampling_given()
        self._dp_optimizer.reducer.close()
        self.grad_sample_module.close()
        self._noise_multiplier, self._max_grad_norm = self._dp_optimizer.noise_multiplier, self.max_grad_norm
        self._pending_noise_state = self._dp_optimizer.noise_state_dict()  # never redraw released noise
        self.optimizer = self.grad_sample_module = self._dp_optimizer = None
        self._saved_attributes = None

    def _budget_epsilon(self, accountant) -> float:
        return float(accountant.get_privacy_spent(delta=self.target_delta, alphas=self.alphas)[0])

    # ------------------------------------------------------------------ steps
    def virtual_step(self) -> None:
        """Clip and accumulate the current batch (same as ``optimizer.virtual_step()``)."""
        self._attached().virtual_step()

    def zero_grad(self) -> None:
        """Drop the per-sample gradients of the last backward pass."""
        if self.grad_sample_module is not None:
            self.grad_sample_module.zero_grad_sample()

    def _attached(self):
        if self._dp_optimizer is None:
            raise ValueError("call attach(optimizer) first")
        return self._dp_optimizer

    # ------------------------------------------------------------------ settings
    max_epsilon = setting_read_once("max_epsilon", in_use=lambda e: getattr(e, "_dp_optimizer", None) is not None, fix=(
        "call detach(), set {name}, then attach(optimizer) again (σ, C, the noise stream and the privacy history "
        "carry over)"))  # the budget guard's ε
    sample_rate = property(lambda self: self._sample_rate, refuse_sample_rate_change)  # q of every step: fixed

    @property
    def noise_multiplier(self) -> float:
        return self._dp_optimizer.noise_multiplier if self._dp_optimizer else self._noise_multiplier

    @noise_multiplier.setter
    def noise_multiplier(self, value: float) -> None:
        self.plan().calibrated(value)  # checked as a plan
        self._noise_multiplier = float(value)
        if self._dp_optimizer is not None:
            self._dp_optimizer.noise_multiplier = float(value)

    @property
    def max_grad_norm(self):
        """C (a list for per-layer clipping), as the attached optimizer clips now (a schedule may
        have changed it)."""
        if self._dp_optimizer is None:
            return self._max_grad_norm
        if self.clipping == "per_layer":
            return list(self._dp_optimizer.max_grad_norms)
        return self._dp_optimizer.max_grad_norm

    @property
    def steps(self) -> int:
        """Number of private steps taken (accounted) so far."""
        return len(self.accountant)

    def _set_seed(self, seed: int) -> None:
        """Seed the noise generator (Opacus 0.x debugging helper; not in secure mode). Under FSDP2
        each rank then draws from its own stream derived from ``seed``
        (:func:`~opacus_dp.distributed.noise_streams.own_stream_per_rank`)."""
        if self.secure_mode:
            raise ValueError("_set_seed is not allowed with secure_rng=True")
        # attach derives the ranks' streams from it; the stream kept by detach gives way to it
        self.noise_generator, self._pending_noise_state = torch.Generator().manual_seed(int(seed)), None
        if self._dp_optimizer is not None:
            self._dp_optimizer.noise.reseed(int(seed))
            own_stream_per_rank(self._dp_optimizer)

    def to(self, device) -> "ClassicPrivacyEngine":
        """Record the device of the model (noise is drawn on the parameters' device)."""
        self.device = torch.device(device)
        return self

    # ------------------------------------------------------------------ privacy
    def get_renyi_divergence(self) -> torch.Tensor:
        """RDP of one step at each order of ``alphas``, for the current (σ, q)."""
        return torch.tensor(compute_rdp(self.sample_rate, self.noise_multiplier, 1, self.alphas))

    def get_privacy_spent(self, target_delta: Optional[float] = None):
        """``(ε, best α)`` for the whole history at ``target_delta`` (default: the engine's)."""
        delta = self.target_delta if target_delta is None else target_delta
        if delta is None:
            raise ValueError("target_delta is needed: pass it here or to the PrivacyEngine")
        eps, best_alpha = self.accountant.get_privacy_spent(delta=delta, alphas=self.alphas)
        return float(eps), float(best_alpha)

    def get_epsilon(self, delta: Optional[float] = None) -> float:
        return self.get_privacy_spent(delta)[0]

    def state_dict(self) -> dict:
        """Steps, full privacy history and noise generator state: this process's stream only (no
        collective, so rank 0 alone may save it; under FSDP2 see :meth:`load_state_dict`)."""
        state = {"steps": self.steps, "accountant": self.accountant.state_dict()}
        if self._dp_optimizer is not None:
            state["noise_generator_state"] = self._dp_optimizer.noise_state_dict()
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore :meth:`state_dict`; an Opacus 0.x ``{"steps": n}`` means n steps of (σ, q).

        Under FSDP2 (each rank noises its own shard) the state holds one stream, the saving
        rank's, and every rank loads it: each rank then continues from its own stream derived
        from it (:func:`~opacus_dp.distributed.noise_streams.own_stream_per_rank`), never the saved
        stream itself. Like the sharded checkpoints (:mod:`~opacus_dp.checkpoints.sharded`), no two
        ranks share a stream; unlike them, which save and restore every rank's stream bit-exactly,
        the resumed run is reproducible from this state but not the continuation of the saved one.
        Under DDP only rank 0 draws noise: its stream is restored as saved."""
        if "accountant" in state_dict:
            self.accountant.load_state_dict(state_dict["accountant"])
        else:
            steps = int(state_dict["steps"])
            history = [(self.noise_multiplier, self.sample_rate, steps)] if steps else []
            self.accountant.load_state_dict({"history": history, "mechanism": self.accountant.mechanism()})
        noise = state_dict.get("noise_generator_state")
        if noise is not None and self._dp_optimizer is not None:
            self._dp_optimizer.load_noise_state_dict(noise)
            own_stream_per_rank(self._dp_optimizer)
        elif noise is not None:  # not attached yet: restored by attach()
            self._pending_noise_state = noise

    def make_private(self, **_ignored):
        raise TypeError("this engine uses the classic API (created with a model): call "
                        "attach(optimizer); for make_private create PrivacyEngine() without a model")

    make_private_with_epsilon = make_private


PrivacyEngine = ClassicPrivacyEngine  # this module's engine under Opacus 0.x's class name

__all__ = ["ClassicPrivacyEngine", "PrivacyEngine", "DEFAULT_ALPHAS", "PATCHED_ATTRIBUTES"]
