"""Per-sample gradients of Hugging Face's RMS norms (Llama, Qwen2, Mistral, T5).

These layers compute ``y = w ⊙ x̂`` with ``x̂ = x / sqrt(mean(x²) + ε)`` over the last dimension,
formed in float32 and cast back to the input's dtype (T5: to the weight's, if that is half
precision). For sample ``i`` with output gradients ``g_i[t]`` at its positions ``t`` (all middle
dimensions):

    dL_i/dw = Σ_t g_i[t] ⊙ x̂_i[t]

Without a rule they go through the ``torch.func`` fallback, which recomputes the layer per
sample. ``transformers`` is optional: the sampler is registered for the exact classes below once
their module is loaded (:mod:`~opacus_dp.grad_sample.optional_layers`); other RMS norms (Gemma's
``1 + w``) keep the fallback.
"""

from types import ModuleType
from typing import Dict, List

import torch
import torch.nn as nn

from opacus_dp.grad_sample.optional_layers import add_loader
from opacus_dp.grad_sample.registry import register_grad_sampler
from opacus_dp.grad_sample.support import sum_over_positions

HF_RMS_NORMS = {
    "transformers.models.llama.modeling_llama": "LlamaRMSNorm",
    "transformers.models.qwen2.modeling_qwen2": "Qwen2RMSNorm",
    "transformers.models.mistral.modeling_mistral": "MistralRMSNorm",
    "transformers.models.t5.modeling_t5": "T5LayerNorm",
}


def normalised(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x̂`` as the layer forms it: float32 statistics; Llama-style layers scale ``x`` in float32
    and cast back to its dtype, T5's scales ``x`` itself and casts to a half-precision weight's."""
    inverse_rms = torch.rsqrt(x.to(torch.float32).pow(2).mean(-1, keepdim=True) + layer.variance_epsilon)
    if type(layer).__name__ != "T5LayerNorm":
        return (x.to(torch.float32) * inverse_rms).to(x.dtype)
    x_hat = x * inverse_rms
    half = layer.weight.dtype in (torch.float16, torch.bfloat16)
    return x_hat.to(layer.weight.dtype) if half else x_hat


def hf_rms_norm_grad_sample(layer: nn.Module, activations: List[torch.Tensor],
                            backprops: torch.Tensor) -> Dict[torch.Tensor, torch.Tensor]:
    """Per-sample ``weight`` gradient ``(B, d)`` (batch on dim 0)."""
    if not layer.weight.requires_grad:
        return {}
    x_hat = normalised(layer, activations[0]).to(backprops.dtype)
    batch_size = backprops.shape[0]
    products = (backprops * x_hat).reshape(batch_size, -1, backprops.shape[-1])
    return {layer.weight: sum_over_positions(products)}


def _loader(class_name: str):
    def register(module: ModuleType) -> None:
        layer_type = getattr(module, class_name, None)
        if isinstance(layer_type, type):
            register_grad_sampler(layer_type)(hf_rms_norm_grad_sample)
    return register


for _module_name, _class_name in HF_RMS_NORMS.items():
    add_loader(_module_name, _loader(_class_name))
