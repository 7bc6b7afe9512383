"""The user's model inside its wrappers, and the names of its parameters.

Wrappers: the per-sample gradient wrappers (``GradSampleModule`` and its subclasses keep the
model as the sub-module ``_module``, as Opacus does), ``nn.DataParallel``,
``DistributedDataParallel``, and the types registered with :func:`register_wrapper_type`
(``DPDDP``), which keep it as ``module``; and what ``torch.compile(model)`` returns (an
``OptimizedModule``, which keeps it as ``_orig_mod``: a model compiled by other software, such as
the ``Trainer``'s ``torch_compile=True``).
"""

from typing import Dict, List, Type

import torch
import torch.nn as nn

from opacus_dp.torch_internals import is_compiled_module

_WRAPPER_TYPES: List[Type[nn.Module]] = [nn.DataParallel, nn.parallel.DistributedDataParallel]


def register_wrapper_type(cls: Type[nn.Module]) -> Type[nn.Module]:
    """Declare ``cls`` a wrapper whose ``module`` attribute is the wrapped model (a decorator)."""
    if cls not in _WRAPPER_TYPES:
        _WRAPPER_TYPES.append(cls)
    return cls


def _inner(module: nn.Module):
    modules = module.__dict__.get("_modules", {})
    inner = modules.get("_module")
    if inner is None and isinstance(module, tuple(_WRAPPER_TYPES)):
        inner = module.module
    if inner is None and is_compiled_module(module):
        inner = modules.get("_orig_mod")
    return inner


def unwrap_model(module: nn.Module) -> nn.Module:
    """The user's model inside any nesting of the wrappers of the module doc."""
    seen = {id(module)}
    inner = _inner(module)
    while inner is not None and id(inner) not in seen:
        module, seen = inner, seen | {id(inner)}
        inner = _inner(module)
    return module


def parameter_names(module: nn.Module) -> Dict[torch.Tensor, str]:
    """``{param: qualified name in the user's model}``, for error messages."""
    return {p: name for name, p in unwrap_model(module).named_parameters()}
