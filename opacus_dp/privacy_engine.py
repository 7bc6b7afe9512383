"""PrivacyEngine: wires model, optimizer, data loader and accountant for DP-SGD.

Two APIs share this entry point:

* modern (Opacus 1.x): ``PrivacyEngine(accountant="prv")`` then ``make_private(...)`` /
  ``make_private_with_epsilon(...)``, ``get_epsilon(delta)``, ``save_checkpoint`` /
  ``load_checkpoint``;
* classic (Opacus 0.x): ``PrivacyEngine(model, batch_size, sample_size, ...)`` then
  ``attach(optimizer)`` — selected when the first positional argument is an ``nn.Module``
  (see :mod:`opacus_dp.privacy_engine_classic`).

Beyond Opacus, ``max_epsilon`` (with ``max_epsilon_delta``) installs a budget guard that
refuses, before anything changes, the step that would push ε above the maximum.
"""

import warnings
from typing import List, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader

from opacus_dp import checkpoint
from opacus_dp.distributed import fsdp_checkpoint
from opacus_dp.distributed.fsdp import is_fully_sharded
from opacus_dp.accountants import create_accountant, get_noise_multiplier
from opacus_dp.accountants.validation import warn_if_delta_not_small
from opacus_dp.data import DPDataLoader, check_sampling, switch_generator
from opacus_dp.data.loader_facts import expected_batch_size_for, fixed_batch_size, planned_steps, sample_rate_of
from opacus_dp.data.sampling_checks import check_batching
from opacus_dp.distributed.checks import share_generator_state
from opacus_dp.engine_setup import (
    adaptive_options,
    check_choice,
    check_opacus_flags,
    check_optimizer_params,
    check_privacy_arguments,
    ghost_criterion,
    make_dp_optimizer,
    refuse_skipped_empty_draws,
    secure_generator,
    unwrap_model,
    validate_module,
    wrap_module,
)
from opacus_dp.engine_wiring import (
    check_distributed,
    check_distributed_loader,
    connect_private_step,
    rebind_if_sharded,
    shard_if_asked,
    warn_if_not_secure,
)
from opacus_dp.grad_sample.mode_selection import MODE_NAMES
from opacus_dp.mechanisms.engine import calibrated_noise_multiplier, plan_mechanism, use_mechanism
from opacus_dp.optim.adaptive_clipping import adaptive_clipper
from opacus_dp.optim.logical_batches import BatchingPolicy
from opacus_dp.privacy_engine_classic import ClassicPrivacyEngine
from opacus_dp.privacy_engine_classic_setup import DEFAULT_ALPHAS  # noqa: F401  (Opacus 0.x's path)
from opacus_dp.validators import ModuleValidator


class _EngineType(type):
    """``isinstance(engine, PrivacyEngine)`` also holds for an engine of the classic API, which
    ``PrivacyEngine(model, ...)`` returns (one ``PrivacyEngine`` class in Opacus 0.x)."""

    def __instancecheck__(cls, instance) -> bool:
        return super().__instancecheck__(instance) or isinstance(instance, ClassicPrivacyEngine)


class PrivacyEngine(metaclass=_EngineType):
    """Modern API entry point (and dispatcher to the classic API, see module doc).

    Args:
        accountant: "prv" (default), "rdp" or "gdp".
        secure_mode: OS-seeded noise and sampling (see :mod:`opacus_dp.optim.noise`).
        max_epsilon: optional budget; a step that would exceed it raises
            :class:`~opacus_dp.errors.PrivacyBudgetExceededError` before changing anything.
        max_epsilon_delta: the δ at which ``max_epsilon`` is measured (required with it).
    """

    def __new__(cls, *args, **kwargs):
        if cls is PrivacyEngine and (args or "module" in kwargs):
            first = args[0] if args else kwargs["module"]
            if not isinstance(first, nn.Module):
                raise TypeError(
                    "PrivacyEngine: the first positional argument must be the model (nn.Module) "
                    "for the classic API; the modern API takes keyword arguments only, e.g. "
                    f"PrivacyEngine(accountant='prv') (got {type(first).__name__})"
                )
            return ClassicPrivacyEngine(*args, **kwargs)  # not a PrivacyEngine: __init__ is not called
        return object.__new__(cls)

    def __init__(self, *, accountant: str = "prv", secure_mode: bool = False,
                 max_epsilon: Optional[float] = None, max_epsilon_delta: Optional[float] = None):
        check_choice(accountant, ("prv", "rdp", "gdp"), "accountant")
        self.accountant = create_accountant(accountant)
        self.secure_mode = bool(secure_mode)
        self.secure_rng = None  # secure randomness is drawn per use, see secure_generator()
        self.dataset = None
        self.max_epsilon = max_epsilon
        self.max_epsilon_delta = max_epsilon_delta
        if max_epsilon is not None and max_epsilon_delta is None:
            raise ValueError("max_epsilon needs max_epsilon_delta (the δ at which ε is measured)")
        self._data_loader = None
        self._mechanism = None  # a correlated noise mechanism's plan (make_private)
        warn_if_not_secure(self.secure_mode)

    # ------------------------------------------------------------------ make_private
    def make_private(self, *, module: nn.Module, optimizer: torch.optim.Optimizer,
                     data_loader: DataLoader, noise_multiplier: float,
                     max_grad_norm: Union[float, List[float]], batch_first: bool = True,
                     loss_reduction: str = "mean", poisson_sampling: bool = True,
                     clipping: str = "flat", noise_generator: Optional[torch.Generator] = None,
                     grad_sample_mode: str = "hooks", criterion=None, wrap_model: bool = True,
                     rand_on_empty: bool = False, target_unclipped_quantile: Optional[float] = None,
                     clipbound_learning_rate: Optional[float] = None,
                     max_clipbound: Optional[float] = None, min_clipbound: Optional[float] = None,
                     unclipped_num_std: Optional[float] = None, step_timeout=None,
                     skip_weight_grads: Optional[bool] = None, noise_mechanism: str = "independent",
                     bands: Optional[int] = None, epochs: Optional[float] = None, fsdp=False,
                     check_sample_independence: bool = True, public_buffers: Sequence[str] = ()):
        """Return ``(GradSampleModule, DPOptimizer, DataLoader)`` ready for private training.

        With ``poisson_sampling`` the loader is replaced by a ``DPDataLoader`` with
        ``q = 1/len(data_loader)``; the expected batch size is ``⌊q·N⌋`` (per process).
        ``grad_sample_mode``: "hooks", "functorch", "ghost", "bk" or "auto" (see
        :mod:`opacus_dp.grad_sample.mode_selection`); Opacus's "ew" (ExpandedWeights) is accepted
        and runs "hooks", which computes the same per-sample gradients for more layers. As in Opacus 1.6, "ghost" returns
        ``(module, optimizer, criterion, data_loader)``, ``criterion`` (default
        ``nn.CrossEntropyLoss()``) wrapped in a ``GhostCriterion`` whose losses' ``backward()``
        runs the memory-lean two-pass backward; other modes ignore it. After ``loss.backward()``
        ``p.grad`` holds the ordinary gradient in "hooks"/"functorch" (as in Opacus) and stays None
        in "bk"/"ghost"; ``skip_weight_grads`` changes that (``True``: a third less backward
        arithmetic for Linear layers in "hooks"/"functorch"; see ``docs/migration.md``).

        Semantics the privacy guarantee relies on (as in Opacus 1.x):

        * step only the returned optimizer: ``optimizer`` itself still takes plain steps on
          the raw (unclipped, un-noised) gradients if called directly;
        * one ``step()`` per batch of the returned loader. Without Poisson sampling, ``k``
          backward passes before one step count as ``k`` batches (the accountant records
          ``k·q``); a step on more samples than that is refused, and with Poisson sampling a
          second backward pass before the step is refused. Cut large batches with
          :class:`~opacus_dp.data.BatchMemoryManager`.

        ``clipping="adaptive"`` (Andrew et al. 2021; :mod:`opacus_dp.optim.adaptive_clipping`):
        ``max_grad_norm`` is the initial bound, which then moves each step towards the
        ``target_unclipped_quantile`` (default ½) of the per-sample norms at the
        ``clipbound_learning_rate`` (default 0.2), within ``[min_clipbound, max_clipbound]``
        (default unlimited), estimated from a count released with noise ``unclipped_num_std``
        (default: expected global batch size / 20). ``noise_multiplier`` stays the σ the
        accountant records; the gradient noise is raised to make up for the released count.

        Opacus 1.6's ``wrap_model`` and ``rand_on_empty`` are accepted: the hooks sit on the
        module's own layers, so the original module trains privately whether it or the returned
        wrapper is called (``wrap_model=False``); empty batches are delivered as empty batches
        in every mode, so ``rand_on_empty=True`` (random data instead) is not needed (a warning
        says so). ``step_timeout`` (DDP/DPDDP, seconds or timedelta): :mod:`opacus_dp.distributed.step_wait`.
        ``noise_mechanism`` "banded" (with ``bands``), "blt" or "tree", for ``epochs`` passes:
        correlated noise (:mod:`opacus_dp.mechanisms`, ``docs/mechanisms.md``).
        A model sharded with FSDP2 (``fully_shard``) is trained with clipped sums reduce-scattered
        into the shards; ``fsdp=True`` (or a dict of ``fully_shard`` options and ``blocks``) shards an
        unsharded model for the user and points ``optimizer`` at the shards (``docs/distributed.md``).
        ``check_sample_independence``, ``public_buffers``: :mod:`opacus_dp.grad_sample.model_checks`.
        """
        check_opacus_flags(wrap_model, rand_on_empty)
        self._mechanism = plan_mechanism(noise_mechanism, data_loader=data_loader, bands=bands, epochs=epochs,
                                         poisson_sampling=poisson_sampling, clipping=clipping)
        check_privacy_arguments(noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
                                loss_reduction=loss_reduction, clipping=clipping)
        adaptive = adaptive_options(clipping, target_unclipped_quantile=target_unclipped_quantile,
                                    clipbound_learning_rate=clipbound_learning_rate,
                                    max_clipbound=max_clipbound, min_clipbound=min_clipbound,
                                    unclipped_num_std=unclipped_num_std)
        check_choice(grad_sample_mode, MODE_NAMES, "grad_sample_mode")
        if noise_generator is not None and self.secure_mode:
            raise ValueError("noise_generator must be None in secure_mode (noise is seeded by the OS)")
        if not isinstance(data_loader, DataLoader):
            raise TypeError(f"data_loader must be a torch DataLoader, got {type(data_loader).__name__}")
        check_optimizer_params(module, optimizer)
        optimizer = rebind_if_sharded(optimizer, shard_if_asked(module, fsdp), module)
        world_size = check_distributed(module)
        check_distributed_loader(data_loader, world_size, poisson_sampling)
        validate_module(module)
        gsm = wrap_module(module, grad_sample_mode=grad_sample_mode, batch_first=batch_first,
                          loss_reduction=loss_reduction, skip_weight_grads=skip_weight_grads)
        try:
            gsm.configure_model_checks(check_sample_independence, public_buffers)
            loader, dp_optimizer = self._private_loader_and_optimizer(
                gsm, module, optimizer, data_loader, noise_multiplier=noise_multiplier,
                max_grad_norm=max_grad_norm, loss_reduction=loss_reduction, clipping=clipping,
                poisson_sampling=poisson_sampling, batch_first=batch_first,
                noise_generator=noise_generator, world_size=world_size, adaptive=adaptive, step_timeout=step_timeout)
        except Exception:
            if gsm is not module:
                gsm.close()
            raise
        self._data_loader = loader
        if grad_sample_mode == "ghost":
            return gsm, dp_optimizer, ghost_criterion(criterion, loss_reduction, gsm, dp_optimizer), loader
        return gsm, dp_optimizer, loader

    def make_private_with_epsilon(self, *, module: nn.Module, optimizer: torch.optim.Optimizer,
                                  data_loader: DataLoader, target_epsilon: float,
                                  target_delta: float, epochs: int,
                                  max_grad_norm: Union[float, List[float]], batch_first: bool = True,
                                  loss_reduction: str = "mean", poisson_sampling: bool = True,
                                  clipping: str = "flat", noise_generator=None,
                                  grad_sample_mode: str = "hooks", criterion=None,
                                  epsilon_tolerance: float = 0.01, wrap_model: bool = True,
                                  rand_on_empty: bool = False,
                                  target_unclipped_quantile: Optional[float] = None,
                                  clipbound_learning_rate: Optional[float] = None,
                                  max_clipbound: Optional[float] = None,
                                  min_clipbound: Optional[float] = None,
                                  unclipped_num_std: Optional[float] = None, step_timeout=None,
                                  skip_weight_grads: Optional[bool] = None, noise_mechanism: str = "independent",
                                  bands: Optional[int] = None, fsdp=False, check_sample_independence: bool = True,
                                  public_buffers: Sequence[str] = (), **epsilon_kwargs):
        """:meth:`make_private` with σ calibrated so that ``epochs`` passes spend ≤ target ε;
        ``epsilon_kwargs`` go to the accountant's ``get_epsilon`` during the calibration (as in
        Opacus: ``alphas`` for RDP, ``eps_error`` for PRV). With ``clipping="adaptive"`` the
        calibrated σ is the total one (the count's share included)."""
        if len(self.accountant) > 0:
            warnings.warn("make_private_with_epsilon: privacy already spent by this engine is not "
                          "included in the calibration; the final epsilon will be higher", UserWarning)
        warn_if_delta_not_small(target_delta, len(data_loader.dataset))
        sample_rate = sample_rate_of(data_loader)
        sigma = calibrated_noise_multiplier(
            noise_mechanism, data_loader=data_loader, bands=bands, epochs=epochs, accountant=self.accountant.mechanism(),
            target_epsilon=target_epsilon, target_delta=target_delta, epsilon_tolerance=epsilon_tolerance,
            **epsilon_kwargs) if noise_mechanism != "independent" else get_noise_multiplier(
                                     target_epsilon=target_epsilon, target_delta=target_delta,
                                     sample_rate=sample_rate, steps=planned_steps(data_loader, epochs),
                                     accountant=self.accountant.mechanism(),
                                     epsilon_tolerance=epsilon_tolerance, **epsilon_kwargs)
        return self.make_private(
            module=module, optimizer=optimizer, data_loader=data_loader, noise_multiplier=sigma,
            max_grad_norm=max_grad_norm, batch_first=batch_first, loss_reduction=loss_reduction,
            poisson_sampling=poisson_sampling, clipping=clipping, noise_generator=noise_generator,
            grad_sample_mode=grad_sample_mode, criterion=criterion, wrap_model=wrap_model,
            rand_on_empty=rand_on_empty, target_unclipped_quantile=target_unclipped_quantile,
            clipbound_learning_rate=clipbound_learning_rate, max_clipbound=max_clipbound,
            min_clipbound=min_clipbound, unclipped_num_std=unclipped_num_std, step_timeout=step_timeout,
            skip_weight_grads=skip_weight_grads, noise_mechanism=noise_mechanism, bands=bands, epochs=epochs,
            fsdp=fsdp, check_sample_independence=check_sample_independence, public_buffers=public_buffers)

    def _private_loader_and_optimizer(self, gsm, module, optimizer, data_loader, *,
                                      noise_multiplier, max_grad_norm, loss_reduction, clipping,
                                      poisson_sampling, batch_first, noise_generator, world_size,
                                      adaptive=None, step_timeout=None):
        if poisson_sampling:
            gsm.forbid_grad_accumulation()
        loader = self._prepare_data_loader(data_loader, poisson_sampling=poisson_sampling,
                                           distributed=world_size > 1, batch_first=batch_first)
        sample_rate = sample_rate_of(loader)
        expected_batch_size = expected_batch_size_for(len(loader.dataset), sample_rate)
        if adaptive is not None:
            clipping = adaptive_clipper(max_grad_norm, expected_batch_size=expected_batch_size, **adaptive)
        if world_size > 1:
            expected_batch_size = expected_batch_size / world_size
        # Poisson batches: one per step, split only by BatchMemoryManager; fixed-size batches:
        # a step may not combine more than one
        batching = BatchingPolicy(poisson_batches=True) if poisson_sampling else \
            BatchingPolicy(max_batch_size=fixed_batch_size(loader))
        dp_optimizer = make_dp_optimizer(
            optimizer, grad_sample_module=gsm, noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm, expected_batch_size=expected_batch_size,
            loss_reduction=loss_reduction, clipping=clipping, generator=noise_generator,
            secure_mode=self.secure_mode, batching=batching,
        )
        self._connect(module, dp_optimizer, sample_rate, step_timeout)  # all ranks agree from here on
        if poisson_sampling and world_size > 1:
            share_generator_state(loader.generator)  # one global Poisson stream
        return loader, dp_optimizer

    def _prepare_data_loader(self, data_loader, *, poisson_sampling, distributed, batch_first):
        self.dataset = data_loader.dataset
        generator = secure_generator() if self.secure_mode else None
        if self._mechanism is not None:  # the sampling its analysis needs (opacus_dp.mechanisms.engine)
            return self._mechanism.loader(data_loader, generator=generator, distributed=distributed, batch_first=batch_first)
        if poisson_sampling:
            return DPDataLoader.from_data_loader(data_loader, generator=generator,
                                                 distributed=distributed, batch_first=batch_first)
        check_batching(data_loader, "make_private(poisson_sampling=False)")
        refuse_skipped_empty_draws(data_loader)
        check_sampling(data_loader, poisson_expected=False)
        if generator is None:
            return data_loader
        try:
            return switch_generator(data_loader=data_loader, generator=generator)
        except ValueError as error:  # nothing random to secure (e.g. a SequentialSampler)
            raise ValueError(
                f"secure_mode=True: the loader's batches are not drawn with a generator that "
                f"could be replaced by the secure one ({error}); use poisson_sampling=True "
                "(recommended) or a shuffled loader (shuffle=True)") from None

    def _connect(self, module, dp_optimizer, sample_rate: float, step_timeout=None) -> None:
        """Distributed reduction, budget guard and accountant (see :mod:`opacus_dp.engine_wiring`)."""
        connect_private_step(module, dp_optimizer, accountant=self.accountant, sample_rate=sample_rate,
                             step_timeout=step_timeout, max_epsilon=self.max_epsilon,
                             mechanism=use_mechanism(self._mechanism, dp_optimizer, self.accountant),
                             max_epsilon_delta=self.max_epsilon_delta, epsilon_of=self._budget_epsilon)

    def _budget_epsilon(self, accountant) -> float:
        return float(accountant.get_epsilon(self.max_epsilon_delta))

    # ------------------------------------------------------------------ reporting
    def get_epsilon(self, delta: float) -> float:
        """ε spent so far at ``delta``, according to the accountant."""
        return float(self.accountant.get_epsilon(delta))

    # ------------------------------------------------------------------ compatibility
    def is_compatible(self, *, module: nn.Module, optimizer=None, data_loader=None) -> bool:
        """True if ``module`` can be trained privately as it is."""
        return ModuleValidator.is_valid(unwrap_model(module))

    def validate(self, *, module: nn.Module, optimizer=None, data_loader=None) -> None:
        """Like :meth:`is_compatible` but raises the validator's error."""
        validate_module(module)

    @classmethod
    def get_compatible_module(cls, module: nn.Module) -> nn.Module:
        """A fixed copy of ``module`` (BatchNorm → GroupNorm, ...), validated."""
        return ModuleValidator.fix_and_validate(module)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, *, path, module: nn.Module, optimizer=None, noise_scheduler=None,
                        grad_clip_scheduler=None, checkpoint_dict=None, data_loader=None,
                        module_state_dict_kwargs=None, torch_save_kwargs=None, signing_key=None) -> None:
        """Save model (unwrapped keys), optimizer, accountant and generator states to ``path``;
        ``signing_key`` (bytes, kept by the user) adds an HMAC that :meth:`load_checkpoint` verifies.
        Every entry must be loadable by torch's safe loader (checked before writing). For a model
        sharded with FSDP2, ``path`` is a directory written by every rank
        (:mod:`~opacus_dp.distributed.fsdp_checkpoint`)."""
        if is_fully_sharded(module):
            return self._sharded_checkpoint(fsdp_checkpoint.save, path, module, optimizer, data_loader,
                                            noise_scheduler, grad_clip_scheduler, signing_key,
                                            checkpoint_dict=checkpoint_dict)
        checkpoint.save(
            path, module=module, optimizer=optimizer, accountant=self.accountant,
            data_loader=data_loader if data_loader is not None else self._data_loader,
            schedulers={"noise_scheduler": noise_scheduler, "grad_clip_scheduler": grad_clip_scheduler},
            checkpoint_dict=checkpoint_dict, module_state_dict_kwargs=module_state_dict_kwargs,
            torch_save_kwargs=torch_save_kwargs, secure_mode=self.secure_mode, signing_key=signing_key,
        )

    def load_checkpoint(self, *, path, module: nn.Module, optimizer=None, noise_scheduler=None,
                        grad_clip_scheduler=None, data_loader=None, map_location=None,
                        module_load_dict_kwargs=None, torch_load_kwargs=None, signing_key=None) -> dict:
        """Restore what :meth:`save_checkpoint` saved; returns the remaining checkpoint entries.
        Loads with ``weights_only=True`` (``torch_load_kwargs={"weights_only": False}`` opts out for
        trusted old files); with ``signing_key`` an unsigned or altered file is refused."""
        checkpoint.refuse_unfinished_logical_batch(optimizer)  # before any collective of FSDP2
        if is_fully_sharded(module):
            return self._sharded_checkpoint(fsdp_checkpoint.load, path, module, optimizer, data_loader,
                                            noise_scheduler, grad_clip_scheduler, signing_key)
        return checkpoint.load(
            path, module=module, optimizer=optimizer, accountant=self.accountant,
            data_loader=data_loader if data_loader is not None else self._data_loader,
            schedulers={"noise_scheduler": noise_scheduler, "grad_clip_scheduler": grad_clip_scheduler},
            map_location=map_location, module_load_dict_kwargs=module_load_dict_kwargs,
            torch_load_kwargs=torch_load_kwargs, secure_mode=self.secure_mode, signing_key=signing_key,
        )

    def _sharded_checkpoint(self, action, path, module, optimizer, data_loader, noise_scheduler,
                            grad_clip_scheduler, signing_key, **extra):
        return action(path, module=module, optimizer=optimizer, accountant=self.accountant,
                      rank=dist.get_rank(), world_size=dist.get_world_size(),
                      data_loader=data_loader if data_loader is not None else self._data_loader,
                      schedulers={"noise_scheduler": noise_scheduler, "grad_clip_scheduler": grad_clip_scheduler},
                      secure_mode=self.secure_mode, signing_key=signing_key, **extra)
