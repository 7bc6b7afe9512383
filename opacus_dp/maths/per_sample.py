"""Per-sample norms and weighted sums of per-sample gradients, in the dtype they are formed in.

Half-precision gradients are normed and summed in float32 (:func:`sum_dtype`); the products that
decide a sample's clipped contribution run in IEEE float32 (:mod:`.float32_products`). A sample
whose factor is 0 or non-finite (a dropped sample) adds nothing: its rows are zeroed before any
product (:func:`without_dropped_rows`).
"""

import math
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, List, Optional, Sequence

import torch

from opacus_dp.errors import NonFiniteNormError
from opacus_dp.maths.float32_products import ieee_float32_products


def sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for the half-precision floats, else ``dtype``: clip factors, clipped sums and noise
    of half-precision parameters are formed in float32 (see :mod:`opacus_dp.optim.dp_optimizer`)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def per_sample_norms(grads: torch.Tensor) -> torch.Tensor:
    """``‖g_i‖₂`` of per-sample gradients ``(B, ...)``, in :func:`sum_dtype` of theirs."""
    flat = grads.reshape(grads.shape[0], math.prod(grads.shape[1:]))  # also for an empty batch
    return torch.linalg.vector_norm(flat, dim=1, dtype=sum_dtype(grads.dtype))


def check_finite_norms(norms: torch.Tensor, name: str) -> torch.Tensor:
    """``norms`` if all are finite, else a ``ValueError`` naming the parameter ``name``."""
    if not bool(torch.isfinite(norms).all()):
        raise NonFiniteNormError(
            f"non-finite (NaN or inf) per-sample gradient norm in parameter {name}: a NaN input or "
            f"loss, or an overflow — of float16 in the model's backward under a loss scale (use a "
            f"lower torch.amp.GradScaler init_scale) or of the squared norm in {norms.dtype} — check "
            "the loss and inputs of this batch, or scale the loss down (no update was made)"
        )
    return norms


def check_finite_norm_list(norms: Sequence[torch.Tensor], name_of: Callable[[int], str]) -> List[torch.Tensor]:
    """``norms`` if all are finite, else :func:`check_finite_norms`'s error naming the first
    tensor with a non-finite norm (``name_of(index)``). One check over all of them when they
    share a device (a step checks every tensor's norms; one check each cost more than the rest
    of a small layer's bookkeeping)."""
    norms = list(norms)
    same_device = len({n.device for n in norms}) <= 1
    if same_device and (not norms or bool(torch.isfinite(torch.cat([n.reshape(-1) for n in norms])).all())):
        return norms
    for index, n in enumerate(norms):
        check_finite_norms(n, name_of(index))
    return norms


def weighted_sum(factors: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """``Σ_i f_i g_i`` of per-sample gradients ``(B, ...)``, in :func:`sum_dtype` of theirs, with
    IEEE float32 products (:mod:`~opacus_dp.maths.float32_products`); rows of dropped samples
    (``f_i`` 0 or non-finite) are zeroed first (:func:`drops_rows`)."""
    dtype = sum_dtype(grads.dtype)
    factors = factors.to(device=grads.device, dtype=dtype)
    if drops_rows(factors):
        factors, grads = without_dropped_rows(factors, grads)
    grads = grads.to(dtype)
    with ieee_float32_products(grads.device):  # the product einsum("i,i...->...") forms, without its parsing
        rows = grads.reshape(1, grads.shape[0], math.prod(grads.shape[1:]))  # also for an empty batch
        return torch.bmm(factors.view(1, 1, grads.shape[0]), rows).view(grads.shape[1:])


# ------------------------------------------------------------------ dropped (non-finite) samples
# A sample whose norm is NaN or inf gets clip factor 0 (:mod:`opacus_dp.optim.nonfinite`). Its
# gradient rows may hold NaN or inf, and 0 · NaN = NaN: its rows are zeroed, never multiplied.
_KNOWN_DROPS: ContextVar[Optional[bool]] = ContextVar("opacus_dp_known_drops", default=None)


@contextmanager
def known_drops(dropping: bool):
    """Within: the weighted sums take ``dropping`` (whether some factor is 0 or non-finite) as
    known, so they zero rows only then. Outside (sums formed during the backward pass) they find
    out themselves: on CPU by a check, elsewhere they always zero (no device sync)."""
    token = _KNOWN_DROPS.set(bool(dropping))
    try:
        yield
    finally:
        _KNOWN_DROPS.reset(token)


_LOSS_SCALED: ContextVar[bool] = ContextVar("opacus_dp_loss_scaled", default=False)


@contextmanager
def loss_scaled(scaled: bool):
    """Within (``scaled``): the per-sample gradients a source reads are multiplied by a loss scale
    that the step divides out (``torch.amp.GradScaler``); a source holding clipped sums formed
    during the backward pass, from factors of scaled norms, must refuse (:func:`is_loss_scaled`)."""
    token = _LOSS_SCALED.set(bool(scaled))
    try:
        yield
    finally:
        _LOSS_SCALED.reset(token)


def is_loss_scaled() -> bool:
    """Whether the step now reading a source divides a loss scale out (:func:`loss_scaled`)."""
    return _LOSS_SCALED.get()


def kept_rows(factors: torch.Tensor) -> torch.Tensor:
    """``f_i ≠ 0 and finite``: the samples whose rows reach a weighted sum."""
    return torch.isfinite(factors) & (factors != 0)


def _flat_by_device(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    by_device = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t.reshape(-1))
    return [torch.cat(ts) for ts in by_device.values()]


# Tensors of at most this many elements are joined (per device) and checked together: a step's
# per-sample norms are a few values per parameter, where one check each would cost more than the read.
JOINED_CHECK_ELEMENTS = 4096


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every value is finite: the largest magnitude ``max |t|`` (NaN where a NaN is, inf
    where an inf) of each tensor, and of the small ones joined per device (``JOINED_CHECK_ELEMENTS``,
    their dtypes promoted, which keeps every value's finiteness), is finite; one read of each
    tensor, no copy of a large one, one check (one device sync) per device."""
    large = [t for t in tensors if t.numel() > JOINED_CHECK_ELEMENTS]
    small = [t for t in tensors if 0 < t.numel() <= JOINED_CHECK_ELEMENTS]
    finite_peaks: dict = {}
    for t in large + _flat_by_device(small):
        finite_peaks.setdefault(t.device, []).append(torch.isfinite(largest_magnitude(t)))
    return all(bool(torch.stack(peaks).all()) for peaks in finite_peaks.values())


def largest_magnitude(t: torch.Tensor) -> torch.Tensor:
    """``max |t| = max(max t, −min t)`` of a non-empty tensor as a 0-d tensor, NaN if ``t`` holds
    one: one pass of ``aminmax`` (NaN-propagating), no temporary of ``t``'s size (on CPU several
    times faster than ``vector_norm(t, inf)`` or ``isfinite(t).all()``)."""
    low, high = torch.aminmax(t)
    return torch.maximum(high, -low)


def any_dropped(factors: Sequence[torch.Tensor]) -> bool:
    """Whether some factor is 0 or non-finite: one check per device."""
    return not all(bool(kept_rows(f).all()) for f in _flat_by_device(factors))


def drops_rows(factors: torch.Tensor) -> bool:
    """Whether a weighted sum with ``factors`` must zero rows (:func:`known_drops`)."""
    known = _KNOWN_DROPS.get()
    if known is not None:
        return known
    return factors.device.type != "cpu" or not bool(kept_rows(factors).all())


def finite_factors(factors: torch.Tensor) -> torch.Tensor:
    """``factors`` with NaN (from a NaN norm) and ±inf set to 0: the sample is dropped."""
    return torch.where(torch.isfinite(factors), factors, 0.0)


def finite_values(t):
    """A floating tensor with NaN and ±inf set to 0 (anything else as it is). For the inputs of a
    weighted sum: a kept sample's are finite (a non-finite one makes its norm non-finite), so only
    dropped samples' values change."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        return t
    return torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0)


def without_dropped_rows(factors: torch.Tensor, grads: torch.Tensor):
    """``(f', g')``: samples ``i`` outside :func:`kept_rows` get ``f'_i = 0`` and ``g'_i = 0``
    (rows of the batch-first ``grads``); the others are unchanged."""
    keep = kept_rows(factors)
    rows = keep.to(grads.device).view(-1, *[1] * (grads.dim() - 1))
    return torch.where(keep, factors, 0.0), torch.where(rows, grads, 0.0)
