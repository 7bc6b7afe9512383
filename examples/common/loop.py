"""Training and evaluation loops of the classification examples (images, names).

One private step = one Poisson batch: ``zero_grad → forward → backward → step`` (or
``virtual_step`` for all but the last physical piece of the batch, see
:func:`common.privacy.physical_batches`). Empty Poisson batches go through the same calls: the
optimizer then adds noise only, and the step is accounted like any other.
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from common.privacy import TrainingRun, physical_batches


@dataclass
class EpochStats:
    loss: float
    accuracy: float
    steps: int
    epsilon: float


def to_device(batch, device: torch.device):
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(item, device) for item in batch)
    return batch.to(device, non_blocking=True)


def set_epoch(loader: DataLoader, epoch: int) -> None:
    """Let distributed samplers reshuffle their shards for ``epoch``."""
    for sampler in (getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None)):
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)


class EpochProgress:
    """The progress bar of one epoch (nothing when disabled): :meth:`advance` after each batch
    with the values to show, :meth:`close` with the epoch's final values — ε after its last
    step, the figure the epoch's line prints next — which are drawn before the bar goes."""

    def __init__(self, *, total: int, epoch: int, enabled: bool):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=f"epoch {epoch}", leave=False, dynamic_ncols=True)

    def advance(self, **values) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(values)  # drawn now

    def close(self, **values) -> None:
        if self.bar is not None:
            if values:
                self.bar.set_postfix(values, refresh=True)
            self.bar.close()  # a second call does nothing

    def __enter__(self) -> "EpochProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()  # an epoch cut short (budget exhausted) leaves no bar behind


def epsilon_due(stepped: int, steps: int, print_freq: int) -> bool:
    """Whether the bar's ε is recomputed now: at the epoch's first private step, then whenever the
    count of steps crosses a multiple of ``print_freq`` (the epoch's last step: :meth:`EpochProgress.close`)."""
    return stepped > steps and (steps == 0 or stepped // print_freq > steps // print_freq)


def set_learning_rate(optimizer: torch.optim.Optimizer, args, epoch: int) -> None:
    """``--lr-schedule cos``: ``lr · (1 + cos(π·epoch/(epochs+1)))/2`` for ``epoch`` (Opacus's
    CIFAR-10 schedule); ``constant`` leaves the learning rate alone."""
    if getattr(args, "lr_schedule", "constant") != "cos":
        return
    lr = args.lr * 0.5 * (1 + math.cos(math.pi * epoch / (args.epochs + 1)))
    for group in optimizer.param_groups:
        group["lr"] = lr


def first_epoch(args, entries: dict) -> int:
    """``--start-epoch`` if given, else the epoch after the resumed one (1 for a new run)."""
    start = getattr(args, "start_epoch", None)
    return start if start is not None else entries.get("epoch", 0) + 1


def train_epoch(run: TrainingRun, epoch: int, *, device: torch.device, print_freq: int,
                show_progress: bool) -> EpochStats:
    """One pass over ``run.train_loader``; raises PrivacyBudgetExceededError from ``step``."""
    run.model.train()
    set_epoch(run.train_loader, epoch)
    loss_sum, correct, seen, steps = 0.0, 0, 0, 0
    accounted_before = run.accounted_steps()
    epsilon = run.epsilon() if run.private else math.nan
    with EpochProgress(total=len(run.train_loader), epoch=epoch, enabled=show_progress) as bar, \
            physical_batches(run) as batches:
        for batch, take_step in batches:
            inputs, targets = to_device(batch, device)
            run.optimizer.zero_grad(set_to_none=True)
            outputs = run.model(inputs)
            loss = F.cross_entropy(outputs, targets)
            loss.backward()
            if take_step:
                run.optimizer.step()
            else:
                run.optimizer.virtual_step()
            stepped = _steps_so_far(run, steps + take_step, accounted_before)
            if len(targets):
                loss_sum += loss.item() * len(targets)
                correct += int((outputs.argmax(dim=1) == targets).sum())
                seen += len(targets)
            if run.private and epsilon_due(stepped, steps, print_freq):
                epsilon = run.epsilon()
            steps = stepped
            bar.advance(**_shown(loss_sum, correct, seen, epsilon))
        epsilon = run.epsilon() if run.private else math.nan
        bar.close(**_shown(loss_sum, correct, seen, epsilon))
    loss_sum, correct, seen = _sum_over_processes(device, loss_sum, correct, seen)
    return EpochStats(loss=loss_sum / max(seen, 1), accuracy=correct / max(seen, 1),
                      steps=steps, epsilon=epsilon)


def _shown(loss_sum: float, correct: int, seen: int, epsilon: float) -> dict:
    return dict(loss=f"{loss_sum / max(seen, 1):.3f}", acc=f"{correct / max(seen, 1):.3f}",
                eps=f"{epsilon:.3f}")


def _steps_so_far(run: TrainingRun, counted: int, accounted_before: int) -> int:
    """Steps of this epoch: the accountant's records (a batch cut by ``BatchMemoryManager`` is one
    step however many pieces it has), or the counted ones without privacy."""
    return run.accounted_steps() - accounted_before if run.private else counted


def _sum_over_processes(device: torch.device, *values: float):
    """Totals over all processes of a torchrun job (the values themselves otherwise)."""
    if not (dist.is_available() and dist.is_initialized()):
        return values
    totals = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    return tuple(totals.tolist())


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, device: torch.device) -> dict:
    """Mean loss and accuracy of ``model`` on ``loader``."""
    model.eval()
    loss_sum, correct, seen = 0.0, 0, 0
    for batch in loader:
        inputs, targets = to_device(batch, device)
        outputs = model(inputs)
        loss_sum += float(F.cross_entropy(outputs, targets, reduction="sum"))
        correct += int((outputs.argmax(dim=1) == targets).sum())
        seen += len(targets)
    return {"loss": loss_sum / max(seen, 1), "accuracy": correct / max(seen, 1)}
