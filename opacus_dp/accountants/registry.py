"""Accountants by name: ``create_accountant("prv")`` and ``register_accountant(name, cls)``."""

from typing import Dict, Type

from opacus_dp.accountants.privacy_accountant import PrivacyAccountant
from opacus_dp.accountants.gdp import GaussianAccountant
from opacus_dp.accountants.prv import PRVAccountant
from opacus_dp.accountants.rdp import RDPAccountant

_ACCOUNTANTS: Dict[str, Type[PrivacyAccountant]] = {
    "rdp": RDPAccountant,
    "prv": PRVAccountant,
    "gdp": GaussianAccountant,
}


def available_accountants() -> list:
    """Names accepted by :func:`create_accountant`."""
    return sorted(_ACCOUNTANTS)


def register_accountant(mechanism: str, accountant: Type[PrivacyAccountant], force: bool = False) -> None:
    """Make ``accountant`` available as ``create_accountant(mechanism)``."""
    if not (isinstance(accountant, type) and issubclass(accountant, PrivacyAccountant)):
        raise TypeError(f"accountant must be a PrivacyAccountant subclass, got {accountant!r}")
    if mechanism in _ACCOUNTANTS and not force:
        raise ValueError(f"an accountant is already registered as {mechanism!r}; pass force=True to replace it")
    _ACCOUNTANTS[mechanism] = accountant


def create_accountant(mechanism: str) -> PrivacyAccountant:
    """A fresh accountant of the named kind (``"rdp"``, ``"prv"``, ``"gdp"``, or registered)."""
    if mechanism not in _ACCOUNTANTS:
        raise ValueError(f"unknown accountant {mechanism!r}; choose one of {available_accountants()}")
    return _ACCOUNTANTS[mechanism]()
