"""Module helpers under Opacus 1.x's path ``opacus.utils.module_utils`` (compatibility).

A module *owns* the parameters of ``module.parameters(recurse=False)``; "trainable" means
``requires_grad``.
"""

import copy
from typing import Dict, Iterator, Tuple

import torch
import torch.nn as nn


def has_trainable_params(module: nn.Module) -> bool:
    """True if ``module`` owns a parameter that requires a gradient."""
    return requires_grad(module)


def requires_grad(module: nn.Module, *, recurse: bool = False) -> bool:
    """True if a parameter of ``module`` (its own, or also its sub-modules' with ``recurse``)
    requires a gradient."""
    return any(p.requires_grad for p in module.parameters(recurse=recurse))


def parametrized_modules(module: nn.Module) -> Iterator[Tuple[str, nn.Module]]:
    """``(name, sub-module)`` for every sub-module (``module`` included) owning a parameter."""
    return ((name, m) for name, m in module.named_modules() if next(m.parameters(recurse=False), None) is not None)


def trainable_modules(module: nn.Module) -> Iterator[Tuple[str, nn.Module]]:
    """``(name, sub-module)`` for every sub-module owning a parameter that requires a gradient."""
    return ((name, m) for name, m in module.named_modules() if has_trainable_params(m))


def trainable_parameters(module: nn.Module) -> Iterator[Tuple[str, nn.Parameter]]:
    """``(name, parameter)`` for every parameter of ``module`` that requires a gradient."""
    return ((name, p) for name, p in module.named_parameters() if p.requires_grad)


def clone_module(module: nn.Module) -> nn.Module:
    """An independent deep copy of ``module`` (with whatever hooks it carries: clone a model
    before wrapping it, not the wrapped one)."""
    return copy.deepcopy(module)


def get_submodule(module: nn.Module, target: str) -> nn.Module:
    """``module.get_submodule(target)`` (``""`` is ``module`` itself)."""
    return module.get_submodule(target)


def are_state_dict_equal(first: Dict[str, torch.Tensor], second: Dict[str, torch.Tensor]) -> bool:
    """True if both state dicts have the same keys and ``allclose`` values."""
    return first.keys() == second.keys() and all(torch.allclose(first[k], second[k]) for k in first)
