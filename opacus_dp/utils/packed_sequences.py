"""Opacus 0.x/1.x's import path ``opacus.utils.packed_sequences`` (re-exports only)."""

from opacus_dp.compat.packed_sequences import compute_seq_lengths

__all__ = ["compute_seq_lengths"]
