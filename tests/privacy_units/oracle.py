"""Independent σ = 0 reference for privacy units of several rows: each unit's gradient is the mean
(or sum) of its rows' gradients from a batch-size-1 autograd loop, clipped by hand as one
(flat: over all tensors; per layer: each tensor to its own bound), summed, divided by the
expected number of units."""

from typing import List, Sequence

import torch

from tests.distributed.oracle import clipped_sum, per_sample_grads


def unit_grads(row_grads, sizes: Sequence[int], unit_gradient: str = "mean"):
    """``[[G_u for each param] for each unit u]`` of consecutive units of ``sizes`` rows."""
    units, start = [], 0
    for size in sizes:
        rows = row_grads[start:start + size]
        weight = 1.0 / size if unit_gradient == "mean" else 1.0
        units.append([weight * sum(r[j] for r in rows) for j in range(len(rows[0]))])
        start += size
    assert start == len(row_grads)
    return units


def unit_update(model, loss_fn, x, y, sizes, max_grad_norm, divisor: float,
                unit_gradient: str = "mean") -> List[torch.Tensor]:
    """``Σ_u f_u G_u / divisor`` for the batch ``(x, y)`` whose rows form units of ``sizes``."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not sizes:
        return [torch.zeros_like(p) for p in params]
    units = unit_grads(per_sample_grads(model, loss_fn, x, y), sizes, unit_gradient)
    return [s / divisor for s in clipped_sum(units, max_grad_norm, params)]
