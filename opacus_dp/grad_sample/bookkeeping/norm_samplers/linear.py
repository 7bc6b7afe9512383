"""Ghost norms and weighted gradients of ``nn.Linear`` (and the DP layers' ``BatchFirstLinear``).

Sample ``i`` has inputs ``a_t`` (rows of ``A_i``, ``T × d``) and output gradients ``g_t``
(rows of ``G_i``, ``T × p``) at its ``T`` positions (all middle dimensions flattened), so
its weight gradient is ``G_iᵀ A_i`` and (Li et al. 2022, "Large Language Models Can Be Strong
Differentially Private Learners", ghost clipping)

    ‖G_iᵀ A_i‖²_F = Σ_{t,s} (a_t · a_s)(g_t · g_s) = ⟨A_i A_iᵀ, G_i G_iᵀ⟩,

``O(T²(d + p))`` instead of ``O(T d p)``; for ``T = 1`` it is ``‖a‖² ‖g‖²``. The bias gradient
is ``Σ_t g_t``, which the norm sampler returns per sample. With factors ``f_i`` the weighted
sum of the per-sample weight gradients is the batch weight gradient of the scaled output
gradients: ``Σ_i f_i G_iᵀ A_i = (f ⊙ G)ᵀ A`` (one matrix product, the scale applied to the
smaller of ``A`` and ``G``, which also gives the product's rows: with ``d < p`` it is computed
as ``((f ⊙ A)ᵀ G)ᵀ``: the scale touches fewer elements, and the product with the smaller side
as its rows was the faster layout on CPU).
Several calls of the layer in one pass are merged by concatenating their positions.
"""

from typing import Dict, List, Sequence, Tuple

import torch
import torch.nn as nn

from opacus_dp.grad_sample.bookkeeping.norm_rules import register_norm_rule
from opacus_dp.grad_sample.bookkeeping.shared_input_grams import gradient_products, input_products
from opacus_dp.grad_sample.bookkeeping.norm_samplers.trust import (
    bound_from_diagonal, materialised_sq_norms, trusted_sq_norms)
from opacus_dp.grad_sample.support import sum_over_positions
from opacus_dp.maths.cpu_products import matrix_product
from opacus_dp.maths.views import joined
from opacus_dp.module_parameters import trainable
from opacus_dp.grad_sample.registry import PerSampleGrads, register_norm_sampler
from opacus_dp.layers.batch_first import BatchFirstLinear

LINEAR_TYPES = [nn.Linear, BatchFirstLinear]


def sequences(activations, backprops) -> Tuple[torch.Tensor, torch.Tensor]:
    """``A`` of shape ``(B, T, d)`` and ``G`` of shape ``(B, T, p)``."""
    g = backprops
    a = activations[0].to(g.dtype)
    batch = g.shape[0]
    return a.reshape(batch, -1, a.shape[-1]), g.reshape(batch, -1, g.shape[-1])


# Fewest rows of a block of the Gram products (see row_blocks): on CPU, and on other devices.
MIN_BLOCK_ROWS = 64
MIN_BLOCK_ROWS_ELSEWHERE = 128


def row_blocks(positions: int, device_type: str = "cpu") -> int:
    """How many row blocks :func:`gram_sq_norms` splits ``positions`` into: symmetry leaves
    ``(k + 1) / 2k`` of the Gram products, but a product of few rows does less work per element
    it loads and uses the matrix-product kernel poorly, so each block keeps at least
    ``MIN_BLOCK_ROWS`` = 64 rows on CPU (k = 1, 2, 4, 8 from T = 1, 128, 256, 512 on). Measured
    on CPU (one thread, AVX-512), the norms of ``Linear`` layers of 256–1024 features took
    0.76–0.88 × the one-block time at T = 128 in two blocks, and 64-row blocks beat 128-row ones
    at T = 256 to 1024; 32-row blocks gained little more, and fewer rows risk the kernel's
    efficiency on other machines (``scripts/benchmark_row_blocks.py`` compares them). On other
    devices, where every block is a kernel launch and nothing was measured, the earlier floor of
    ``MIN_BLOCK_ROWS_ELSEWHERE`` = 128 rows."""
    rows = MIN_BLOCK_ROWS if device_type == "cpu" else MIN_BLOCK_ROWS_ELSEWHERE
    blocks = 1
    while blocks < 8 and positions >= 2 * rows * blocks:
        blocks *= 2
    return blocks


def gram_sq_norms(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``‖G_iᵀ A_i‖²_F`` for every ``i`` from ``A (B, T, d)``, ``G (B, T, p)`` (module doc), checked
    against the Gram form's rounding under cancelling positions
    (:func:`~opacus_dp.grad_sample.bookkeeping.norm_samplers.trust.trusted_sq_norms`)."""
    if a.shape[1] == 1:  # one position: the product of two norms, no cancellation
        return a.pow(2).sum(dim=(1, 2)) * g.pow(2).sum(dim=(1, 2))
    sq_norms, diagonal = _gram_sq_norms_and_diagonal(a, g)
    batch, positions, elements = a.shape[0], a.shape[1], a.shape[2] * g.shape[2]

    def materialise(index: torch.Tensor):
        return materialised_sq_norms(index, batch, elements, lambda chunk: (a[chunk], g[chunk]))

    return trusted_sq_norms(sq_norms, bound_from_diagonal(diagonal), materialise, positions)


def _gram_sq_norms_and_diagonal(a: torch.Tensor, g: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``⟨A_i A_iᵀ, G_i G_iᵀ⟩`` and the diagonal ``‖a_t‖² ‖g_t‖²`` ``(B, T)`` of the product.

    With the positions cut into row blocks ``I_1 … I_k``, each block's rows of both Grams
    against the columns from the block's start on, ``R = A[I_j] A[I_j:]ᵀ``, hold its diagonal
    block once and its upper off-diagonal blocks, which stand for themselves and their
    transposes: ``⟨AAᵀ, GGᵀ⟩ = Σ_j 2⟨R_A, R_G⟩ − ⟨R_A, R_G⟩_diagonal block``. The input products
    ``R_A`` may come from another call on the same input, and ``R_G`` from the other projection of
    a recurrent cell (:mod:`~opacus_dp.grad_sample.bookkeeping.shared_input_grams`): those are only
    read.
    """
    positions = a.shape[1]
    blocks = row_blocks(positions, a.device.type)
    bounds = [positions * j // blocks for j in range(blocks + 1)]
    total, diagonals = None, []
    g_products, writable = gradient_products(g, bounds)
    for low, high, a_product, g_product in zip(bounds[:-1], bounds[1:], input_products(a, bounds), g_products):
        product = g_product.mul_(a_product) if writable else g_product * a_product
        if blocks == 1:
            return product.sum(dim=(1, 2)), product.diagonal(dim1=1, dim2=2)
        own_block = product[:, :, : high - low]
        part = 2 * product.sum(dim=(1, 2)) - own_block.sum(dim=(1, 2))
        total = part if total is None else total + part
        diagonals.append(own_block.diagonal(dim1=1, dim2=2))
    return total, torch.cat(diagonals, dim=1)


@register_norm_sampler(LINEAR_TYPES)
def linear_norm_sample(layer: nn.Linear, activations: List[torch.Tensor],
                       backprops: torch.Tensor) -> Dict[torch.Tensor, torch.Tensor]:
    """Per-sample squared norms of the weight gradient (ghost identity); the bias's per-sample
    gradients ``Σ_t g_t`` themselves (``B × p``, no larger than the norms' inputs)."""
    a, g = sequences(activations, backprops)
    norms = {}
    if trainable(layer.weight):
        norms[layer.weight] = gram_sq_norms(a, g)
    if trainable(layer.bias):
        norms[layer.bias] = PerSampleGrads(sum_over_positions(g))
    return norms


def scaled(t: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    return t * factors.to(t.dtype).view(-1, *[1] * (t.dim() - 1))


def linear_weighted_grad(layer: nn.Linear, activations: List[torch.Tensor], backprops: torch.Tensor,
                         factors: Dict[torch.Tensor, torch.Tensor]) -> Dict[torch.Tensor, torch.Tensor]:
    """``{weight: (f ⊙ G)ᵀ A, bias: Σ_i f_i Σ_t g_it}`` for the trainable parameters in
    ``factors`` (the weight's factors scale the smaller of ``A`` and ``G``)."""
    a, g = sequences(activations, backprops)
    sums = {}
    if trainable(layer.weight) and layer.weight in factors:
        f = factors[layer.weight]
        g_rows = g.reshape(-1, g.shape[-1])  # one copy at most (non-contiguous output gradients)
        if a.shape[-1] <= g.shape[-1]:  # rows of the product: the smaller side (module doc)
            a_f = scaled(a, f).reshape(-1, a.shape[-1])
            sums[layer.weight] = matrix_product(g_rows.t(), a_f)  # (p, d) as laid out: no transposed copy
        else:
            g_f = scaled(g_rows.view_as(g), f).view_as(g_rows)
            sums[layer.weight] = matrix_product(g_f.t(), a.reshape(-1, a.shape[-1]))
    if trainable(layer.bias) and layer.bias in factors:
        per_row = factors[layer.bias].to(g.dtype).repeat_interleave(g.shape[1])
        sums[layer.bias] = g.reshape(-1, g.shape[-1]).t().mv(per_row)
    return sums


def linear_merge_calls(layer: nn.Linear, calls: Sequence[Tuple[List[torch.Tensor], torch.Tensor]]):
    """One call with the positions of all ``calls`` concatenated (same batch); positions that are
    consecutive slices of one tensor are joined as a view of it, not copied."""
    pairs = [sequences(activations, backprops) for activations, backprops in calls]
    return [joined([a for a, _ in pairs], dim=1)], joined([g for _, g in pairs], dim=1)


def positions_of(activations: List[torch.Tensor]) -> int:
    """``T``: the positions per sample of a call's input ``(B, ..., d)``."""
    x = activations[0]
    return x[0].numel() // x.shape[-1] if x.shape[0] > 0 else 1


def ghost_is_cheaper(positions: int, d: int, p: int) -> bool:
    """Mixed ghost clipping rule: ghost iff ``2 T² < d · p`` (``T`` positions per sample)."""
    return 2 * positions * positions < d * p


def linear_prefers_ghost(layer: nn.Linear, activations: List[torch.Tensor]) -> bool:
    """:func:`ghost_is_cheaper` for the layer's features."""
    return ghost_is_cheaper(positions_of(activations), layer.in_features, layer.out_features)


# Chunked per-sample gradients replace the Gram products T²(d + p) by two passes over the d p
# values of each sample's gradient, in cache (opacus_dp.grad_sample.bookkeeping.chunked_sums);
# that pays once the Gram products are a sizeable multiple of d p: 16 d p is a little below
# where CPU timings of MLP layers (256 ↔ 1024) found the two paths even.
CHUNK_RULE = 16


def chunks_pay(positions: int, d: int, p: int) -> bool:
    """Per-layer clipping: form the per-sample gradients in chunks iff ``T²(d + p) ≥ 16 d p``."""
    return positions > 1 and positions * positions * (d + p) >= CHUNK_RULE * d * p


def linear_prefers_chunks(layer: nn.Linear, activations: List[torch.Tensor]) -> bool:
    """:func:`chunks_pay` for the layer's features."""
    return chunks_pay(positions_of(activations), layer.in_features, layer.out_features)


def chunk_grads_of(layer: nn.Module, activations: List[torch.Tensor], backprops: torch.Tensor,
                   input_major: bool = False):
    """``([weight], grads(rows, out), {bias: Σ_t g_t})``: the weight's per-sample gradients
    ``G_iᵀ A_i`` ``(n, p, d)`` (``input_major``: ``A_iᵀ G_i`` ``(n, d, p)``, a weight stored
    (in, out)) of the samples ``rows`` written into ``out[weight]``; the bias's (``B × p``, small)
    for the whole batch."""
    a, g = sequences(activations, backprops)
    whole = {layer.bias: sum_over_positions(g)} if trainable(layer.bias) else {}
    if not trainable(layer.weight):
        return [], None, whole
    left, right = (a, g) if input_major else (g, a)

    def grads(rows: slice, out: Dict[torch.Tensor, torch.Tensor]) -> Dict[torch.Tensor, torch.Tensor]:
        n = rows.stop - rows.start
        return {layer.weight: torch.bmm(left[rows].transpose(1, 2), right[rows], out=out[layer.weight][:n])}

    return [layer.weight], grads, whole


def linear_chunk_grads(layer: nn.Linear, activations: List[torch.Tensor], backprops: torch.Tensor):
    """:func:`chunk_grads_of` for a weight stored (out, in)."""
    return chunk_grads_of(layer, activations, backprops)


def materialising_is_lean(positions: int, d: int, p: int) -> bool:
    """Materialise when the per-sample gradient (``d · p``) is no larger than the kept
    ``A_i``, ``G_i`` (``T (d + p)``): the same memory, and faster, since the ghost path's
    Gram matrices and its clipped-sum product ``(f ⊙ G)ᵀ A`` are replaced by one weighted
    sum of the per-sample gradients: ``T d p + d p`` multiply-adds per sample (forming
    ``G_iᵀ A_i``, then the weighted add) against ``T²(d + p) + T d p``."""
    return d * p <= positions * (d + p)


def linear_materialise_if_kept(layer: nn.Linear, activations: List[torch.Tensor]) -> bool:
    """:func:`materialising_is_lean` for the layer's features."""
    return materialising_is_lean(positions_of(activations), layer.in_features, layer.out_features)


register_norm_rule(LINEAR_TYPES, weighted_grad=linear_weighted_grad,
                     merge_calls=linear_merge_calls, prefers_ghost=linear_prefers_ghost,
                     materialise_if_kept=linear_materialise_if_kept,
                     chunk_grads=linear_chunk_grads, prefers_chunks=linear_prefers_chunks,
                     shares_input_products=True)
