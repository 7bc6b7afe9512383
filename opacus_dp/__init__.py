"""opacus_dp: differentially private training (DP-SGD) for PyTorch.

The public entry points are imported lazily so that ``import opacus_dp`` stays cheap
and sub-packages can be used on their own (e.g. only the accountants).
"""

import importlib

from opacus_dp.submodules import submodule_getattr
from opacus_dp.version import __version__

_LAZY = {
    "PrivacyEngine": "opacus_dp.engine.modern",
    "GradSampleModule": "opacus_dp.grad_sample",
    "GradSampleModuleFastGradientClipping": "opacus_dp.grad_sample",
    "DPOptimizer": "opacus_dp.optim",
    "DPDataLoader": "opacus_dp.data",
    "BatchMemoryManager": "opacus_dp.data",
    "PrivacyBudgetExceededError": "opacus_dp.errors",
    "install_as_opacus": "opacus_dp.integrations",
    "set_cpu_products": "opacus_dp.maths.cpu_products",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name):
    """The lazy entry points, and any sub-module by attribute (see :mod:`opacus_dp.submodules`)."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    return submodule_getattr(__name__)(name)
