"""Privacy accountants for DP-SGD: RDP, PRV (numerical composition, the default) and GDP.

``create_accountant(name)`` builds one by name; ``get_noise_multiplier`` calibrates σ for a
budget.  Each accountant records ``(σ, q)`` per step in ``history`` and reports ε(δ).
"""

from opacus_dp.accountants.accountant import IAccountant
from opacus_dp.accountants.privacy_accountant import PrivacyAccountant
from opacus_dp.accountants.calibration import get_noise_multiplier
from opacus_dp.accountants.gdp import GaussianAccountant
from opacus_dp.accountants.prv import PRVAccountant
from opacus_dp.accountants.rdp import RDPAccountant
from opacus_dp.accountants.registry import available_accountants, create_accountant, register_accountant

DEFAULT_ACCOUNTANT = "prv"

__all__ = [
    "DEFAULT_ACCOUNTANT",
    "GaussianAccountant",
    "IAccountant",
    "PRVAccountant",
    "PrivacyAccountant",
    "RDPAccountant",
    "available_accountants",
    "create_accountant",
    "get_noise_multiplier",
    "register_accountant",
]

from opacus_dp.submodules import submodule_getattr  # noqa: E402

__getattr__ = submodule_getattr(__name__)  # sub-modules as attributes, as in Opacus
