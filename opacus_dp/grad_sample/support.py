"""Which modules can have per-sample gradients, and why some cannot.

A module needs per-sample gradients when it *owns* trainable parameters
(``module.parameters(recurse=False)``). It is supported when it has a registered grad
sampler or the generic ``torch.func`` fallback computes its per-sample gradients
correctly. The fallback is correct only for layers whose output for sample ``i``
depends on sample ``i`` alone and whose forward does not change parameters in place;
the layers below violate that and are refused.
"""

import contextlib
from typing import Iterator, Optional, Tuple

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.utils import parametrize

from opacus_dp.module_parameters import has_trainable_parameters, trains_anything


def sum_over_positions(x: torch.Tensor) -> torch.Tensor:
    """``Σ_s x[:, s, :]`` of a ``(B, T, p)`` tensor, shape ``(B, p)``, as the product
    ``1ᵀ x_i`` of each sample (a new tensor). On CPU the product reads ``x`` once, row by
    contiguous row, at memory speed, where ``x.sum(dim=1)``, a reduction over a middle
    dimension, is slower; other dtypes keep ``sum``."""
    if x.dtype in (torch.float32, torch.float64) and x.shape[1] > 1 and x.numel() > 0:
        return torch.bmm(x.new_ones(x.shape[0], 1, x.shape[1]), x).squeeze(1)
    return x.sum(dim=1)


def describe(path: str, module: nn.Module) -> str:
    """``model.features.3 (BatchNorm2d)``-style name of a submodule for messages."""
    return f"{path or '<root module>'} ({type(module).__name__})"


def _embedding_reason(module: nn.Module) -> Optional[str]:
    if module.sparse:
        return "sparse=True gradients are not supported; construct it with sparse=False"
    if module.max_norm is not None:
        return (
            "max_norm renormalises embedding rows in place during forward, which makes "
            "the per-sample gradient ill-defined; construct it with max_norm=None"
        )
    return None


PARAMETRIZATION_CAUSE = ("its weights come from torch.nn.utils.parametrize (weight_norm, spectral_norm, "
                         "orthogonal, ...)")
PARAMETRIZATION_FIX = "remove it with torch.nn.utils.parametrize.remove_parametrizations, or train without it"
PARAMETRIZATION_REASON = (
    f"{PARAMETRIZATION_CAUSE}: the parametrization computes a weight from its original parameters "
    f"without a batch, so no per-sample gradient of those parameters can be formed; {PARAMETRIZATION_FIX}"
)


def is_parametrization(module: nn.Module) -> bool:
    """True for a module with ``torch.nn.utils.parametrize`` parametrizations, or for the
    ``ParametrizationList`` holding their original parameters."""
    return parametrize.is_parametrized(module) or isinstance(module, parametrize.ParametrizationList)


def unsupported_reason(module: nn.Module) -> Optional[str]:
    """Why per-sample gradients of ``module`` cannot be computed, or None if they can."""
    if is_parametrization(module):
        return PARAMETRIZATION_REASON
    if isinstance(module, _BatchNorm):
        return (
            "batch normalisation mixes the samples of a batch; replace it with GroupNorm "
            "or LayerNorm (ModuleValidator.fix(model) does this)"
        )
    if isinstance(module, nn.RNNBase):
        return (
            "torch's fused RNN kernels expose no per-sample gradients; use "
            "opacus_dp.layers.DPLSTM / DPGRU / DPRNN (ModuleValidator.fix(model))"
        )
    if isinstance(module, nn.MultiheadAttention):
        return (
            "it uses its out_proj parameters without calling out_proj, so they get no "
            "per-sample gradients; use opacus_dp.layers.DPMultiheadAttention "
            "(ModuleValidator.fix(model))"
        )
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return _embedding_reason(module)
    if isinstance(module, (nn.ParameterDict, nn.ParameterList)):
        return PARAMETER_CONTAINER
    return None


PARAMETER_CONTAINER_CAUSE = (
    "a ParameterDict or ParameterList has no forward of its own: its trainable parameters are used "
    "by another module's forward, where no per-sample gradient is taken of them (per-sample "
    "gradients are formed per module, for the parameters it holds directly)")
PARAMETER_CONTAINER_FIX = (
    "register each parameter on the module that uses it (self.name = nn.Parameter(...)) or freeze it "
    "(requires_grad_(False)); PEFT's LoRA on an embedding (lora.Embedding keeps lora_embedding_A/B "
    "in ParameterDicts) is such a case: leave embedding layers out of target_modules")
PARAMETER_CONTAINER = f"{PARAMETER_CONTAINER_CAUSE}; {PARAMETER_CONTAINER_FIX}"


def rewrites_parameters_from_data(module: nn.Module) -> bool:
    """True for layers whose forward changes their own parameters from the batch, in place and
    without noise (``nn.Embedding``/``nn.EmbeddingBag`` with ``max_norm`` renormalise the rows a
    batch looks up): this leaks which rows were used, even when the parameters are frozen."""
    return isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.max_norm is not None


BATCHLESS_TABLE = (
    "it is looked up with position ids that have no batch dimension (T5's relative position "
    "buckets, shape (T, T)) and its output is added to every sample's attention scores, so the "
    "samples' gradients are summed before it sees them (with T equal to the batch size they "
    "would pass for per-sample ones); freeze it (requires_grad_(False)) or train without it"
)
BATCHLESS_TABLES = ("relative_attention_bias",)  # T5, mT5, LongT5, UMT5, Switch Transformers


def _batchless_table(path: str, module: nn.Module) -> bool:
    """A trainable embedding registered under a name of :data:`BATCHLESS_TABLES`."""
    return path.rsplit(".", 1)[-1] in BATCHLESS_TABLES and isinstance(module, nn.Embedding) \
        and has_trainable_parameters(module)


def unsupported_modules(root: nn.Module) -> Iterator[Tuple[str, nn.Module, str]]:
    """``(path, module, reason)`` for every submodule that is refused: those with trainable
    parameters and no correct per-sample gradients, (frozen or not) those that rewrite their
    parameters from the data (:func:`rewrites_parameters_from_data`), and trainable tables looked
    up without a batch dimension (:data:`BATCHLESS_TABLE`)."""
    for path, module in root.named_modules():
        if _batchless_table(path, module):
            yield path, module, BATCHLESS_TABLE
            continue
        if not (has_trainable_parameters(module) or rewrites_parameters_from_data(module)
                or (is_parametrization(module) and trains_anything(module))):
            continue
        reason = unsupported_reason(module)
        if reason is not None:
            yield path, module, reason


def autocast_in_effect(device_type: str) -> Optional[torch.dtype]:
    """The dtype ``torch.autocast`` casts to on ``device_type`` right now, or None if off."""
    try:
        enabled = torch.is_autocast_enabled(device_type)
        dtype = torch.get_autocast_dtype(device_type)
    except TypeError:  # torch < 2.4: per-device functions
        cpu = device_type == "cpu"
        enabled = torch.is_autocast_cpu_enabled() if cpu else torch.is_autocast_enabled()
        dtype = torch.get_autocast_cpu_dtype() if cpu else torch.get_autocast_gpu_dtype()
    return dtype if enabled else None


def autocast_of(layer: nn.Module) -> Optional[Tuple[str, torch.dtype]]:
    """``(device type, dtype)`` of the autocast in effect for ``layer``'s device, or None."""
    param = next(layer.parameters(recurse=False), None)
    device_type = param.device.type if param is not None else "cpu"
    dtype = autocast_in_effect(device_type)
    return None if dtype is None else (device_type, dtype)


def same_autocast(state: Optional[Tuple[str, torch.dtype]]):
    """A context entering the autocast ``state`` of :func:`autocast_of` (nothing for None)."""
    if state is None:
        return contextlib.nullcontext()
    return torch.autocast(state[0], dtype=state[1])
