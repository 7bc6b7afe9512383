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


def privacy_line(epsilon: float, delta: float, accountant: str) -> str:
    """The line every example prints at the end (tests parse it): ``ε = … at δ = …``."""
    return f"ε = {epsilon:.6f} at δ = {delta:g} ({accountant} accountant)"
