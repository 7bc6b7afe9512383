"""Private (DP-SGD) training with PyTorch Lightning (``lightning`` 2.x).

Two pieces, both needed:

* ``train_dataloader()`` returns ``PrivateDataLoader(DataLoader(dataset, batch_size=B, ...))``
  (:mod:`~opacus_dp.integrations.lightning_loader`). Once training starts it yields **Poisson
  batches**: at each step every example is in the batch independently with probability
  ``q = 1/len(DataLoader(...))`` (≈ B/N), and an epoch has that many steps. Under DDP the ranks
  draw disjoint parts of one global sample, so ``B`` is the expected batch of all processes
  together. Iterating it without :class:`DPCallback` raises, so a run cannot silently train
  without privacy.
* ``Trainer(callbacks=[DPCallback(...)])``: when training starts (``on_train_start``) the callback
  makes the model Lightning trains (the ``LightningModule``, or Lightning's DDP wrapper of it), its
  one optimizer and the loader private (:meth:`PrivacyEngine.make_private`), and the Trainer then
  steps the private optimizer. One optimizer step is one Poisson batch, and it applies

      (Σ_i clip_C(∇ℓ_i) + N(0, σ²C²)) / (q·N),    clip_C(g) = g · min(1, C/‖g‖₂),

  where ``ℓ_i`` are the per-example losses whose mean ``training_step`` returns. Under DDP the
  clipped sums of all ranks are added in one all-reduce and the noise is added once.

``epsilon`` (at ``target_delta``) is logged with ``pl_module.log`` after every step. With
``max_epsilon`` (default ``target_epsilon``) the callback sets ``trainer.should_stop`` after the
last step that keeps ε ≤ ``max_epsilon`` (and before the first step if none fits); the engine's
budget guard refuses such a step in any case. Model checks as in ``make_private``
(:mod:`~opacus_dp.integrations.lightning_checks`). The accountant, step count, noise and sampler
generators travel in Lightning checkpoints (:mod:`~opacus_dp.integrations.lightning_state`), the
loader's place in its epoch too: ``trainer.fit(..., ckpt_path=...)`` from a checkpoint written at
the end of an epoch or of a training batch continues a seeded run exactly as if it had not stopped.

A module Lightning compiles (``trainer.fit(torch.compile(module))``) has its hooked layers traced
into the compiled ``training_step`` (:mod:`~opacus_dp.integrations.lightning_compile`).

Refused up front (:class:`UnsupportedLightningSetupError`): several optimizers, manual optimization,
``training_step(dataloader_iter)``, ``accumulate_grad_batches > 1`` (or a
``GradientAccumulationScheduler``), ``reload_dataloaders_every_n_epochs``, ``gradient_clip_val``
(clipping is per example here), ``min_epochs``/``min_steps`` with a budget (they override the
stop), a train loader that is not a :class:`PrivateDataLoader`, correlated noise mechanisms
(Lightning fetches the next batch before the step, which their schedule forbids). A
``training_step`` returning ``None`` (a skipped batch) is refused at its step.
"""

import inspect
import math
from typing import Optional, Sequence

import torch

from opacus_dp.engine.budget_guard import BudgetGuard
from opacus_dp.engine.fast_noise import FastNoise, fast_noise_setting
from opacus_dp.engine.modern import PrivacyEngine
from opacus_dp.errors import PrivacyBudgetExceededError, UnsupportedError
from opacus_dp.integrations.lightning_checks import LightningModelChecks
from opacus_dp.integrations.lightning_compile import CompiledStepTaps
from opacus_dp.integrations.lightning_loader import PrivateDataLoader
from opacus_dp.integrations.lightning_state import (STATE_KEY, check_private_state, private_state,
                                                    restore_private_state)

try:
    import lightning.pytorch as pl
except ImportError as error:  # an optional dependency: say which package to install
    raise ImportError("opacus_dp.integrations.lightning needs PyTorch Lightning 2.x: pip install lightning") from error

__all__ = ["DPCallback", "PrivateDataLoader", "UnsupportedLightningSetupError"]


class UnsupportedLightningSetupError(UnsupportedError):
    """The Trainer or LightningModule is set up in a way DPCallback cannot train privately."""


class DPCallback(pl.Callback):
    """Makes a Lightning training run private (module doc).

    Args:
        target_delta: δ of the reported (ε, δ); much smaller than 1/N.
        max_grad_norm: C, the bound of each example's gradient norm.
        noise_multiplier: σ; give it or ``target_epsilon`` (with ``epochs``).
        target_epsilon: σ is calibrated so that ``epochs`` epochs spend at most this ε.
        epochs: the planned epochs for ``target_epsilon``.
        max_epsilon: stop before a step would take ε (at ``target_delta``) above it (default
            ``target_epsilon``; None with ``noise_multiplier``: no stop).
        grad_sample_mode: "bk" (default), "hooks", "functorch" or "auto" ("ghost" needs its own loss
            object, which ``training_step`` does not use: "bk" computes the same norms in one pass).
        accountant: "prv" (default), "rdp" or "gdp".
        secure_mode: sampling and noise seeded by the OS (generator states are then not saved).
        noise_mechanism: only "independent" (DP-SGD) is supported here.
        fast_noise: the noise generator, as ``make_private``'s (``False``: torch's; ``True``: parallel
            threads on CPU; ``"philox"``: counter-based, drawn and added in one pass; or the names
            "off", "threads", "philox"). A checkpoint resumes with its own.
        check_sample_independence: refuse a model whose samples mix, or that writes a buffer during
            a training step (:mod:`~opacus_dp.integrations.lightning_checks`); True as in ``make_private``.
        public_buffers: names (as in ``pl_module.named_buffers()``) of buffers that may be written.
        log_epsilon_every_n_steps: log ε after every ``n``-th step (and the last step of each
            epoch and of the run) instead of after every step: each value is one accountant
            evaluation (tens of milliseconds with "prv"). Between, the logged value is the last one.
    """

    def __init__(self, *, target_delta: float, max_grad_norm: float, noise_multiplier: Optional[float] = None,
                 target_epsilon: Optional[float] = None, epochs: Optional[float] = None,
                 max_epsilon: Optional[float] = None, grad_sample_mode: str = "bk", accountant: str = "prv",
                 secure_mode: bool = False, noise_mechanism: str = "independent", fast_noise: FastNoise = False,
                 check_sample_independence: bool = True, public_buffers: Sequence[str] = (),
                 log_epsilon_every_n_steps: int = 1):
        _check_arguments(target_delta, noise_multiplier, target_epsilon, epochs, grad_sample_mode, noise_mechanism)
        self.max_epsilon = _checked_budget(target_epsilon if max_epsilon is None else max_epsilon)
        self.check_sample_independence, self.public_buffers = _checked_model_checks(check_sample_independence,
                                                                                    public_buffers)
        self.log_epsilon_every_n_steps = _checked_log_steps(log_epsilon_every_n_steps)
        self.target_delta = float(target_delta)
        self.max_grad_norm = max_grad_norm
        self.noise_multiplier = noise_multiplier
        self.target_epsilon = target_epsilon
        self.epochs = epochs
        self.grad_sample_mode = grad_sample_mode
        self.secure_mode = bool(secure_mode)
        self.fast_noise = fast_noise_setting(fast_noise, "DPCallback")
        self.privacy_engine = PrivacyEngine(
            accountant=accountant, secure_mode=secure_mode, max_epsilon=self.max_epsilon,
            max_epsilon_delta=None if self.max_epsilon is None else self.target_delta)
        self.optimizer = None  # the DPOptimizer, once training started
        self.loader: Optional[PrivateDataLoader] = None
        self._module = None  # the per-sample wrapper, closed at teardown
        self._checks: Optional[LightningModelChecks] = None
        self._taps: Optional[CompiledStepTaps] = None
        self._budget: Optional[BudgetGuard] = None
        self._resumed_state: Optional[dict] = None
        self._backward_seen = False  # whether this batch's training_step gave a loss

    # ------------------------------------------------------------------ making the run private
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.optimizer is not None:
            raise UnsupportedLightningSetupError(
                "DPCallback: this callback already trained a run; use a new DPCallback for each Trainer.fit "
                "(resume with trainer.fit(..., ckpt_path=...) to continue the privacy accounting)")
        _refuse_unsupported(trainer, pl_module, budget=self.max_epsilon is not None)
        self.loader = _private_loader_of(trainer)
        self._checks = LightningModelChecks(pl_module, enabled=self.check_sample_independence,
                                            public_buffers=self.public_buffers)
        self._make_private(trainer)
        self._taps = CompiledStepTaps(self._module, pl_module)
        if self._resumed_state is not None:
            restore_private_state(self._resumed_state, optimizer=self.optimizer,
                                  accountant=self.privacy_engine.accountant,
                                  sampler_generator=self.loader.private_loader.generator, secure_mode=self.secure_mode)
            self._resumed_state = None
        if self.max_epsilon is not None:
            self._budget = BudgetGuard(self.privacy_engine.accountant, max_epsilon=self.max_epsilon,
                                       delta=self.target_delta, sample_rate=self.loader.private_loader.sample_rate)
            self._stop_if_budget_spent(trainer)

    def _make_private(self, trainer: "pl.Trainer") -> None:
        # make_private's own model checks would hook the model Lightning trains, whose forward under DDP
        # runs training_step (with the user's side effects) and on one process is never called:
        # LightningModelChecks runs them where the batch enters modules instead.
        common = dict(module=trainer.model, optimizer=trainer.optimizers[0], data_loader=self.loader.data_loader,
                      max_grad_norm=self.max_grad_norm, grad_sample_mode=self.grad_sample_mode,
                      check_sample_independence=False, fast_noise=self.fast_noise)
        if self.target_epsilon is None:
            module, optimizer, loader = self.privacy_engine.make_private(
                noise_multiplier=self.noise_multiplier, **common)
        else:
            module, optimizer, loader = self.privacy_engine.make_private_with_epsilon(
                target_epsilon=self.target_epsilon, target_delta=self.target_delta, epochs=self.epochs, **common)
        self._module, self.optimizer = module, optimizer
        self.loader.use_private_loader(loader, keep_generator_states=not self.secure_mode)
        trainer.optimizers = [optimizer]  # the Trainer steps the private optimizer from now on

    # ------------------------------------------------------------------ each step
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        """Refuse a batch that is not the loader's next one (the sample stream would differ from
        the saved run's), and note the buffers' versions."""
        if batch_idx != self.loader.position - 1:
            raise UnsupportedLightningSetupError(
                f"DPCallback: Lightning runs batch {batch_idx} of the epoch, but the private loader has handed "
                f"out {self.loader.position} batches of it, so the Poisson batches (and the noise) would not "
                "continue the saved run's. Resume from a checkpoint written at the end of a training batch or "
                "of an epoch (ModelCheckpoint(every_n_train_steps=...) or its default)")
        self._checks.batch_starts()
        self._taps.before_step(batch)
        self._backward_seen = False

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._taps.after_step()
        self._checks.before_backward()
        self._backward_seen = True

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        """Refuse a step whose ``training_step`` returned no loss (a skipped batch)."""
        if not self._backward_seen:
            raise UnsupportedLightningSetupError(
                "DPCallback: training_step returned None, which skips the batch; whether a Poisson batch "
                "is skipped depends on its data, so every batch must be a private step. Return the loss "
                "of every batch (an empty batch gives a loss whose gradient is zero)")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._taps.after_step(completed=False)  # no backward pass followed the step (no loss)
        self._stop_if_budget_spent(trainer)
        if self._epsilon_due(trainer):
            pl_module.log("epsilon", self.get_epsilon(), on_step=True, on_epoch=False, prog_bar=True, batch_size=1)

    def _epsilon_due(self, trainer: "pl.Trainer") -> bool:
        """Whether ε is logged after this step: every ``log_epsilon_every_n_steps``-th step, the last
        step of an epoch and the last of the run."""
        last_of_run = trainer.should_stop or 0 < trainer.max_steps <= trainer.global_step
        return trainer.global_step % self.log_epsilon_every_n_steps == 0 or trainer.is_last_batch or last_of_run

    def _stop_if_budget_spent(self, trainer: "pl.Trainer") -> None:
        """``trainer.should_stop`` if one more step would take ε above ``max_epsilon``."""
        if self._budget is None:
            return
        try:
            self._budget.check(float(self.optimizer.noise_multiplier), self._budget.sample_rate())
        except PrivacyBudgetExceededError:
            trainer.should_stop = True

    def on_exception(self, trainer, pl_module, exception) -> None:
        if self._taps is not None:
            self._taps.after_step(completed=False)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        """Remove the per-sample and check hooks once fitting ends (the model then runs as a plain module)."""
        if self._taps is not None:
            self._taps.after_step(completed=False)
        if self._checks is not None:
            self._checks.remove()
        if self._module is not None and hasattr(self._module, "close") and self._module is not trainer.model:
            self._module.close()
        self._module = None

    # ------------------------------------------------------------------ reporting
    def get_epsilon(self) -> float:
        """ε spent so far at ``target_delta`` (0 before the first step)."""
        return float(self.privacy_engine.get_epsilon(self.target_delta))

    # ------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        if self.optimizer is not None:
            checkpoint[STATE_KEY] = private_state(
                optimizer=self.optimizer, accountant=self.privacy_engine.accountant,
                sampler_generator=self.loader.private_loader.generator, secure_mode=self.secure_mode)

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        """Keep the checkpoint's private state (checked now) for ``on_train_start``."""
        if trainer.state.fn != "fit":
            return
        self._resumed_state = check_private_state(checkpoint)


def _check_arguments(target_delta, noise_multiplier, target_epsilon, epochs, grad_sample_mode,
                     noise_mechanism) -> None:
    if (noise_multiplier is None) == (target_epsilon is None):
        raise ValueError("DPCallback: give exactly one of noise_multiplier (sigma) and target_epsilon "
                         f"(got noise_multiplier={noise_multiplier!r}, target_epsilon={target_epsilon!r})")
    if not _real(target_delta) or not 0 < target_delta < 1:
        raise ValueError(f"DPCallback: target_delta must lie in (0, 1), got {target_delta!r}")
    if target_epsilon is not None and not (_real(epochs) and epochs > 0):
        raise ValueError("DPCallback: target_epsilon needs epochs (the planned number of epochs, > 0) "
                         f"to calibrate sigma, got epochs={epochs!r}")
    if grad_sample_mode == "ghost":
        raise UnsupportedLightningSetupError(
            "DPCallback: grad_sample_mode='ghost' needs the loss computed by the criterion make_private returns, "
            "which training_step does not use; grad_sample_mode='bk' computes the same clipped step in one pass")
    if noise_mechanism != "independent":
        raise UnsupportedLightningSetupError(
            f"DPCallback: noise_mechanism={noise_mechanism!r} is not supported: Lightning fetches the next "
            "batch before each step, which the schedule of correlated noise forbids. Use "
            "noise_mechanism='independent', or make_private in your own training loop")


def _checked_budget(max_epsilon) -> Optional[float]:
    if max_epsilon is not None and not (_real(max_epsilon) and max_epsilon > 0):
        raise ValueError(f"DPCallback: max_epsilon must be a finite number > 0 (or None: no stop), got {max_epsilon!r}")
    return None if max_epsilon is None else float(max_epsilon)


def _checked_model_checks(check_sample_independence, public_buffers):
    if not isinstance(check_sample_independence, bool):
        raise TypeError(f"DPCallback: check_sample_independence must be a bool, got {check_sample_independence!r}")
    if isinstance(public_buffers, str) or not all(isinstance(n, str) for n in public_buffers):
        raise TypeError("DPCallback: public_buffers must be a list of buffer names (as in "
                        f"pl_module.named_buffers(), e.g. ['net.stats']), got {public_buffers!r}")
    return check_sample_independence, tuple(public_buffers)


def _checked_log_steps(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"DPCallback: log_epsilon_every_n_steps must be an int >= 1, got {n!r}")
    return n


def _real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _refuse_unsupported(trainer: "pl.Trainer", pl_module: "pl.LightningModule", budget: bool) -> None:
    optimizers = trainer.optimizers
    refusals = {
        f"{len(optimizers)} optimizers from configure_optimizers (one is needed)": len(optimizers) != 1,
        "manual optimization (automatic_optimization=False)": not pl_module.automatic_optimization,
        "training_step(dataloader_iter) (each step takes one Poisson batch)":
            "dataloader_iter" in inspect.signature(pl_module.training_step).parameters,
        f"accumulate_grad_batches={trainer.accumulate_grad_batches} (each step is one Poisson batch; "
        "raise the batch size instead)": trainer.accumulate_grad_batches != 1,
        "a GradientAccumulationScheduler callback (each step is one Poisson batch)":
            any(isinstance(c, pl.callbacks.GradientAccumulationScheduler) for c in trainer.callbacks),
        f"reload_dataloaders_every_n_epochs={trainer.reload_dataloaders_every_n_epochs} (the reloaded loader "
        "would not be the one made private; the PrivateDataLoader draws new Poisson batches every epoch)":
            bool(trainer.reload_dataloaders_every_n_epochs),
        f"gradient_clip_val={trainer.gradient_clip_val} (clipping is per example, max_grad_norm)":
            trainer.gradient_clip_val is not None,
        "min_epochs or min_steps with max_epsilon (they would keep training past the budget stop)":
            budget and bool(trainer.fit_loop.min_epochs or trainer.fit_loop.min_steps),
    }
    found = [name for name, present in refusals.items() if present]
    if found:
        raise UnsupportedLightningSetupError(f"DPCallback does not support {'; '.join(found)}")
    optimizer = optimizers[0]
    trainable = [p for group in getattr(optimizer, "param_groups", []) for p in group["params"] if p.requires_grad]
    if not isinstance(optimizer, torch.optim.Optimizer) or not trainable:
        raise UnsupportedLightningSetupError(
            "DPCallback: configure_optimizers must return one torch.optim.Optimizer over the module's "
            f"trainable parameters, got {type(optimizer).__name__} with {len(trainable)} trainable tensors")


def _private_loader_of(trainer: "pl.Trainer") -> PrivateDataLoader:
    loader = trainer.train_dataloader
    if not isinstance(loader, PrivateDataLoader):
        raise UnsupportedLightningSetupError(
            f"DPCallback: the train loader is a {type(loader).__name__}, not a PrivateDataLoader, so its "
            "batches would not be Poisson samples (the privacy analysis assumes them). Return "
            "PrivateDataLoader(DataLoader(dataset, batch_size=...)) from train_dataloader() (one loader)")
    return loader
