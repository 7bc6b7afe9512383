"""Private (DP-SGD) training with PyTorch Lightning (``lightning`` 2.x).

Two pieces, both needed:

* ``train_dataloader()`` returns ``PrivateDataLoader(DataLoader(dataset, batch_size=B, ...))``.
  Once training starts it yields **Poisson batches**: at each step every example is in the batch
  independently with probability ``q = 1/len(DataLoader(...))`` (≈ B/N), and an epoch has that many
  steps. Under DDP the ranks draw disjoint parts of one global sample, so ``B`` is the expected
  batch of all processes together. Iterating it without :class:`DPCallback` raises, so a run cannot
  silently train without privacy.
* ``Trainer(callbacks=[DPCallback(...)])``: when training starts (``on_train_start``) the callback
  makes the model Lightning trains (the ``LightningModule``, or Lightning's DDP wrapper of it), its
  one optimizer and the loader private (:meth:`PrivacyEngine.make_private`), and the Trainer then
  steps the private optimizer. One optimizer step is one Poisson batch, and it applies

      (Σ_i clip_C(∇ℓ_i) + N(0, σ²C²)) / (q·N),    clip_C(g) = g · min(1, C/‖g‖₂),

  where ``ℓ_i`` are the per-example losses whose mean ``training_step`` returns. Under DDP the
  clipped sums of all ranks are added in one all-reduce and the noise is added once.

``epsilon`` (at ``target_delta``) is logged with ``pl_module.log`` after every step. The accountant,
step count, noise and sampler generators travel in Lightning checkpoints
(:mod:`~opacus_dp.integrations.lightning_state`); ``trainer.fit(..., ckpt_path=...)`` from a checkpoint
written at the end of an epoch continues a seeded run exactly as if it had not stopped.

Refused up front (:class:`UnsupportedLightningSetupError`): several optimizers, manual optimization,
``accumulate_grad_batches > 1``, ``gradient_clip_val`` (clipping is per example here), a train loader
that is not a :class:`PrivateDataLoader`, correlated noise mechanisms (Lightning fetches the next batch
before the step, which their schedule forbids).
"""

import math
from typing import Optional

import torch
from torch.utils.data import DataLoader

from opacus_dp.errors import UnsupportedError
from opacus_dp.integrations.lightning_state import (STATE_KEY, check_private_state, private_state,
                                                    restore_private_state)
from opacus_dp.engine.modern import PrivacyEngine

try:
    import lightning.pytorch as pl
except ImportError as error:  # an optional dependency: say which package to install
    raise ImportError("opacus_dp.integrations.lightning needs PyTorch Lightning 2.x: pip install lightning") from error

__all__ = ["DPCallback", "PrivateDataLoader", "UnsupportedLightningSetupError"]


class UnsupportedLightningSetupError(UnsupportedError):
    """The Trainer or LightningModule is set up in a way DPCallback cannot train privately."""


class PrivateDataLoader:
    """The train loader of a private run: wraps ``data_loader`` (a map-style ``DataLoader``) and,
    once :class:`DPCallback` has made it private, iterates Poisson batches (module doc).

    ``len()`` is the number of steps per epoch, ``len(data_loader)``. It is deliberately not a
    ``DataLoader``, so Lightning leaves its sampler alone (no ``DistributedSampler`` is injected)."""

    def __init__(self, data_loader: DataLoader):
        if not isinstance(data_loader, DataLoader):
            raise TypeError("PrivateDataLoader: data_loader must be a torch.utils.data.DataLoader over a "
                            f"map-style dataset, got {type(data_loader).__name__}")
        self.data_loader = data_loader
        self.private_loader: Optional[DataLoader] = None  # the Poisson loader, set by DPCallback

    def __len__(self) -> int:
        return len(self.private_loader if self.private_loader is not None else self.data_loader)

    def __iter__(self):
        # a generator: Lightning may call iter() to check the loader; nothing is drawn until next()
        if self.private_loader is None:
            raise RuntimeError("PrivateDataLoader: training has not been made private; pass "
                               "Trainer(callbacks=[DPCallback(...)]) (opacus_dp.integrations.lightning)")
        yield from self.private_loader

    @property
    def dataset(self):
        return self.data_loader.dataset


class DPCallback(pl.Callback):
    """Makes a Lightning training run private (module doc).

    Args:
        target_delta: δ of the reported (ε, δ); much smaller than 1/N.
        max_grad_norm: C, the bound of each example's gradient norm.
        noise_multiplier: σ; give it or ``target_epsilon`` (with ``epochs``).
        target_epsilon: σ is calibrated so that ``epochs`` epochs spend at most this ε.
        epochs: the planned epochs for ``target_epsilon``.
        grad_sample_mode: "bk" (default), "hooks", "functorch" or "auto" ("ghost" needs its own loss
            object, which ``training_step`` does not use: "bk" computes the same norms in one pass).
        accountant: "prv" (default), "rdp" or "gdp".
        secure_mode: sampling and noise seeded by the OS (generator states are then not saved).
        noise_mechanism: only "independent" (DP-SGD) is supported here.
    """

    def __init__(self, *, target_delta: float, max_grad_norm: float, noise_multiplier: Optional[float] = None,
                 target_epsilon: Optional[float] = None, epochs: Optional[float] = None,
                 grad_sample_mode: str = "bk", accountant: str = "prv", secure_mode: bool = False,
                 noise_mechanism: str = "independent"):
        _check_arguments(target_delta, noise_multiplier, target_epsilon, epochs, grad_sample_mode, noise_mechanism)
        self.target_delta = float(target_delta)
        self.max_grad_norm = max_grad_norm
        self.noise_multiplier = noise_multiplier
        self.target_epsilon = target_epsilon
        self.epochs = epochs
        self.grad_sample_mode = grad_sample_mode
        self.secure_mode = bool(secure_mode)
        self.privacy_engine = PrivacyEngine(accountant=accountant, secure_mode=secure_mode)
        self.optimizer = None  # the DPOptimizer, once training started
        self.loader: Optional[PrivateDataLoader] = None
        self._module = None  # the per-sample wrapper, closed at teardown
        self._resumed_state: Optional[dict] = None

    # ------------------------------------------------------------------ making the run private
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.optimizer is not None:
            raise UnsupportedLightningSetupError(
                "DPCallback: this callback already trained a run; use a new DPCallback for each Trainer.fit "
                "(resume with trainer.fit(..., ckpt_path=...) to continue the privacy accounting)")
        _refuse_unsupported(trainer, pl_module)
        self.loader = _private_loader_of(trainer)
        common = dict(module=trainer.model, optimizer=trainer.optimizers[0], data_loader=self.loader.data_loader,
                      max_grad_norm=self.max_grad_norm, grad_sample_mode=self.grad_sample_mode,
                      check_sample_independence=_SAMPLES_ALONE)
        if self.target_epsilon is None:
            module, optimizer, loader = self.privacy_engine.make_private(
                noise_multiplier=self.noise_multiplier, **common)
        else:
            module, optimizer, loader = self.privacy_engine.make_private_with_epsilon(
                target_epsilon=self.target_epsilon, target_delta=self.target_delta, epochs=self.epochs, **common)
        self._module, self.optimizer = module, optimizer
        self.loader.private_loader = loader
        trainer.optimizers = [optimizer]  # the Trainer steps the private optimizer from now on
        if self._resumed_state is not None:
            restore_private_state(self._resumed_state, optimizer=optimizer,
                                  accountant=self.privacy_engine.accountant,
                                  sampler_generator=loader.generator, secure_mode=self.secure_mode)
            self._resumed_state = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pl_module.log("epsilon", self.get_epsilon(), on_step=True, on_epoch=False, prog_bar=True, batch_size=1)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        """Remove the per-sample hooks once fitting ends (the model then runs as a plain module)."""
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


# The model check that runs single samples through ``forward`` (make_private's
# check_sample_independence) would call ``training_step`` under Lightning's DDP wrapper, with the user's
# side effects, and never runs on one process (Lightning calls training_step, not forward); it is off,
# so layers that mix samples are refused by ModuleValidator only (BatchNorm, ...), on 1 and R processes.
_SAMPLES_ALONE = False


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


def _real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _refuse_unsupported(trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
    optimizers = trainer.optimizers
    refusals = {
        f"{len(optimizers)} optimizers from configure_optimizers (one is needed)": len(optimizers) != 1,
        "manual optimization (automatic_optimization=False)": not pl_module.automatic_optimization,
        f"accumulate_grad_batches={trainer.accumulate_grad_batches} (each step is one Poisson batch; "
        "raise the batch size instead)": trainer.accumulate_grad_batches != 1,
        f"gradient_clip_val={trainer.gradient_clip_val} (clipping is per example, max_grad_norm)":
            trainer.gradient_clip_val is not None,
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
