"""Private (DP-SGD) training through the Hugging Face ``transformers`` ``Trainer``.

``DPTrainer(model=..., args=TrainingArguments(...), privacy_args=PrivacyArguments(...), ...)``
trains like a ``Trainer`` (its optimizer and scheduler, Accelerate, bf16, PEFT/LoRA models,
callbacks, logging, checkpoints) with these changes:

* **Batches.** Each optimizer step is one Poisson sample of the train set (every example drawn
  independently with probability ``q = L/N``), where ``L = per_device_train_batch_size ·
  gradient_accumulation_steps · world_size`` is the expected logical batch. The sample is cut into
  physical pieces of at most ``per_device_train_batch_size`` rows, each a forward/backward pass;
  the optimizer steps once per logical batch, whatever the number of pieces. An epoch is
  ``round(1/q)`` steps.
* **Loss.** The loss of a piece is the mean of per-example losses (default: see
  :func:`~opacus_dp.integrations.transformers_batches.per_example_loss`; or pass
  ``per_example_loss=f(outputs, labels) -> [n]``), and the update is
  ``(Σ_i clip_C(∇ℓ_i) + N(0, σ²C²)) / L``.
* **Privacy.** ``PrivacyArguments``: ``noise_multiplier`` σ, or ``target_epsilon`` (σ calibrated
  so that the planned steps spend at most that ε at ``target_delta``), ``max_grad_norm`` C, the
  per-sample ``grad_sample_mode`` (default ``"bk"``), the ``noise_mechanism``, the ``accountant``,
  the noise generator (``fast_noise="philox"``: counter-based, at about memory speed on CPU).
  ``epsilon`` is added to every log (console, TensorBoard, W&B ...). Training stops before the
  step that would take ε above ``max_epsilon`` (default: ``target_epsilon``); the engine's budget
  guard refuses such a step in any case.
* **Optimizer.** The ``Trainer``'s (``optim=...``) or the user's (``optimizers=(optimizer,
  scheduler)``) is made private: its own update runs on the private gradient once per logical
  batch, and the learning-rate scheduler steps once per logical batch. Optimizers that update
  during the backward pass or have ``train()``/``eval()`` modes are refused
  (:mod:`~opacus_dp.integrations.transformers_checks`).
* **Checkpoints.** The accountant, noise and sampler states are saved in each ``checkpoint-N/``
  (:mod:`~opacus_dp.integrations.transformers_state`) and restored by
  ``train(resume_from_checkpoint=...)``: a resumed seeded run is identical to an uninterrupted one.
* **Forward.** The training forwards are the private model's, compiled (``torch_compile``) and
  autocast (``bf16``) as Accelerate prepares a ``Trainer``'s model, also on several
  processes (:mod:`~opacus_dp.integrations.transformers_forward`).
* The ``Trainer``'s own gradient clipping (``TrainingArguments.max_grad_norm``) is switched off,
  and the gradient norm is not logged (it would be computed from non-private gradients). The
  logged training loss is, as in any training loop, a statistic of the private batches.

Several processes (``torchrun``): the model is wrapped in DPDDP (one all-reduce of the clipped
sums per step, noise added once); each rank draws its part of the global Poisson sample. Not
supported (refused up front): ``nn.DataParallel`` (several GPUs in one process), DeepSpeed, FSDP,
``auto_find_batch_size``, ``fp16`` (loss scaling), iterable datasets, LOMO, layer-wise and schedule-free optimizers.
"""

import copy
import math
from dataclasses import dataclass
from typing import Optional

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from opacus_dp.engine.budget_guard import BudgetGuard
from opacus_dp.data import DPDataLoader
from opacus_dp.distributed import DifferentiallyPrivateDistributedDataParallel
from opacus_dp.errors import PrivacyBudgetExceededError
from opacus_dp.model_wrappers import unwrap_model
from opacus_dp.integrations.transformers_batches import PerExampleLoss, batch_size_of, piece_losses, pieces
from opacus_dp.integrations.transformers_checks import (check_optimizer, refuse_loss_scaling, refuse_trainer_loss,
                                                          refuse_unsupported)
from opacus_dp.integrations.transformers_forward import compile_as_accelerate_would, mixed_precision_forward
from opacus_dp.integrations.transformers_state import load_private_state, save_private_state
from opacus_dp.engine.fast_noise import fast_noise_setting
from opacus_dp.engine.modern import PrivacyEngine

__all__ = ["DPTrainer", "PrivacyArguments"]


@dataclass
class PrivacyArguments:
    """Privacy settings of a :class:`DPTrainer` (also usable with ``HfArgumentParser``).

    Args:
        target_delta: δ of the reported (ε, δ); much smaller than 1/N.
        noise_multiplier: σ; give it or ``target_epsilon``.
        target_epsilon: ε the planned steps may spend (σ is calibrated for them).
        max_grad_norm: C, the bound of each example's gradient norm (``inf`` only with σ = 0).
        max_epsilon: stop before ε would exceed it (default ``target_epsilon``; None: no stop).
        grad_sample_mode: "bk" (default), "ghost", "hooks", "functorch" or "auto"; "ghost" runs one
            book-keeping pass per piece (the loss is the trainer's own, not a ghost criterion's):
            the update of Opacus's two-pass ghost clipping, with its memory, in one backward pass.
        noise_mechanism: "independent" (DP-SGD), "banded", "blt" or "tree" (``docs/mechanisms.md``).
        bands: number of bands of the "banded" mechanism.
        accountant: "prv" (default), "rdp" or "gdp".
        secure_mode: sampling and noise seeded by the OS (no generator states in checkpoints).
        seed: seed of the sampling and noise generators (default ``TrainingArguments.seed``).
        fast_noise: the noise generator (``make_private``'s ``fast_noise``, by name): "off" (default,
            torch's generator), "threads" (parallel threads on CPU) or "philox" (counter-based,
            drawn and added in one pass; ``docs/noise.md``). A checkpoint resumes with its own.
    """

    target_delta: float
    noise_multiplier: Optional[float] = None
    target_epsilon: Optional[float] = None
    max_grad_norm: float = 1.0
    max_epsilon: Optional[float] = None
    grad_sample_mode: str = "bk"
    noise_mechanism: str = "independent"
    bands: Optional[int] = None
    accountant: str = "prv"
    secure_mode: bool = False
    seed: Optional[int] = None
    fast_noise: str = "off"

    def __post_init__(self):
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError("PrivacyArguments: give exactly one of noise_multiplier (sigma) and target_epsilon "
                             f"(got noise_multiplier={self.noise_multiplier}, target_epsilon={self.target_epsilon})")
        if not _is_number(self.target_delta) or not 0 < self.target_delta < 1:
            raise ValueError(f"PrivacyArguments: target_delta must lie in (0, 1), got {self.target_delta!r}")
        for name in ("target_epsilon", "max_epsilon"):
            value = getattr(self, name)
            if value is not None and not (_is_number(value) and 0 < value < math.inf):
                raise ValueError(f"PrivacyArguments: {name} must be a finite number > 0, got {value!r}")
        if self.max_epsilon is None:
            self.max_epsilon = self.target_epsilon
        if self.secure_mode and self.seed is not None:
            raise ValueError("PrivacyArguments: seed must be None with secure_mode=True (the OS seeds the run)")
        fast_noise_setting(self.fast_noise, "PrivacyArguments")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


class _BudgetStop(TrainerCallback):
    """Ends training after the last step that fits ``max_epsilon`` (the next one would exceed it)."""

    def __init__(self, trainer: "DPTrainer"):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        if not self.trainer.budget_allows_next_step():
            control.should_training_stop = True
            control.should_log = True
        return control


class DPTrainer(Trainer):
    """A ``transformers.Trainer`` that trains with DP-SGD (module doc).

    Args:
        model, args, ...: as for ``Trainer`` (``args`` is required; it is copied, not changed).
        privacy_args: the :class:`PrivacyArguments`.
        per_example_loss: ``f(outputs, labels) -> Tensor[n]``, one loss per example (default:
            :func:`~opacus_dp.integrations.transformers_batches.per_example_loss`).
    """

    def __init__(self, model=None, args: Optional[TrainingArguments] = None, *trainer_args,
                 privacy_args: Optional[PrivacyArguments] = None,
                 per_example_loss: Optional[PerExampleLoss] = None, **trainer_kwargs):
        if not isinstance(privacy_args, PrivacyArguments):
            raise TypeError("DPTrainer: privacy_args must be a PrivacyArguments "
                            f"(e.g. PrivacyArguments(target_delta=1e-5, noise_multiplier=1.0)), got {privacy_args!r}")
        if not isinstance(args, TrainingArguments):
            raise TypeError(f"DPTrainer: args must be a TrainingArguments, got {type(args).__name__}")
        refuse_unsupported(args)
        refuse_trainer_loss(trainer_kwargs.get("compute_loss_func"))
        self.privacy_args = privacy_args
        self.physical_batch_size = int(args.per_device_train_batch_size)
        self.accumulation_steps = int(args.gradient_accumulation_steps)
        args = copy.copy(args)
        args.gradient_accumulation_steps = 1  # one Trainer step = one logical (Poisson) batch
        args.max_grad_norm = 0.0  # clipping is per example, in the private step
        self.per_example_loss = per_example_loss
        self.privacy_engine: Optional[PrivacyEngine] = None
        self._dp_optimizer = None
        self._dp_loader = None
        self._forward = None
        self._budget = None
        self._placeholder = None
        super().__init__(model, args, *trainer_args, **trainer_kwargs)
        refuse_loss_scaling(self.args, self.accelerator)
        if self.optimizer is not None:  # the user's, from optimizers=(optimizer, scheduler)
            check_optimizer(self.optimizer, self.model)
        self.add_callback(_BudgetStop(self))

    # ------------------------------------------------------------------ building the private parts
    @property
    def logical_batch_size(self) -> int:
        """``L``: the expected number of examples of one step (all processes)."""
        return self.physical_batch_size * self.accumulation_steps * self.args.world_size

    def get_train_dataloader(self):
        """The Poisson loader of the train set (built with the private optimizer)."""
        self._make_private()
        return self._dp_loader

    def get_resumed_dataloader(self, dataloader, num_batches: int):
        """No batches are skipped on resuming: the restored sampler state draws the batches that
        follow those already trained on (skipping would draw and drop them)."""
        return dataloader

    def create_optimizer(self, model=None):
        """The Trainer's optimizer, made private (``make_private``)."""
        self._make_private()
        return self.optimizer

    def _make_private(self) -> None:
        if self._dp_optimizer is not None:
            return
        if self.train_dataset is None:
            raise ValueError("DPTrainer: training requires a train_dataset")
        optimizer = super().create_optimizer()  # the user's, or built from TrainingArguments.optim
        check_optimizer(optimizer, self.model)
        module = self._distributed_model()
        p = self.privacy_args
        self.privacy_engine = PrivacyEngine(accountant=p.accountant, secure_mode=p.secure_mode,
                                            max_epsilon=p.max_epsilon,
                                            max_epsilon_delta=p.target_delta if p.max_epsilon else None)
        loader = self._poisson_loader()
        common = dict(module=module, optimizer=optimizer, data_loader=loader, max_grad_norm=p.max_grad_norm,
                      grad_sample_mode=p.grad_sample_mode, noise_mechanism=p.noise_mechanism, bands=p.bands,
                      noise_generator=self._noise_generator(),
                      fast_noise=fast_noise_setting(p.fast_noise, "PrivacyArguments"))
        if p.target_epsilon is None:
            planned = None if p.noise_mechanism == "independent" else self._planned_steps(len(loader)) / len(loader)
            private, dp_optimizer, *_, dp_loader = self.privacy_engine.make_private(  # "ghost": its criterion too
                noise_multiplier=p.noise_multiplier, epochs=planned, **common)
        else:
            private, dp_optimizer, *_, dp_loader = self.privacy_engine.make_private_with_epsilon(
                target_epsilon=p.target_epsilon, target_delta=p.target_delta,
                epochs=self._planned_steps(len(loader)) / len(loader), **common)
        compile_as_accelerate_would(private, self.accelerator)  # torch_compile=True (transformers_forward)
        self._forward = mixed_precision_forward(private, self.accelerator)
        self.optimizer, self._dp_optimizer, self._dp_loader = dp_optimizer, dp_optimizer, dp_loader
        self._placeholder = loader.collate_fn([loader.dataset[0]])  # for empty batches (training_step)
        if p.max_epsilon is not None:
            self._budget = BudgetGuard(self.privacy_engine.accountant, max_epsilon=p.max_epsilon,
                                       delta=p.target_delta, sample_rate=self._next_rate)

    def _distributed_model(self):
        """The model, wrapped in DPDDP when several processes train: the private step sums the
        clipped gradients of all ranks in one all-reduce and adds the noise once. The Trainer then
        steps through the wrapper (``model_wrapped``) and leaves the model to it (no DDP of its own)."""
        if self.args.world_size == 1:
            return self.model
        self.model_wrapped = DifferentiallyPrivateDistributedDataParallel(self.model)
        return self.model_wrapped

    def _poisson_loader(self) -> DPDataLoader:
        dataset, collate = self.train_dataset, self.data_collator
        if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
            raise TypeError("DPTrainer: Poisson sampling needs a map-style train_dataset (with __len__ and "
                            "__getitem__), got an iterable dataset")
        try:
            import datasets
            is_hf_dataset = isinstance(dataset, datasets.Dataset)
        except ImportError:
            is_hf_dataset = False
        if is_hf_dataset:
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collate = self._get_collator_with_removed_columns(collate, description="training")
        generator = None if self.privacy_args.secure_mode else torch.Generator().manual_seed(self._seed())
        return DPDataLoader(dataset, sample_rate=min(1.0, self.logical_batch_size / len(dataset)),
                            collate_fn=collate, generator=generator,
                            num_workers=self.args.dataloader_num_workers,
                            pin_memory=self.args.dataloader_pin_memory and self.args.device.type == "cuda")

    def _seed(self) -> int:
        return self.args.seed if self.privacy_args.seed is None else int(self.privacy_args.seed)

    def _noise_generator(self) -> Optional[torch.Generator]:
        if self.privacy_args.secure_mode:
            return None
        device = next((q.device for q in self.model.parameters() if q.requires_grad), torch.device("cpu"))
        return torch.Generator(device=device).manual_seed(self._seed() + 1)

    def _planned_steps(self, steps_per_epoch: int) -> int:
        """Steps the Trainer will take: ``max_steps``, else ``⌈epochs · steps per epoch⌉``."""
        if self.args.max_steps > 0:
            return int(self.args.max_steps)
        return max(1, math.ceil(self.args.num_train_epochs * steps_per_epoch))

    # ------------------------------------------------------------------ the step
    def training_step(self, model, inputs, num_items_in_batch=None):
        """Forward and backward passes over the pieces of one logical batch; returns the mean
        per-example loss (detached). The Trainer's ``optimizer.step()`` then takes the private step.
        The forward passes are the private model's, compiled and autocast as Accelerate would
        prepare ``model`` (:mod:`~opacus_dp.integrations.transformers_forward`).

        An empty Poisson batch still takes its step (noise only, accounted). Models cannot run on
        zero rows, so the layers see one placeholder example (the train set's first) whose loss is
        multiplied by 0: its gradient is exactly 0 and adds nothing to the clipped sum."""
        model.train()
        size = batch_size_of(inputs)
        weight = 1.0 if size else 0.0
        inputs = self._prepare_inputs(inputs if size else self._placeholder)
        parts = pieces(inputs, self.physical_batch_size)
        shift = _is_causal_lm(unwrap_model(self.accelerator.unwrap_model(model)))
        total = torch.zeros((), device=self.args.device)
        for index, piece in enumerate(parts):
            with self.compute_loss_context_manager():
                losses = piece_losses(self._forward, piece, shift=shift, loss_fn=self.per_example_loss)
            # the mean over the piece, as the engine's loss_reduction="mean" expects
            self.accelerator.backward(weight * losses.sum() / len(losses))
            total = total + weight * losses.detach().sum()
            if index < len(parts) - 1:  # more pieces of this batch: clip and accumulate only
                self._dp_optimizer.signal_chunk_step(True)
                self._dp_optimizer.step()
                self._dp_optimizer.zero_grad(set_to_none=True)
        return total / max(size, 1)

    def _get_grad_norm(self, model, grad_norm=None):
        return None  # the gradients before the private step are not private: not logged

    # ------------------------------------------------------------------ ε, budget
    def get_epsilon(self) -> float:
        """ε spent so far at ``target_delta`` (0 before training)."""
        if self.privacy_engine is None:
            return 0.0
        return self.privacy_engine.get_epsilon(self.privacy_args.target_delta)

    @property
    def noise_multiplier(self) -> Optional[float]:
        """σ of the private steps (calibrated with ``target_epsilon``); None before training."""
        return None if self._dp_optimizer is None else float(self._dp_optimizer.noise_multiplier)

    def budget_allows_next_step(self) -> bool:
        """Whether one more step keeps ε ≤ ``max_epsilon`` (always, without a maximum)."""
        if self._budget is None:
            return True
        try:
            self._budget.check(float(self._dp_optimizer.noise_multiplier), self._next_rate())
        except PrivacyBudgetExceededError:
            return False
        return True

    def _next_rate(self) -> float:
        """The sampling rate the next step is charged: ``q``; with a correlated-noise mechanism,
        whose steps are charged per round, the largest rate charged so far (conservative: the stop
        may come a few free steps early, never late)."""
        rate = float(getattr(self._dp_loader, "sample_rate", 1.0))
        if self.privacy_args.noise_mechanism == "independent":
            return rate
        return max([rate] + [float(q) for _, q, _ in self.privacy_engine.accountant.history])

    def log(self, logs, start_time=None):
        if self.privacy_engine is not None and "epsilon" not in logs:
            logs["epsilon"] = self.get_epsilon()
        return super().log(logs, start_time)

    # ------------------------------------------------------------------ checkpoints
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if self._dp_optimizer is not None:  # every rank: its own noise stream
            save_private_state(output_dir, rank=self.args.process_index, optimizer=self._dp_optimizer,
                               accountant=self.privacy_engine.accountant, data_loader=self._dp_loader,
                               secure_mode=self.privacy_args.secure_mode)

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            load_private_state(checkpoint, rank=self.args.process_index, optimizer=self._dp_optimizer,
                               accountant=self.privacy_engine.accountant, data_loader=self._dp_loader,
                               secure_mode=self.privacy_args.secure_mode)


def _is_causal_lm(model) -> bool:
    """Whether ``model`` (or the model inside a PEFT wrapper) is a ``*ForCausalLM`` of transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    return type(base).__name__ in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
