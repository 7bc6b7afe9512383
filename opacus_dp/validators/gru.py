"""Opacus 1.x's ``opacus.validators.gru``: validate / fix an nn.GRU (fixed: DPGRU with the
same weights; :mod:`opacus_dp.validators.recurrent`)."""

from opacus_dp.validators.recurrent import fix, validate

__all__ = ["fix", "validate"]
