"""``ModuleValidator``: find the sub-modules that break DP-SGD, and replace the fixable ones.

A model can be trained privately when (i) every per-sample gradient depends on its own sample
only, and (ii) each trainable parameter's per-sample gradient can be computed (a dedicated grad
sampler, a DP layer, or the generic ``torch.func`` fallback). The rules are in
``opacus_dp.validators.rules``; the replacements in ``opacus_dp.validators.fixers``.
Error messages read ``"<path> (<Type>) cannot be private: <why>; fix: <how>"``, where the
path starts with ``model`` (``model.features.3``).
"""

import copy
import logging
from typing import Callable, Dict, List, Optional, Type

import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

from opacus_dp.grad_sample.formula_class import formula_class
from opacus_dp.grad_sample.running_statistics import needs_replacement
from opacus_dp.module_parameters import has_trainable_parameters, trains_anything
from opacus_dp.validators import fixers
from opacus_dp.validators.module_errors import UnsupportedModuleError, combined_error
from opacus_dp.validators.rules import (
    MODULE_RULES,
    RNN_REPLACEMENTS,
    eval_mode_error,
    no_trainable_parameters_error,
)

logger = logging.getLogger(__name__)
ROOT_NAME = "model"


def module_path(name: str) -> str:
    """``"features.3"`` -> ``"model.features.3"``; the root itself is ``"model"``."""
    return f"{ROOT_NAME}.{name}" if name else ROOT_NAME


def _custom_errors(validator: Callable, module: nn.Module, path: str) -> List[UnsupportedModuleError]:
    """Run a user-registered validator and prefix its messages with the module path."""
    errors = []
    for error in validator(module) or []:
        if not isinstance(error, UnsupportedModuleError):
            error = UnsupportedModuleError(str(error))
        errors.append(type(error)(f"{path} ({type(module).__name__}) cannot be private: {error}"))
    return errors


def _disable_fused_encoder_paths(model: nn.Module) -> None:
    """``nn.TransformerEncoder`` decides at construction to run its fused (nested-tensor)
    inference path, which reads ``nn.MultiheadAttention``'s packed in-projection; once its
    attention is replaced, that path must be off (the layers then call the DP attention)."""
    for sub_module in model.modules():
        if isinstance(sub_module, nn.TransformerEncoder) and any(
                not isinstance(getattr(layer, "self_attn", None), nn.MultiheadAttention)
                for layer in sub_module.layers):
            sub_module.use_nested_tensor = False


class ModuleValidator:
    """Namespace for ``validate`` / ``is_valid`` / ``fix`` / ``fix_and_validate`` (Opacus 1.x API).

    ``VALIDATORS`` / ``FIXERS`` hold user registrations (exact type -> function; a validator also
    applies to FSDP2's class for a layer passed to ``fully_shard`` itself), see
    ``register_module_validator`` / ``register_module_fixer``; they run in addition to
    (validators) or instead of (fixers) the built-in rules.
    """

    VALIDATORS: Dict[Type[nn.Module], Callable] = {}
    FIXERS: Dict[Type[nn.Module], Callable] = {}

    @classmethod
    def validate(cls, module: nn.Module, *, strict: bool = False) -> List[UnsupportedModuleError]:
        """All problems of ``module`` and its sub-modules; ``strict=True`` raises them as one error.

        As in Opacus 1.x a model in eval mode is reported (``module.training`` is False). Beyond
        Opacus: a model with nothing trainable, and the sub-modules that break the privacy
        guarantee or have no per-sample gradients (see :mod:`opacus_dp.validators.rules`)."""
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        errors: List[UnsupportedModuleError] = []
        if not module.training:  # Opacus 1.x: the model must be in training mode
            errors.append(eval_mode_error(module, ROOT_NAME))
        errors.extend(cls.sub_module_errors(module))
        no_params = no_trainable_parameters_error(module, ROOT_NAME)
        if no_params is not None:
            errors.append(no_params)
        if strict and errors:
            raise combined_error(errors)
        return errors

    @classmethod
    def sub_module_errors(cls, module: nn.Module) -> List[UnsupportedModuleError]:
        """The problems of the sub-modules (``module`` included) alone: the built-in rules and the
        registered validators, without the whole model's (training mode, anything trainable)."""
        errors: List[UnsupportedModuleError] = []
        for name, sub_module in module.named_modules():
            path = module_path(name)
            for rule in MODULE_RULES:
                problem = rule(sub_module)
                if problem is not None:
                    errors.append(problem.error(path, sub_module))
            custom = cls.VALIDATORS.get(formula_class(sub_module))  # also a layer FSDP2 sharded itself
            if custom is not None:
                errors.extend(_custom_errors(custom, sub_module, path))
        return errors

    @classmethod
    def is_valid(cls, module: nn.Module) -> bool:
        """True when ``validate`` finds no problem."""
        return not cls.validate(module)

    @classmethod
    def fix(
        cls, module: nn.Module, *, num_groups: Optional[int] = None, replace_bn_with_in: bool = False
    ) -> nn.Module:
        """A fixed deep copy of ``module`` (the argument is left untouched).

        * trainable BatchNorm1d/2d/3d, SyncBatchNorm -> GroupNorm(``num_groups`` or gcd(32, C),
          as Opacus, C) with the affine weights copied; with ``replace_bn_with_in=True`` the
          InstanceNorm of the same dimensionality instead; also one without running statistics.
          A frozen BatchNorm with running statistics is kept (as Opacus): it must run in eval
          mode (checked at every recorded forward call);
        * InstanceNorm with ``track_running_stats=True`` -> the same without running statistics;
        * trainable nn.LSTM / nn.GRU / nn.RNN -> DPLSTM / DPGRU / DPRNN, nn.MultiheadAttention ->
          DPMultiheadAttention, with the same weights (outputs unchanged).
        """
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if replace_bn_with_in and num_groups is not None:
            raise ValueError("num_groups and replace_bn_with_in=True are mutually exclusive: choose one norm")
        fixed = copy.deepcopy(module)
        replaced: List[str] = []
        replacements: Dict[int, Optional[nn.Module]] = {}  # a module used at several paths: one replacement
        for name, sub_module in list(fixed.named_modules(remove_duplicate=False)):
            if any(name.startswith(prefix + ".") for prefix in replaced):
                continue  # inside a module that has already been replaced
            if id(sub_module) not in replacements:
                replacements[id(sub_module)] = cls._replacement(sub_module, name, num_groups, replace_bn_with_in)
            replacement = replacements[id(sub_module)]
            if replacement is None:
                continue
            logger.info("Replaced sub_module %s : %s with %s", module_path(name), type(sub_module).__name__,
                        type(replacement).__name__)  # Opacus's wording
            if not name:
                return replacement
            _set_submodule(fixed, name, replacement)
            replaced.append(name)
        _disable_fused_encoder_paths(fixed)
        return fixed

    @classmethod
    def _replacement(cls, sub_module, name, num_groups, replace_bn_with_in) -> Optional[nn.Module]:
        custom = cls.FIXERS.get(type(sub_module))
        if custom is not None:
            return custom(sub_module)
        try:
            return _builtin_replacement(sub_module, num_groups, replace_bn_with_in)
        except ValueError as error:
            raise ValueError(f"{module_path(name)} ({type(sub_module).__name__}): {error}") from error

    @classmethod
    def fix_and_validate(
        cls, module: nn.Module, *, num_groups: Optional[int] = None, replace_bn_with_in: bool = False
    ) -> nn.Module:
        """``fix`` followed by ``validate(strict=True)`` on the fixed copy."""
        fixed = cls.fix(module, num_groups=num_groups, replace_bn_with_in=replace_bn_with_in)
        cls.validate(fixed, strict=True)
        return fixed


def _builtin_replacement(module: nn.Module, num_groups, replace_bn_with_in) -> Optional[nn.Module]:
    if isinstance(module, _BatchNorm) and needs_replacement(module):
        if replace_bn_with_in:
            return fixers.batchnorm_to_instancenorm(module)
        return fixers.batchnorm_to_groupnorm(module, num_groups=num_groups)
    if isinstance(module, _InstanceNorm) and module.track_running_stats:
        return fixers.instancenorm_without_running_stats(module)
    if type(module) in RNN_REPLACEMENTS and has_trainable_parameters(module):
        return fixers.recurrent_to_dp(module)
    if type(module) is nn.MultiheadAttention and trains_anything(module):
        return fixers.multihead_attention_to_dp(module)
    return None


def _set_submodule(root: nn.Module, name: str, replacement: nn.Module) -> None:
    parent_name, _, child_name = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child_name, replacement)
