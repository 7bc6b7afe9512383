"""Per-sample norms and weighted sums of per-sample gradients, in the dtype they are formed in.

Half-precision gradients are normed and summed in float32 (:func:`sum_dtype`); the products that
decide a sample's clipped contribution run in IEEE float32 (:mod:`.float32_products`).
"""

import math
from typing import Callable, List, Sequence

import torch

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
        raise ValueError(
            f"non-finite (NaN or inf) per-sample gradient norm in parameter {name}: a NaN or inf "
            f"gradient, or one so large that its squared norm overflows {norms.dtype} — check the "
            "loss and inputs of this batch, or scale the loss down (no update was made)"
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
    IEEE float32 products (:mod:`~opacus_dp.maths.float32_products`)."""
    dtype = sum_dtype(grads.dtype)
    with ieee_float32_products():
        return torch.einsum("i,i...->...", factors.to(device=grads.device, dtype=dtype), grads.to(dtype))
