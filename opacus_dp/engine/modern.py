"""PrivacyEngine: wires model, optimizer, data loader and accountant for DP-SGD.

Two APIs share this entry point:

* modern (Opacus 1.x): ``PrivacyEngine(accountant="prv")`` then ``make_private(...)`` /
  ``make_private_with_epsilon(...)``, ``get_epsilon(delta)``, ``save_checkpoint`` /
  ``load_checkpoint``;
* classic (Opacus 0.x): ``PrivacyEngine(model, batch_size, sample_size, ...)`` then
  ``attach(optimizer)`` — selected when the first positional argument is an ``nn.Module``
  (see :mod:`opacus_dp.engine.classic`).

Beyond Opacus, ``max_epsilon`` (with ``max_epsilon_delta``) installs a budget guard that
refuses, before anything changes, the step that would push ε above the maximum.
"""

from typing import List, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader

from opacus_dp.accountants import create_accountant
from opacus_dp.engine.privacy_units import unit_epsilon
from opacus_dp.accountants.registry import available_accountants
from opacus_dp.checkpoints import sharded, single_file
from opacus_dp.distributed.fsdp import is_fully_sharded
from opacus_dp.engine.arguments import check_choice
from opacus_dp.engine.assembly import assemble, mechanism_of
from opacus_dp.engine.calibration import calibrated_plan
from opacus_dp.engine.classic import ClassicPrivacyEngine
from opacus_dp.engine.model import validate_module
from opacus_dp.engine.optimizer import ghost_criterion
from opacus_dp.engine.plan import PrivatePlan
from opacus_dp.engine.private_step import connect_private_step, warn_if_not_secure
from opacus_dp.engine.read_once import setting_read_once
from opacus_dp.model_wrappers import unwrap_model
from opacus_dp.validators import ModuleValidator


class _EngineType(type):
    """``isinstance(engine, PrivacyEngine)`` also holds for an engine of the classic API, which
    ``PrivacyEngine(model, ...)`` returns (one ``PrivacyEngine`` class in Opacus 0.x)."""

    def __instancecheck__(cls, instance) -> bool:
        return super().__instancecheck__(instance) or isinstance(instance, ClassicPrivacyEngine)


class PrivacyEngine(metaclass=_EngineType):
    """Modern API entry point (and dispatcher to the classic API, see module doc).

    Args:
        accountant: "prv" (default), "rdp", "gdp" or one registered with ``register_accountant``.
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

    _BUILT_BY_MAKE_PRIVATE = dict(in_use=lambda engine: getattr(engine, "_data_loader", None) is not None, fix=(
        "make_private gave the budget guard its {name}; pass it to PrivacyEngine(...) before make_private"))
    max_epsilon = setting_read_once("max_epsilon", **_BUILT_BY_MAKE_PRIVATE)
    max_epsilon_delta = setting_read_once("max_epsilon_delta", **_BUILT_BY_MAKE_PRIVATE)

    def __init__(self, *, accountant: str = "prv", secure_mode: bool = False,
                 max_epsilon: Optional[float] = None, max_epsilon_delta: Optional[float] = None):
        check_choice(accountant, available_accountants(), "accountant")  # registered ones included
        self.accountant = create_accountant(accountant)
        self.secure_mode = bool(secure_mode)
        self.secure_rng = None  # secure randomness is drawn per use, see secure_generator()
        self.dataset = None
        self.max_epsilon = max_epsilon
        self.max_epsilon_delta = max_epsilon_delta
        if max_epsilon is not None and max_epsilon_delta is None:
            raise ValueError("max_epsilon needs max_epsilon_delta (the δ at which ε is measured)")
        self._data_loader = None
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
                     check_sample_independence: bool = True, public_buffers: Sequence[str] = (),
                     fast_noise: Union[bool, str] = False, privacy_unit: str = "example", user_ids=None,
                     max_examples_per_user: Optional[int] = None, augmentation_multiplicity: int = 1,
                     unit_gradient: str = "mean"):
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
        ``fast_noise=True`` draws the noise on CPU by several threads, ``fast_noise="philox"`` from a
        counter-based generator fused with the add, at memory speed (other streams of the same
        distribution: :mod:`opacus_dp.optim.parallel_noise`, :mod:`opacus_dp.optim.philox_noise`).
        ``privacy_unit="user"`` with ``user_ids`` (and ``max_examples_per_user``, ``unit_gradient``), or
        ``augmentation_multiplicity=K``: the privacy unit is several rows (:mod:`opacus_dp.engine.privacy_units`,
        ``docs/user_level.md``).
        """
        plan = PrivatePlan.of(locals(), secure_mode=self.secure_mode)
        return self._make_private(plan, module, optimizer, data_loader)

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
                                  public_buffers: Sequence[str] = (), fast_noise: Union[bool, str] = False,
                                  privacy_unit: str = "example", user_ids=None,
                                  max_examples_per_user: Optional[int] = None, augmentation_multiplicity: int = 1,
                                  unit_gradient: str = "mean", **epsilon_kwargs):
        """:meth:`make_private` with σ calibrated so that ``epochs`` passes spend ≤ target ε;
        ``epsilon_kwargs`` go to the accountant's ``get_epsilon`` during the calibration (as in
        Opacus: ``alphas`` for RDP, ``eps_error`` for PRV). With ``clipping="adaptive"`` the
        calibrated σ is the total one (the count's share included)."""
        plan = PrivatePlan.of({**locals(), "noise_multiplier": 0.0}, secure_mode=self.secure_mode)
        mechanism = self._mechanism_of(plan, data_loader)
        plan = calibrated_plan(plan, data_loader=data_loader, mechanism=mechanism, accountant=self.accountant,
                               target_epsilon=target_epsilon, target_delta=target_delta, epochs=epochs,
                               epsilon_tolerance=epsilon_tolerance, **epsilon_kwargs)
        return self._make_private(plan, module, optimizer, data_loader, mechanism)

    def _mechanism_of(self, plan: PrivatePlan, data_loader):
        if not isinstance(data_loader, DataLoader):
            raise TypeError(f"data_loader must be a torch DataLoader, got {type(data_loader).__name__}")
        return mechanism_of(plan, data_loader)

    def _make_private(self, plan: PrivatePlan, module, optimizer, data_loader, mechanism=False):
        """The run of ``plan`` (:mod:`~opacus_dp.engine.assembly`); ``mechanism``: the correlated
        mechanism's plan if calibration computed it (False: plan it here)."""
        if mechanism is False:
            mechanism = self._mechanism_of(plan, data_loader)
        self.dataset = data_loader.dataset
        use_unit = getattr(self.accountant, "use_privacy_unit", None)
        if use_unit is not None:
            use_unit(plan.privacy_unit)
        elif plan.privacy_unit != "example":
            raise TypeError(f"privacy_unit={plan.privacy_unit!r} needs an accountant derived from PrivacyAccountant")
        gsm, dp_optimizer, loader = assemble(plan, module=module, optimizer=optimizer, data_loader=data_loader,
                                             mechanism=mechanism, connect=self._connect)
        self._data_loader = loader
        if plan.grad_sample_mode == "ghost":
            return gsm, dp_optimizer, ghost_criterion(plan.criterion, plan.loss_reduction, gsm, dp_optimizer), loader
        return gsm, dp_optimizer, loader

    def _connect(self, module, dp_optimizer, sample_rate: float, mechanism) -> None:
        """Distributed reduction, budget guard and accountant (:mod:`opacus_dp.engine.private_step`)."""
        connect_private_step(module, dp_optimizer, accountant=self.accountant, sample_rate=sample_rate,
                             mechanism=mechanism, max_epsilon=self.max_epsilon,
                             max_epsilon_delta=self.max_epsilon_delta, epsilon_of=self._budget_epsilon)

    def _budget_epsilon(self, accountant) -> float:
        return float(accountant.get_epsilon(self.max_epsilon_delta))

    # ------------------------------------------------------------------ reporting
    def get_epsilon(self, delta: float, privacy_unit: Optional[str] = None,
                    max_examples_per_user: Optional[int] = None) -> float:
        """ε spent so far at ``delta`` for the run's privacy unit (the accountant's: per example, or per
        user for a run sampled by users); an example-level run's ``privacy_unit="user"`` is per user with
        at most ``max_examples_per_user`` examples (group privacy, ``docs/user_level.md``)."""
        return float(unit_epsilon(self.accountant.get_epsilon, delta, self.accountant.privacy_unit, privacy_unit,
                                  max_examples_per_user))

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
        (:mod:`~opacus_dp.checkpoints.sharded`)."""
        if is_fully_sharded(module):
            return self._sharded_checkpoint(sharded.save, path, module, optimizer, data_loader,
                                            noise_scheduler, grad_clip_scheduler, signing_key,
                                            checkpoint_dict=checkpoint_dict)
        single_file.save(
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
        single_file.refuse_unfinished_logical_batch(optimizer)  # before any collective of FSDP2
        if is_fully_sharded(module):
            return self._sharded_checkpoint(sharded.load, path, module, optimizer, data_loader,
                                            noise_scheduler, grad_clip_scheduler, signing_key)
        return single_file.load(
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
