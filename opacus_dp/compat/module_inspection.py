"""Opacus 0.x's ``opacus.utils.module_inspection``: predicates over the layers of a model.

``ModelInspector(name, predicate)`` checks ``predicate`` on every sub-module; with
``check_leaf_nodes_only`` (the default) only on the modules owning a parameter that requires a
gradient (the others pass). ``violators`` collects ``"<name> (<Type>)"`` of each failing module
across calls. :class:`~opacus_dp.compat.model_inspector.DPModelInspector` is built from these.
"""

from typing import Callable, List, Optional

from torch import nn


def has_no_param(module: nn.Module) -> bool:
    """True if ``module`` owns no parameter (its sub-modules' are not counted)."""
    return not any(p is not None for p in module.parameters(recurse=False))


def requires_grad(module: nn.Module, recurse: bool = False) -> bool:
    """True if a parameter of ``module`` (with ``recurse``: or of a sub-module) requires a gradient."""
    return any(p.requires_grad for p in module.parameters(recurse))


def get_layer_type(layer: nn.Module) -> str:
    """The class name of ``layer`` (``"Conv2d"``)."""
    return type(layer).__name__


def is_trainable_leaf(module: nn.Module) -> bool:
    """A module owning a parameter that requires a gradient (what 0.x inspectors check)."""
    return not has_no_param(module) and requires_grad(module)


class ModelInspector:
    """Checks ``predicate(module)`` on the sub-modules of a model.

    Args:
        name: name of the check.
        predicate: ``module -> bool``, True when the module is fine.
        check_leaf_nodes_only: check only modules owning a trainable parameter (default True).
        message: what a violation means (for reports).
    """

    def __init__(self, name: str, predicate: Callable[[nn.Module], bool],
                 check_leaf_nodes_only: bool = True, message: Optional[str] = None):
        self.name = name
        self.check_leaf_nodes_only = check_leaf_nodes_only
        self._predicate = predicate
        self.message = message
        self.violators: List[str] = []  # kept across calls, as in Opacus 0.x

    def predicate(self, module: nn.Module) -> bool:
        """Whether ``module`` passes (modules without trainable parameters pass when
        ``check_leaf_nodes_only``)."""
        if self.check_leaf_nodes_only and not is_trainable_leaf(module):
            return True
        return bool(self._predicate(module))

    def validate(self, model: nn.Module) -> bool:
        """True if every sub-module of ``model`` (``model`` included) passes; failing ones are
        appended to ``violators``."""
        valid = True
        for name, module in model.named_modules():
            if not self.predicate(module):
                valid = False
                self.violators.append(f"{name} ({get_layer_type(module)})")
        return valid


__all__ = ["ModelInspector", "get_layer_type", "has_no_param", "is_trainable_leaf", "requires_grad"]
