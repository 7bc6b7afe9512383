"""Ghost norms that rounding cannot shrink: a check of the Gram form, and a fallback.

The ghost identity (Li et al. 2022) ``n² = ‖Gᵀ A‖²_F = Σ_{t,s} (a_t · a_s)(g_t · g_s)`` sums
``T²`` terms of either sign, each at most ``r_t r_s q_t q_s`` (``r_t = ‖a_t‖``, ``q_t = ‖g_t‖``),
so its rounding error scales with ``N² = (Σ_t r_t q_t)²``, not with ``n²``. By the triangle
inequality on ``Σ_t g_t a_tᵀ``, ``n ≤ N``; ``n ≪ N`` when a sample's per-position gradients
cancel. A norm rounded below the truth gives a clip factor above ``C / n`` and lets the sample's
contribution exceed the clipping bound; with ``N / n`` in the thousands the float32 Gram form can
even return zero or a negative value and leave the sample unclipped. Measured in float32 (``T`` =
64…512, ``d, p`` = 64…1024; random, coherent and sign-alternating positions) the relative error
of the norm stayed below ``0.6 u (N/n)²`` (``u`` the unit roundoff), while a product summing the
positions — a materialised per-sample gradient, or the sample's part of the clipped-sum product —
errs by at most ``1e-8 N`` (about ``u N / 6``), linear in ``N``.

:func:`trusted_sq_norms` keeps a Gram norm ``n̂`` when ``u N² ≤ 2⁻¹⁶ n̂²`` (float32:
``N ≤ 16 n̂``, error below 1e-5 by that measurement; random positions at ``T = 128`` give
``N / n ≈ √T ≈ 11``, and no sample of the benchmark models fails it). The other samples get
their per-sample gradient materialised (in chunks, in the inputs' dtype; its norm ``n_m`` is a
sum of squares, free of cancellation), and the norm ``n_m + √T u N``: the margin is the
probabilistic bound of the rounding of a sum of ``T`` products (Higham & Mary 2019, "A New
Approach to Probabilistic Rounding Error Analysis"), which covers both ``n_m``'s own error and
what the clipped-sum product's rounding can add to the sample's contribution. Those samples are
therefore clipped a little more than exactly (by ``√T u N / n`` relative; 3e-5 for random
positions at ``T = 512``), never less. ``u`` is the inputs' unit roundoff: the callers run these
products in IEEE float32 (or float64) whatever reduced precision (TF32, bfloat16) the user allowed
for float32 products (:mod:`opacus_dp.maths.float32_products`).

Reading whether a sample is suspect is a host read: on a GPU it waits for the queued work. Where
the layer's inputs are kept until the step anyway (``bk`` with flat clipping), the check is
deferred (:func:`deferred_checks`): the norms are returned unchecked with the mask of their
suspect samples, and all masks of a step are read at once before any norm is used
(:mod:`~opacus_dp.grad_sample.bookkeeping.deferred_checks`).
"""

import math
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, List, Optional, Tuple

import torch

TRUSTED_ERROR = 2.0 ** -16  # largest u · N² / n̂² accepted (see module doc)
CHUNK_ELEMENTS = 2 ** 24  # materialised per-sample gradients held at once (64 MiB in float32)

Materialise = Callable[[torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]


def bound_sq(position_norms: torch.Tensor) -> torch.Tensor:
    """``N² = (Σ_t r_t q_t)²`` (float64 sums) per row of ``position_norms`` ``(U, T)``, which
    holds ``r_t q_t``."""
    return position_norms.double().sum(dim=1).square()


def bound_from_diagonal(diagonal: torch.Tensor) -> torch.Tensor:
    """:func:`bound_sq` from the diagonal ``r_t² q_t²`` of ``(A Aᵀ) ⊙ (G Gᵀ)`` ``(U, T)``."""
    return bound_sq(diagonal.clamp(min=0).sqrt())


def _trusted(sq_norms: torch.Tensor, bounds_sq: torch.Tensor) -> torch.Tensor:
    """``u N² ≤ 2⁻¹⁶ n̂²`` elementwise (False for NaN, negative or zero-but-bounded norms)."""
    roundoff = torch.finfo(sq_norms.dtype).eps / 2
    return roundoff * bounds_sq <= TRUSTED_ERROR * sq_norms


_DEFERRED = threading.local()  # .masks: the list the running resolution collects, or None


@contextmanager
def deferred_checks(defer: bool) -> Iterator[Optional[List[torch.Tensor]]]:
    """Within, with ``defer``, :func:`trusted_sq_norms` returns the Gram norms *unchecked* and
    appends the mask of their suspect samples to the yielded list; the caller must read the
    masks before the norms are used and recompute, checked, the norms of any call with a
    suspect sample. Without ``defer`` (yields None) the checks run at once."""
    previous = getattr(_DEFERRED, "masks", None)
    _DEFERRED.masks = [] if defer else None
    try:
        yield _DEFERRED.masks
    finally:
        _DEFERRED.masks = previous


def any_suspect(suspect: torch.Tensor) -> bool:
    """Whether a sample is suspect: the one host read of an immediate check."""
    return bool(suspect.any())


def trusted_sq_norms(sq_norms: torch.Tensor, bounds_sq: torch.Tensor, materialise: Materialise,
                     positions: int) -> torch.Tensor:
    """``sq_norms`` where the Gram form can be trusted, else materialised norms with a margin
    (module doc).

    ``sq_norms``, ``bounds_sq``: ``(B,)`` computed ``n̂²`` and ``N²``; ``materialise(index)``
    returns, for the samples ``index``, the squared norms (float64) of their materialised
    per-sample gradients and their ``N²``; ``positions``: ``T``, the number of terms each sample
    adds to an entry of its gradient. Under :func:`deferred_checks`: ``sq_norms`` unchecked.
    """
    suspect = ~_trusted(sq_norms, bounds_sq)
    deferred = getattr(_DEFERRED, "masks", None)
    if deferred is not None:
        deferred.append(suspect)
        return sq_norms
    if not any_suspect(suspect):
        return sq_norms
    index = suspect.nonzero().squeeze(1)
    exact_sq, exact_bound = materialise(index)
    margin = math.sqrt(positions) * torch.finfo(sq_norms.dtype).eps / 2
    result = sq_norms.clone()
    result[index] = (exact_sq.sqrt() + margin * exact_bound.sqrt()).square().to(sq_norms.dtype)
    return result


Pieces = Callable[[object], Tuple[torch.Tensor, torch.Tensor]]


def materialised_sq_norms(index: torch.Tensor, batch: int, elements_per_sample: int, pieces: Pieces,
                          units_per_sample: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """The fallback of :func:`trusted_sq_norms`: for the samples ``index`` (of ``batch``), the
    squared norms (as float64) of their materialised gradients ``G_uᵀ A_u`` and their ``N²``,
    each summed over a sample's ``units_per_sample`` units (a convolution's groups).

    ``pieces(chunk)`` gives ``A (U, T, d)`` and ``G (U, T, p)`` of the samples ``chunk`` (an index
    or ``slice(None)``); chunks hold at most ``CHUNK_ELEMENTS`` materialised elements (one sample
    at least), and a chunk that is the whole batch is a slice (no copy of its inputs). The norms
    are sums of squares, free of cancellation, so the inputs' precision suffices.
    """
    size = max(1, CHUNK_ELEMENTS // max(1, elements_per_sample))
    chunks = [slice(None)] if len(index) == batch and size >= batch else index.split(size)
    sq_norms, bounds = [], []
    for chunk in chunks:
        a, g = pieces(chunk)
        gradients = torch.bmm(g.transpose(1, 2), a)
        sq_norms.append(torch.linalg.vector_norm(gradients, dim=(1, 2)).double().square())
        bounds.append(bound_sq(a.norm(dim=2) * g.norm(dim=2)))
    per_sample = [torch.cat(parts).view(-1, units_per_sample).sum(dim=1) for parts in (sq_norms, bounds)]
    return per_sample[0], per_sample[1]
