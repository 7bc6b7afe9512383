"""Metrics of a run: a JSON file rewritten after every epoch, optional TensorBoard scalars.

Only the main process (rank 0) writes. The JSON holds the per-epoch records, the final
figures and the privacy summary (accountant, full (σ, q, steps) history, δ), so that ε can be
recomputed independently of the run.
"""

import json
import math
import os
import sys
import time
from typing import Optional


def _finite_or_none(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _clean(obj):
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return _finite_or_none(obj)


class MetricsLog:
    """Collects records; writes ``path`` (JSON) and TensorBoard scalars when enabled."""

    def __init__(self, path: Optional[str], tensorboard_dir: Optional[str], *, enabled: bool,
                 settings: dict, history: Optional[list] = None):
        self.path = path if enabled else None
        self.settings = settings
        self.epochs = list(history or [])
        self.final: dict = {}
        self.started = time.perf_counter()
        self.writer = self._tensorboard(tensorboard_dir) if enabled and tensorboard_dir else None

    @staticmethod
    def _tensorboard(directory: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            print(f"warning: --tensorboard {directory} ignored: the tensorboard package is not "
                  "installed (pip install tensorboard)", file=sys.stderr)
            return None
        return SummaryWriter(log_dir=directory)

    def add_epoch(self, record: dict) -> None:
        self.epochs.append(record)
        if self.writer is not None:
            for key, value in record.items():
                if key != "epoch" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(key, value, record["epoch"])
        self.write()

    def finish(self, **final) -> None:
        self.final.update(final, wall_time_s=time.perf_counter() - self.started)
        self.write()
        if self.writer is not None:
            self.writer.close()

    def write(self) -> None:
        if self.path is None:
            return
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        payload = {"settings": self.settings, "epochs": self.epochs, **self.final}
        with open(self.path, "w", encoding="utf-8") as f:
            json.dump(_clean(payload), f, indent=2)


def settings_line(*, sigma: float, sample_rate: float, steps_per_epoch: int, delta: float, accountant: str,
                  planned_steps: int, **details) -> str:
    """The line every private example prints before training (tests parse it)::

        privacy: sigma=σ q=q steps_per_epoch=K delta=δ accountant=A planned_steps=T [key=value ...]

    σ and q in full precision (``repr``), so that ε of the T planned steps can be recomputed."""
    fields = dict(sigma=repr(float(sigma)), q=repr(float(sample_rate)), steps_per_epoch=int(steps_per_epoch),
                  delta=repr(float(delta)), accountant=accountant, planned_steps=int(planned_steps), **details)
    return "privacy: " + " ".join(f"{key}={value}" for key, value in fields.items())


def run_settings_line(run, epochs: int, **details) -> str:
    """:func:`settings_line` of a private ``common.privacy.TrainingRun`` planned for ``epochs``
    passes of its Poisson loader (``len(loader)`` steps each)."""
    per_epoch = len(run.train_loader)
    return settings_line(sigma=run.noise_multiplier, sample_rate=run.sample_rate, steps_per_epoch=per_epoch,
                         delta=run.delta, accountant=run.engine.accountant.mechanism(),
                         planned_steps=epochs * per_epoch, mode=run.grad_sample_mode, **details)


def resume_line(path: str, *, steps: int, planned_steps: int, finished: bool,
                epsilon: Optional[float] = None) -> str:
    """What ``--resume PATH`` found: where the run continues (with ε spent so far, for a private
    run), or that the checkpoint already holds every planned step (``finished``)."""
    if finished:
        return f"checkpoint {path} already covers the planned {planned_steps} steps: nothing to do"
    spent = f" (ε = {epsilon:.3f})" if epsilon is not None else ""
    return f"resumed from {path} at step {steps}{spent}"


def privacy_line(epsilon: float, delta: float, accountant: str) -> str:
    """The line every example prints at the end (tests parse it): ``ε = … at δ = …``."""
    return f"ε = {epsilon:.6f} at δ = {delta:g} ({accountant} accountant)"


def run_and_report(train, args, privacy_suffix: str = "", details=lambda result: ()) -> int:
    """``train(args)`` timed, then its test accuracy, privacy line (``privacy_suffix`` appended),
    the ``details(result)`` lines and the time printed; the result written to ``args.json`` if set.
    The digits examples' ``main``."""
    start = time.perf_counter()
    result = train(args)
    result.update(seconds=time.perf_counter() - start, settings=vars(args))
    print(f"test accuracy = {100 * result['test_accuracy']:.2f} %")
    print(privacy_line(result["epsilon"], args.delta, result["accountant"]) + privacy_suffix)
    for line in details(result):
        print(line)
    print(f"time = {result['seconds']:.1f} s")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0
