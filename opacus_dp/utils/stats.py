"""Opacus 0.x's import path ``opacus.utils.stats`` (re-exports only; TensorBoard metrics of the
training loop, :mod:`opacus_dp.compat.stats`)."""

from opacus_dp.compat.stats import Stat, Stats, StatType, add, clear, remove, reset, set_global_summary_writer, update

__all__ = ["Stat", "StatType", "Stats", "add", "clear", "remove", "reset", "set_global_summary_writer", "update"]
