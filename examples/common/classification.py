"""The driver shared by the classification examples (CIFAR-10, MNIST, names).

Order of events: seed → model (→ DataParallel → DPDDP under torchrun) → optimizer → privacy
engine → (resume) → epochs of training with per-epoch test accuracy, checkpoints (last and
best) and metrics → final accuracy and ε. A ``--max-epsilon`` budget ends the run cleanly:
the refused step changes nothing, the state so far is saved, the exit code is 0.
"""

import argparse
import math
from typing import Callable, Optional

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

from common import checkpoints
from common.distributed import Distributed, barrier, wrap_model
from common.loop import evaluate, first_epoch, set_learning_rate, train_epoch
from common.privacy import TrainingRun, prepare_training
from common.reporting import MetricsLog, privacy_line, resume_line, run_settings_line


def make_optimizer(args: argparse.Namespace, params) -> torch.optim.Optimizer:
    if args.optim == "SGD":
        return torch.optim.SGD(params, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    if args.optim == "Adam":
        return torch.optim.Adam(params, lr=args.lr, weight_decay=args.weight_decay)
    return torch.optim.RMSprop(params, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)


def build_run(args, build_model: Callable[[], nn.Module], train_set: Dataset, setup: Distributed,
              collate_fn=None):
    """Model, optimizer and privacy engine; resumed from ``--resume`` if given."""
    torch.manual_seed(args.seed)
    model = build_model().to(setup.device)
    if args.data_parallel:
        model = nn.DataParallel(model)
    model = wrap_model(model, setup, private=not args.disable_dp)
    optimizer = make_optimizer(args, model.parameters())
    saved = checkpoints.read(args.resume, args.unsafe_resume) if args.resume else {}
    sigma = checkpoints.saved_noise_multiplier(args, saved, lambda text: _say(setup, text))
    run = prepare_training(args, model, optimizer, train_set, setup, collate_fn=collate_fn,
                           noise_multiplier=sigma)
    entries = checkpoints.restore(run, args.resume, map_location=setup.device,
                                  unsafe=args.unsafe_resume) if args.resume else {}
    return run, entries


def _say(setup: Distributed, message: str) -> None:
    if setup.is_main:
        print(message, flush=True)


def _save(run: TrainingRun, args, setup: Distributed, entries: dict, best: bool) -> None:
    if setup.is_main:
        checkpoints.save(run, args.checkpoint_file, entries, best=best)
    barrier(setup)


def _epoch_record(epoch: int, stats, test: dict, run: TrainingRun) -> dict:
    return {"epoch": epoch, "train_loss": stats.loss, "train_accuracy": stats.accuracy,
            "test_loss": test["loss"], "test_accuracy": test["accuracy"], "steps": stats.steps,
            "epsilon": stats.epsilon, "total_steps": len(run.engine.accountant) if run.private else None}


def _train_epochs(args, run: TrainingRun, test_loader, setup: Distributed, log: MetricsLog,
                  entries: dict) -> Optional[str]:
    """Train from the epoch after ``entries['epoch']``; return a stop reason or None."""
    from opacus_dp.errors import PrivacyBudgetExceededError

    best = entries.get("best_accuracy", 0.0)
    for epoch in range(first_epoch(args, entries), args.epochs + 1):
        set_learning_rate(run.optimizer, args, epoch)
        try:
            stats = train_epoch(run, epoch, device=setup.device, print_freq=args.print_freq,
                                show_progress=setup.is_main and not args.no_progress)
        except PrivacyBudgetExceededError as error:
            _say(setup, f"stopping: {error}")
            _save(run, args, setup, dict(epoch=epoch - 1, best_accuracy=best, metrics=log.epochs,
                                          stopped="privacy budget"), best=False)
            return "privacy budget"
        test = evaluate(run.model, test_loader, setup.device)
        log.add_epoch(_epoch_record(epoch, stats, test, run))
        improved = test["accuracy"] > best
        best = max(best, test["accuracy"])
        _save(run, args, setup, dict(epoch=epoch, best_accuracy=best, metrics=log.epochs), best=improved)
        eps = f", ε = {stats.epsilon:.3f}" if run.private else ""
        _say(setup, f"epoch {epoch}: train loss {stats.loss:.4f}, train acc {100 * stats.accuracy:.2f} %, "
                    f"test acc {100 * test['accuracy']:.2f} %{eps}")
    return None


def _resumed(args, run: TrainingRun, entries: dict) -> str:
    """The resume line: the step the run continues from, or that nothing is left to train."""
    per_epoch = len(run.train_loader)
    steps = run.accounted_steps() if run.private else entries.get("epoch", 0) * per_epoch
    return resume_line(args.resume, steps=steps, planned_steps=args.epochs * per_epoch,
                       finished=first_epoch(args, entries) > args.epochs,
                       epsilon=run.epsilon() if run.private else None)


def run_classification(args: argparse.Namespace, *, build_model: Callable[[], nn.Module],
                       train_set: Dataset, test_set: Dataset, setup: Distributed,
                       collate_fn=None) -> int:
    """Train (or only evaluate) a classifier as described in the module doc; exit code."""
    run, entries = build_run(args, build_model, train_set, setup, collate_fn)
    test_loader = DataLoader(test_set, batch_size=args.batch_size_test, collate_fn=collate_fn)
    if args.evaluate:
        test = evaluate(run.model, test_loader, setup.device)
        _say(setup, f"test accuracy = {100 * test['accuracy']:.2f} % (checkpoint {args.resume})")
        return 0
    if run.private:
        _say(setup, run_settings_line(run, args.epochs))
    _say(setup, f"checkpoint: {args.checkpoint_file}")
    if args.resume:
        _say(setup, _resumed(args, run, entries))
    log = MetricsLog(args.metrics_file, args.tensorboard, enabled=setup.is_main,
                     settings=vars(args), history=entries.get("metrics"))
    stopped = _train_epochs(args, run, test_loader, setup, log, entries)
    final = log.epochs[-1]["test_accuracy"] if log.epochs else math.nan
    epsilon = run.epsilon()
    log.finish(test_accuracy=final, best_accuracy=max((e["test_accuracy"] for e in log.epochs), default=None),
               epsilon=epsilon, privacy=run.privacy_summary(), world_size=setup.world_size,
               stopped=stopped)
    _say(setup, f"test accuracy = {100 * final:.2f} %" if log.epochs else "no epoch was completed")
    if run.private:
        _say(setup, privacy_line(epsilon, args.delta, run.engine.accountant.mechanism()))
    return 0
