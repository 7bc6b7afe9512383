"""Joining tensors that are consecutive slices of one tensor without copying them."""

from typing import Sequence

import torch


def joined(parts: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """``torch.cat(parts, dim)``, as a view when the parts lie one after another along ``dim`` in
    one storage (same dtype, device, strides and other sizes, each starting where the previous
    one ends: slices ``x[:, t:t+1]`` of one ``x``, in order); else the copy ``torch.cat`` makes.
    The result then shares memory with the parts: writing one writes the other."""
    if len(parts) > 1 and _consecutive(parts, dim):
        first = parts[0]
        size = list(first.shape)
        size[dim] = sum(p.shape[dim] for p in parts)
        return first.as_strided(size, first.stride(), first.storage_offset())
    return torch.cat(list(parts), dim=dim)


def _consecutive(parts: Sequence[torch.Tensor], dim: int) -> bool:
    first = parts[0]
    if first.dim() == 0 or first.is_sparse or type(first) is not torch.Tensor:
        return False
    dim = dim % first.dim()
    storage, step = first.untyped_storage().data_ptr(), first.stride(dim)
    offset = first.storage_offset()
    for part in parts:
        if (type(part) is not torch.Tensor or part.dtype != first.dtype or part.device != first.device
                or part.stride() != first.stride() or part.dim() != first.dim()
                or any(part.shape[k] != first.shape[k] for k in range(first.dim()) if k != dim)
                or part.untyped_storage().data_ptr() != storage or part.storage_offset() != offset):
            return False
        offset += part.shape[dim] * step
    return True
