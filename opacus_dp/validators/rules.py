"""The checks ``ModuleValidator`` applies to every sub-module.

Each rule looks at one module and returns ``None`` (fine) or a ``Problem``: why the module
cannot be trained privately as it is, the fix, and the error class. Modules with trainable
parameters and no dedicated grad sampler are fine: the generic ``torch.func`` fallback
computes their per-sample gradients, as long as they do not mix samples of a batch.
"""

from dataclasses import dataclass
from typing import Callable, List, Optional, Type

import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm
from torch.nn.parameter import UninitializedParameter

from opacus_dp.grad_sample.running_statistics import needs_replacement
from opacus_dp.grad_sample.support import (PARAMETER_CONTAINER_CAUSE, PARAMETER_CONTAINER_FIX, PARAMETRIZATION_CAUSE,
                                          PARAMETRIZATION_FIX, is_parametrization)
from opacus_dp.module_parameters import has_trainable_parameters, trains_anything
from opacus_dp.validators.module_errors import (
    IllegalModuleConfigurationError,
    ShouldReplaceModuleError,
    UnsupportedModuleError,
)

FIX_HINT = "ModuleValidator.fix(model)"
RNN_REPLACEMENTS = {nn.LSTM: "DPLSTM", nn.GRU: "DPGRU", nn.RNN: "DPRNN"}


@dataclass(frozen=True)
class Problem:
    """Why a module cannot be private, how to fix it, and which error class reports it."""

    reason: str
    fix: str
    error_class: Type[UnsupportedModuleError] = ShouldReplaceModuleError

    def error(self, path: str, module: nn.Module) -> UnsupportedModuleError:
        message = f"{path} ({type(module).__name__}) cannot be private: {self.reason}; fix: {self.fix}"
        return self.error_class(message)


def check_batch_norm(module: nn.Module) -> Optional[Problem]:
    """A trainable BatchNorm, or one without running statistics (it always normalises with the
    batch's), mixes the samples of a batch. A frozen one with running statistics passes here
    (as in Opacus); the wrappers check at every forward call that it applies them (see
    :mod:`opacus_dp.grad_sample.running_statistics`)."""
    if not isinstance(module, _BatchNorm) or not needs_replacement(module):
        return None
    return Problem(
        "BatchNorm mixes samples' statistics (each output depends on the whole batch)",
        f"{FIX_HINT} replaces it with GroupNorm",
    )


def check_instance_norm(module: nn.Module) -> Optional[Problem]:
    """InstanceNorm is per-sample, but running statistics are averaged over the batch without noise."""
    if not isinstance(module, _InstanceNorm) or not module.track_running_stats:
        return None
    return Problem(
        "track_running_stats=True updates running statistics from all samples of the batch without noise",
        f"{FIX_HINT} rebuilds it with track_running_stats=False",
        IllegalModuleConfigurationError,
    )


def check_recurrent(module: nn.Module) -> Optional[Problem]:
    """torch's fused RNN kernels expose no per-step inputs, so no per-sample gradients."""
    if not isinstance(module, nn.RNNBase) or not has_trainable_parameters(module):
        return None
    replacement = RNN_REPLACEMENTS.get(type(module))
    if replacement is None:
        return Problem(
            "its fused recurrent kernel gives no per-sample gradients",
            "rebuild it from opacus_dp.layers.DPLSTM / DPGRU / DPRNN",
        )
    return Problem(
        "torch's fused recurrent kernel gives no per-sample gradients",
        f"{FIX_HINT} replaces it with opacus_dp.layers.{replacement} (same weights)",
    )


def check_multihead_attention(module: nn.Module) -> Optional[Problem]:
    """nn.MultiheadAttention uses its weights inside one fused functional call."""
    if not isinstance(module, nn.MultiheadAttention) or not trains_anything(module):
        return None
    return Problem(
        "its projections run inside one fused functional call that gives no per-sample gradients",
        f"{FIX_HINT} replaces it with opacus_dp.layers.DPMultiheadAttention (same weights)",
    )


def check_uninitialized(module: nn.Module) -> Optional[Problem]:
    """Lazy modules have no parameter shapes before their first forward pass."""
    if not any(isinstance(p, UninitializedParameter) for p in module.parameters(recurse=False)):
        return None
    return Problem(
        "it has uninitialized (lazy) parameters",
        "run one forward pass on a batch before making the model private",
        IllegalModuleConfigurationError,
    )


def check_parametrization(module: nn.Module) -> Optional[Problem]:
    """``torch.nn.utils.parametrize``: a weight computed from original parameters with no batch
    (the per-sample gradients of the originals cannot be formed)."""
    if not is_parametrization(module) or not trains_anything(module):
        return None
    return Problem(f"{PARAMETRIZATION_CAUSE} with trainable originals", PARAMETRIZATION_FIX,
                   UnsupportedModuleError)


def check_parameter_container(module: nn.Module) -> Optional[Problem]:
    """A ``ParameterDict``/``ParameterList`` holding trainable parameters: another module's forward
    uses them, and per-sample gradients are formed per module for its own parameters."""
    if not isinstance(module, (nn.ParameterDict, nn.ParameterList)) or not has_trainable_parameters(module):
        return None
    return Problem(PARAMETER_CONTAINER_CAUSE, PARAMETER_CONTAINER_FIX, UnsupportedModuleError)


def check_embedding_options(module: nn.Module) -> Optional[Problem]:
    """``max_norm`` rewrites the looked-up rows in place (no noise, even when frozen);
    ``sparse=True`` gradients have no per-sample form."""
    if not isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return None
    if module.max_norm is not None:
        return Problem(
            "max_norm renormalises the embedding rows used by the batch in place, without noise",
            "construct it with max_norm=None",
            IllegalModuleConfigurationError,
        )
    if module.sparse and has_trainable_parameters(module):
        return Problem(
            "sparse=True gradients have no per-sample form",
            "construct it with sparse=False",
            IllegalModuleConfigurationError,
        )
    return None


MODULE_RULES: List[Callable[[nn.Module], Optional[Problem]]] = [
    check_batch_norm,
    check_instance_norm,
    check_recurrent,
    check_multihead_attention,
    check_uninitialized,
    check_embedding_options,
    check_parametrization,
    check_parameter_container,
]


def no_trainable_parameters_error(model: nn.Module, root_name: str) -> Optional[UnsupportedModuleError]:
    """An error when no parameter of ``model`` requires a gradient."""
    if trains_anything(model):
        return None
    return IllegalModuleConfigurationError(
        f"{root_name} ({type(model).__name__}) has no trainable parameters: nothing to train privately; "
        "fix: set requires_grad=True on the parameters to train"
    )


def eval_mode_error(model: nn.Module, root_name: str) -> IllegalModuleConfigurationError:
    """The error of a model in eval mode (Opacus 1.x's "Model needs to be in training mode")."""
    return IllegalModuleConfigurationError(
        f"{root_name} ({type(model).__name__}) is in eval mode: the model needs to be in training mode "
        "to be made private; fix: call model.train() first (sub-modules that must stay frozen, e.g. "
        "a BatchNorm with running statistics, may be put in eval mode afterwards)"
    )
