"""Opacus 1.x's import path ``opacus.accountants.accountant`` (re-exports only): the accountants'
base class (:mod:`opacus_dp.accountants.privacy_accountant`) under Opacus's name ``IAccountant``."""

from opacus_dp.accountants.privacy_accountant import HistoryEntry, PrivacyAccountant, T_state_dict, validate_history

IAccountant = PrivacyAccountant  # Opacus 1.x's name

__all__ = ["HistoryEntry", "IAccountant", "PrivacyAccountant", "T_state_dict", "validate_history"]
