"""Channels-last tensors read without transposing copies.

A ``(B, C, *positions)`` activation or output gradient laid out channels-last (``model.to(
memory_format=torch.channels_last)``, or the layout ``torch.compile`` gives convolutions on CPU)
holds each position's ``C`` channels together. Per-sample formulas that fold the batch into the
channels need the default layout, and ``reshape`` then transposes the whole tensor (a pass
several times slower than a plain copy); formulas that only need ``(positions × channels)``
matrices per sample read them from the channels-moved-last view instead.
"""

import torch


def channels_innermost(t: torch.Tensor) -> bool:
    """``t`` (``B × C × positions``) holds each position's channels together (stride 1 along the
    channels: channels-last, or a strided view of it such as a stride-2 convolution's phase) and
    is not contiguous in the default layout."""
    return t.dim() > 2 and t.shape[1] > 1 and t.stride(1) == 1 and not t.is_contiguous()


def positions_by_channels(x: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """``x`` ``(B, C, *positions)`` as ``(B·G, L, C/G)`` (``L`` positions, ``G`` channel groups):
    from the channels-moved-last view where :func:`channels_innermost` (a view of a channels-last
    tensor with one group, else a copy that keeps the channels inner), else the transpose of the
    default layout's ``(B·G, C/G, L)`` (a view of a contiguous ``x``)."""
    rows, channels = x.shape[0] * groups, x.shape[1] // groups
    if channels_innermost(x):
        return x.unflatten(1, (groups, channels)).movedim(2, -1).reshape(rows, -1, channels)
    return x.reshape(rows, channels, -1).transpose(1, 2)
