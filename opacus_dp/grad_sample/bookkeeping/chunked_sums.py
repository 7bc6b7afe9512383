"""Per-layer clipping on CPU: a layer's clipped sum from per-sample gradients formed a few
samples at a time.

With per-layer clipping the factors ``f_i = min(1, C_l / (‖g_il‖ + 1e-6))`` of a tensor depend
on its own per-sample norms only, so the ``bk`` mode finishes a layer's clipped sum
``Σ_i f_i g_i`` during the backward pass. For a ``Linear`` over ``T`` positions (``d`` inputs,
``p`` outputs) the ghost path pays, per sample, the Gram products ``T²(d + p)`` for the norm
and then the clipped-sum product ``T d p``. Forming the per-sample gradients ``G_iᵀ A_i``
(``T d p`` per sample: the same multiply-adds as the batch weight gradient) for ``c`` samples
at a time into one reused buffer of about :data:`CHUNK_BYTES`, which stays in the CPU's cache,
replaces the Gram products by two passes over the chunk's ``c d p`` values (the norms, and the
weighted add ``S += Σ_{i∈chunk} f_i g_i``), both over data already in cache, so they cost
little next to the Gram products once those are a multiple of ``d p`` (the layer type's
``prefers_chunks`` decides, e.g. ``CHUNK_RULE`` of the ``Linear`` norm sampler).
Without a reused buffer (fresh memory per chunk) every chunk pays page faults and cache misses,
and the chunks lose to the ghost path. A layer type opts in with ``chunk_grads`` and
``prefers_chunks`` in its :class:`~opacus_dp.grad_sample.bookkeeping.norm_rules.NormRule`.

On GPU the ghost path is kept (a loop over small chunks would launch many small kernels;
unmeasured there).
"""

import math
from typing import Callable, Dict, List, Optional, Tuple

import torch

from opacus_dp.maths.per_sample import (drops_rows, finite_factors, per_sample_norms, sum_dtype,
                                        without_dropped_rows)
from opacus_dp.maths.float32_products import ieee_float32_products

CHUNK_BYTES = 4 << 20  # per-sample gradients of one chunk: small enough to stay in cache
KEPT_BUFFER_BYTES = 8 << 20  # a buffer up to this size is kept for the next layer and step


class ChunkBuffer:
    """One flat tensor reused for every chunk (and, up to :data:`KEPT_BUFFER_BYTES`, for every
    layer and step: freshly mapped memory would cost a page fault per 4 KiB each time)."""

    def __init__(self):
        self._flat: Optional[torch.Tensor] = None

    def views(self, shapes: List[Tuple[int, ...]], dtype: torch.dtype,
              device: torch.device) -> List[torch.Tensor]:
        """Disjoint tensors of ``shapes`` in the buffer (grown when too small)."""
        sizes = [math.prod(s) for s in shapes]
        flat = self._flat
        if flat is None or flat.numel() < sum(sizes) or flat.dtype != dtype or flat.device != device:
            flat = torch.empty(sum(sizes), dtype=dtype, device=device)
        self._flat = flat if flat.numel() * flat.element_size() <= KEPT_BUFFER_BYTES else None
        views, offset = [], 0
        for shape, size in zip(shapes, sizes):
            views.append(flat[offset:offset + size].view(shape))
            offset += size
        return views


def chunk_size(params: List[torch.Tensor], batch: int, dtype: torch.dtype) -> int:
    """Samples per chunk: as many as fit :data:`CHUNK_BYTES` with one per-sample gradient of
    every parameter each (at least one, at most the batch)."""
    per_sample = sum(p.numel() for p in params) * torch.empty(0, dtype=dtype).element_size()
    return max(1, min(batch, CHUNK_BYTES // max(per_sample, 1)))


Results = Tuple[Dict[torch.Tensor, torch.Tensor], Dict[torch.Tensor, torch.Tensor],
                Dict[torch.Tensor, torch.Tensor]]


def chunked_clipped_sums(params: List[torch.Tensor], chunk_grads: Optional[Callable],
                         whole: Dict[torch.Tensor, torch.Tensor], batch: int, scale: float,
                         factor_function: Callable, buffer: ChunkBuffer, dtype: torch.dtype,
                         device: torch.device) -> Results:
    """``(squared norms (B,), factors (B,), clipped sums)`` of each of ``params`` and of the
    parameters in ``whole``.

    ``chunk_grads(rows, out) -> {param: (n, *shape)}`` gives the unscaled per-sample gradients
    of the samples ``rows`` (``n`` of them) of ``params``, written into ``out[param]`` (the
    first ``n`` rows of each buffer view); ``whole[param]`` holds them for the whole batch.
    The per-sample gradient is ``scale`` times that. Norms and factors are computed as for
    materialised per-sample gradients (``‖s g_i‖² = s² ‖g_i‖²``,
    ``f_i = factor_function(param, ‖s g_i‖)``), so the step, which recomputes the factors
    from the norms, finds the same values.
    """
    sq_norms = {p: torch.empty(batch, dtype=sum_dtype(dtype), device=device) for p in params}
    factors = {p: torch.empty(batch, dtype=sum_dtype(dtype), device=device) for p in params}
    sums = {p: torch.zeros(p.numel(), dtype=sum_dtype(dtype), device=device) for p in params}
    with ieee_float32_products(device):
        if params:
            rows_per_chunk = chunk_size(params, batch, dtype)
            shapes = [(rows_per_chunk, *p.shape) for p in params]
            out = dict(zip(params, buffer.views(shapes, dtype, device)))
            for start in range(0, batch, rows_per_chunk):
                rows = slice(start, min(batch, start + rows_per_chunk))
                for p, g in chunk_grads(rows, out).items():
                    flat = g.view(g.shape[0], -1)
                    sq = _scaled_sq_norms(flat, scale, out=sq_norms[p][rows])
                    f = factors[p][rows]
                    f.copy_(finite_factors(factor_function(p, sq.clamp(min=0).sqrt())))
                    sums[p].addmv_(_kept(f, flat).t(), f, alpha=scale)
        for p, g in whole.items():
            flat = g.reshape(g.shape[0], -1)
            sq_norms[p] = _scaled_sq_norms(flat, scale)
            factors[p] = finite_factors(factor_function(p, sq_norms[p].clamp(min=0).sqrt()))
            sums[p] = torch.mv(_kept(factors[p], flat).t().to(sum_dtype(dtype)), factors[p] * scale)
    return sq_norms, factors, {p: s.view(p.shape) for p, s in sums.items()}


def _kept(factors: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """``flat`` with the rows of dropped samples (factor 0: a NaN/inf norm) zeroed, if any."""
    return without_dropped_rows(factors, flat)[1] if drops_rows(factors) else flat


def _scaled_sq_norms(flat: torch.Tensor, scale: float, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``s² ‖g_i‖²`` of the rows of ``flat`` (the materialised path's formula)."""
    sq = per_sample_norms(flat).square().mul_(scale ** 2)
    if out is None:
        return sq
    return out.copy_(sq)
