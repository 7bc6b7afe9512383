"""Opacus 0.x ``opacus.utils.stats``: metrics logged to TensorBoard from the training loop.

``add(Stat(StatType.TRAIN, "accuracy", frequency=0.1))`` registers a metric; ``update(
StatType.TRAIN, acc1=value)`` logs values to every registered stat of that type (and name).
A stat writes once every ``1/frequency`` calls: the mean of those calls (``reduction="avg"``)
or the last value (``"sample"``), under the tag ``"<TYPE>:<name>/<key>"``. Without
``set_global_summary_writer`` a ``torch.utils.tensorboard.SummaryWriter`` is created at the first
write; without tensorboard installed nothing is written (a warning says so once).
The classic engine does not feed ``StatType.GRAD``/``PRIVACY`` (0.x's clipping statistics):
log ``engine.get_privacy_spent(delta)`` yourself.
"""

import warnings
from enum import IntEnum
from typing import Any, Dict, List, Optional

try:
    from torch.utils.tensorboard import SummaryWriter
except ImportError:  # tensorboard is optional
    SummaryWriter = None


class StatType(IntEnum):
    """Namespaces of the stats (values as in Opacus 0.x)."""

    LOSS = 1
    GRAD = 2
    PRIVACY = 3
    TRAIN = 4
    TEST = 5


class _NoWriter:
    def add_scalar(self, *args, **kwargs) -> None:
        """Dropped: tensorboard is not installed."""

    add_histogram = add_scalar


def _default_writer():
    if SummaryWriter is None:
        warnings.warn("opacus_dp.utils.stats: tensorboard is not installed, stats are not written "
                      "(pip install tensorboard)", UserWarning, stacklevel=4)
        return _NoWriter()
    return SummaryWriter()


class Stat:
    """One metric (module doc). ``frequency`` in (0, 1]; ``reduction`` "avg" or "sample"."""

    summary_writer = None  # set by set_global_summary_writer

    def __init__(self, stat_type: StatType, name: str, frequency: float = 1.0, reduction: str = "avg"):
        if not 0 < frequency <= 1:
            raise ValueError(f"frequency must lie in (0, 1], got {frequency!r}")
        if reduction not in ("avg", "sample"):
            raise ValueError(f"reduction must be 'avg' or 'sample', got {reduction!r}")
        self.type, self.name, self.reduction = stat_type, name, reduction
        self.report = int(1 / frequency)
        self.writer = Stat.summary_writer
        self.reset()

    def reset(self) -> None:
        """Forget the values of the current window and restart counting."""
        self.named_value: Dict[str, float] = {}
        self.iter = 0

    def log(self, named_value: Dict[str, Any], hist: bool = False) -> None:
        """Add one call's values; write when the window of ``1/frequency`` calls is full."""
        if hist and self.reduction == "avg":
            raise ValueError("hist=True needs reduction='sample' (a histogram cannot be averaged)")
        for key, value in named_value.items():
            if self.reduction == "sample":
                self.named_value[key] = value
            else:
                self.named_value[key] = self.named_value.get(key, 0.0) + float(value) / self.report
        self.iter += 1
        if self.iter % self.report == 0:
            self._write(hist)

    def _write(self, hist: bool) -> None:
        if self.writer is None:
            self.writer = Stat.summary_writer or _default_writer()
        for key, value in self.named_value.items():
            tag = f"{self.type.name}:{self.name}/{key}"
            (self.writer.add_histogram if hist else self.writer.add_scalar)(tag, value, self.iter)
        self.named_value = {}


Stats: List[Stat] = []


def set_global_summary_writer(summary_writer) -> None:
    """Write every stat created from now on to ``summary_writer``."""
    Stat.summary_writer = summary_writer


def add(*stats: Stat) -> None:
    """Register stats for :func:`update`."""
    Stats.extend(stats)


def clear() -> None:
    """Unregister every stat."""
    Stats.clear()


def _matching(stat_type: Optional[StatType], name: Optional[str]) -> List[Stat]:
    return [s for s in Stats if (stat_type is None or s.type == stat_type) and (name is None or s.name == name)]


def remove(name: str) -> None:
    """Unregister the stats called ``name``."""
    Stats[:] = [s for s in Stats if s.name != name]


def reset(stat_type: Optional[StatType] = None, name: Optional[str] = None) -> None:
    """Reset the matching stats (all by default)."""
    for stat in _matching(stat_type, name):
        stat.reset()


def update(stat_type: Optional[StatType] = None, name: Optional[str] = None, hist: bool = False,
           **named_values) -> None:
    """Log ``named_values`` to the matching stats."""
    for stat in _matching(stat_type, name):
        stat.log(named_values, hist)


__all__ = ["Stat", "StatType", "Stats", "add", "clear", "remove", "reset", "set_global_summary_writer", "update"]
