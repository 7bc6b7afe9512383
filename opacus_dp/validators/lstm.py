"""Opacus 1.x's ``opacus.validators.lstm``: validate / fix an nn.LSTM (fixed: DPLSTM with the
same weights; :mod:`opacus_dp.validators.recurrent`)."""

from opacus_dp.validators.recurrent import fix, validate

__all__ = ["fix", "validate"]
