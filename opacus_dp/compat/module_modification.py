"""Classic module surgery helpers (Opacus 0.x ``opacus.utils.module_modification``).

``convert_batchnorm_modules`` works in place, like 0.x. The default converter builds a
GroupNorm whose group count is the largest divisor of the channel count that is ≤ 32 (0.x's
``min(32, C)`` wherever that was valid; 0.x failed for C > 32 not divisible by 32), with eps
and affine weights kept. (``ModuleValidator.fix`` uses 1.x's ``gcd(32, C)``.)
The 1.x way is ``ModuleValidator.fix(model)``, which returns a fixed copy.
"""

from typing import Callable, Type

import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

from opacus_dp.validators.fixers import batchnorm_to_groupnorm, batchnorm_to_instancenorm, classic_num_groups


def _batchnorm_to_groupnorm(module: _BatchNorm) -> nn.GroupNorm:
    """Default converter: GroupNorm(largest divisor of C that is ≤ 32, C)."""
    return batchnorm_to_groupnorm(module, num_groups=classic_num_groups(module.num_features))


def _batchnorm_to_instancenorm(module: _BatchNorm) -> nn.Module:
    """Converter: the InstanceNorm of the same dimensionality."""
    return batchnorm_to_instancenorm(module)


def _nullify_batch_norm(module: _BatchNorm) -> nn.Identity:
    """Converter: drop the normalisation (an ``nn.Identity``)."""
    return nn.Identity()


def replace_all_modules(root: nn.Module, target_class: Type[nn.Module], converter: Callable) -> nn.Module:
    """Replace, in place, every sub-module that is an instance of ``target_class`` by ``converter(sub_module)``.

    Returns ``root`` (or ``converter(root)`` when ``root`` itself is a ``target_class``).
    Replaced modules are not searched further.
    """
    if isinstance(root, target_class):
        return converter(root)
    for name, child in list(root.named_children()):
        if isinstance(child, target_class):
            setattr(root, name, converter(child))
        else:
            replace_all_modules(child, target_class, converter)
    return root


def convert_batchnorm_modules(model: nn.Module, converter: Callable = _batchnorm_to_groupnorm) -> nn.Module:
    """Replace every BatchNorm (1d/2d/3d, SyncBatchNorm) of ``model`` in place; returns the model."""
    return replace_all_modules(model, _BatchNorm, converter)


def nullify_batchnorm_modules(root: nn.Module) -> nn.Module:
    """Replace every BatchNorm of ``root`` by ``nn.Identity`` in place."""
    return replace_all_modules(root, _BatchNorm, _nullify_batch_norm)


__all__ = [
    "convert_batchnorm_modules",
    "nullify_batchnorm_modules",
    "replace_all_modules",
]
