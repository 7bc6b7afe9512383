"""Ghost norms and weighted gradients of Hugging Face ``transformers.pytorch_utils.Conv1D``.

``Conv1D`` (GPT-2 family) is a linear layer with its weight stored as ``(in, out)``:
``y = x W + b``. Sample ``i`` with inputs ``A_i`` (``T × d``, ``d = in``) and output gradients
``G_i`` (``T × p``, ``p = out``) has the weight gradient ``A_iᵀ G_i``, the transpose of a
``Linear`` layer's ``G_iᵀ A_i``, so (see :mod:`.linear`)

    ‖A_iᵀ G_i‖²_F = ⟨A_i A_iᵀ, G_i G_iᵀ⟩,        Σ_i f_i A_iᵀ G_i = (f ⊙ A)ᵀ G,

the factors scaling the smaller of ``A`` and ``G``. The norm sampler, the merge of several calls
(positions concatenated) and the bias (``Σ_t g_t``) are ``Linear``'s; so are the cost rules, with
``d = in`` and ``p = out``. Registered with the grad sampler, once ``transformers`` is loaded
(:mod:`opacus_dp.grad_sample.hf_conv1d`).
"""

from typing import Dict, List

import torch
import torch.nn as nn

from opacus_dp.grad_sample.bookkeeping.norm_samplers.linear import (
    chunk_grads_of, chunks_pay, ghost_is_cheaper, linear_merge_calls, linear_norm_sample, linear_weighted_grad,
    materialising_is_lean, positions_of, scaled, sequences)
from opacus_dp.maths.cpu_products import matrix_product
from opacus_dp.module_parameters import trainable


def _in_out(layer: nn.Module):
    return layer.weight.shape[0], layer.weight.shape[1]


def conv1d_weighted_grad(layer: nn.Module, activations: List[torch.Tensor], backprops: torch.Tensor,
                         factors: Dict[torch.Tensor, torch.Tensor]) -> Dict[torch.Tensor, torch.Tensor]:
    """``{weight: (f ⊙ A)ᵀ G, bias: Σ_i f_i Σ_t g_it}`` for the trainable parameters in ``factors``."""
    others = {p: f for p, f in factors.items() if p is not layer.weight}
    sums = linear_weighted_grad(layer, activations, backprops, others)  # the bias, as Linear's
    if trainable(layer.weight) and layer.weight in factors:
        f = factors[layer.weight]
        a, g = sequences(activations, backprops)
        d, p = a.shape[-1], g.shape[-1]
        if d <= p:  # scale the smaller side
            sums[layer.weight] = matrix_product(scaled(a, f).reshape(-1, d).t(), g.reshape(-1, p))
        else:
            sums[layer.weight] = matrix_product(a.reshape(-1, d).t(), scaled(g, f).reshape(-1, p))
    return sums


def conv1d_chunk_grads(layer: nn.Module, activations: List[torch.Tensor], backprops: torch.Tensor):
    """The per-sample gradients ``A_iᵀ G_i`` ``(n, d, p)`` in chunks (:func:`chunk_grads_of`)."""
    return chunk_grads_of(layer, activations, backprops, input_major=True)


def conv1d_prefers_ghost(layer: nn.Module, activations: List[torch.Tensor]) -> bool:
    return ghost_is_cheaper(positions_of(activations), *_in_out(layer))


def conv1d_prefers_chunks(layer: nn.Module, activations: List[torch.Tensor]) -> bool:
    return chunks_pay(positions_of(activations), *_in_out(layer))


def conv1d_materialise_if_kept(layer: nn.Module, activations: List[torch.Tensor]) -> bool:
    return materialising_is_lean(positions_of(activations), *_in_out(layer))


# the NormRule fields of Conv1D (opacus_dp.grad_sample.bookkeeping.norm_rules.register_norm_rule)
CONV1D_NORM_RULE = dict(
    norm_sampler=linear_norm_sample, weighted_grad=conv1d_weighted_grad,
    merge_calls=linear_merge_calls, prefers_ghost=conv1d_prefers_ghost,
    materialise_if_kept=conv1d_materialise_if_kept, chunk_grads=conv1d_chunk_grads,
    prefers_chunks=conv1d_prefers_chunks, shares_input_products=True)
