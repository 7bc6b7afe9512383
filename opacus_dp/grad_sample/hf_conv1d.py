"""Per-sample gradients of Hugging Face ``transformers.pytorch_utils.Conv1D`` (GPT-2 family).

``Conv1D`` is a linear layer with its weight stored as ``(in, out)``: ``y = x W + b``. For
sample ``i`` with inputs ``x_i[t]`` and output gradients ``g_i[t]`` at its positions ``t`` (all
middle dimensions):

    dL_i/dW = Σ_t x_i[t]ᵀ g_i[t]      (in, out)
    dL_i/db = Σ_t g_i[t]              (out,)

``transformers`` is optional: the grad sampler and the norm rule
(:mod:`~opacus_dp.grad_sample.bookkeeping.norm_samplers.hf_conv1d`) are registered for ``Conv1D``
once ``transformers.pytorch_utils`` is loaded, which a model holding a ``Conv1D`` has done
(:mod:`~opacus_dp.grad_sample.optional_layers`); nothing imports ``transformers`` here.
"""

from types import ModuleType
from typing import Dict, List

import torch
import torch.nn as nn

from opacus_dp.grad_sample.bookkeeping.norm_rules import register_norm_rule
from opacus_dp.grad_sample.bookkeeping.norm_samplers.hf_conv1d import CONV1D_NORM_RULE
from opacus_dp.grad_sample.optional_layers import add_loader
from opacus_dp.grad_sample.registry import register_grad_sampler
from opacus_dp.maths.cpu_products import outer_sums
from opacus_dp.grad_sample.support import sum_over_positions

HF_MODULE = "transformers.pytorch_utils"


def conv1d_grad_sample(layer: nn.Module, activations: List[torch.Tensor],
                       backprops: torch.Tensor) -> Dict[torch.Tensor, torch.Tensor]:
    """Per-sample ``weight`` ``(B, in, out)`` and ``bias`` ``(B, out)`` gradients (batch on dim 0)."""
    x = activations[0]
    batch_size = x.shape[0]
    x = x.reshape(batch_size, -1, x.shape[-1]).to(backprops.dtype)
    g = backprops.reshape(batch_size, -1, backprops.shape[-1])
    grads = {}
    if layer.weight.requires_grad:
        grads[layer.weight] = outer_sums(x, g)
    if layer.bias is not None and layer.bias.requires_grad:
        grads[layer.bias] = sum_over_positions(g)
    return grads


def register_conv1d(module: ModuleType) -> None:
    """Register the grad sampler and the norm rule of ``module.Conv1D`` (``transformers.pytorch_utils``)."""
    conv1d = getattr(module, "Conv1D", None)
    if isinstance(conv1d, type):
        register_grad_sampler(conv1d)(conv1d_grad_sample)
        register_norm_rule(conv1d, **CONV1D_NORM_RULE)


add_loader(HF_MODULE, register_conv1d)
