"""Tensor helpers under Opacus 1.x's path ``opacus.utils.tensor_utils`` (compatibility), for
custom grad samplers written against Opacus."""

import types
from typing import Iterable, List, Tuple, Union

import torch

from opacus_dp.grad_sample.conv import conv_windows
from opacus_dp.optim.clipping import per_sample_norms

IntOrTuple = Union[int, Tuple[int, ...]]


def calc_sample_norms(named_params: Iterable[Tuple[str, torch.Tensor]], *, flat: bool = True) -> List[torch.Tensor]:
    """``‖g_i‖₂`` of each per-sample tensor ``(B, ...)``; with ``flat`` one list entry, the norm
    over all of them (in float32 for half-precision tensors, where Opacus keeps their dtype)."""
    norms = [per_sample_norms(g) for _, g in named_params]
    return [torch.stack(norms, dim=0).norm(2, dim=0)] if flat else norms


def calc_sample_norms_one_layer(param: torch.Tensor) -> torch.Tensor:
    """``‖g_i‖₂`` of one per-sample tensor ``(B, ...)``."""
    return per_sample_norms(param)


def sum_over_all_but_batch_and_last_n(tensor: torch.Tensor, n_dims: int) -> torch.Tensor:
    """``tensor`` summed over every dimension but the first and the last ``n_dims``."""
    dims = list(range(1, tensor.dim() - n_dims))
    return tensor.sum(dim=dims) if dims else tensor


def _unfold(tensor: torch.Tensor, spatial: int, kernel_size, padding, stride, dilation) -> torch.Tensor:
    def each(value) -> Tuple[int, ...]:
        return tuple(value) if isinstance(value, (tuple, list)) else (value,) * spatial

    window = types.SimpleNamespace(
        kernel_size=each(kernel_size), stride=each(stride), dilation=each(dilation), groups=1,
        padding=padding if isinstance(padding, str) else each(padding), padding_mode="zeros")
    windows = conv_windows(window, tensor)  # (B, 1, C * K, L)
    return windows.reshape(tensor.shape[0], -1, windows.shape[-1])


def unfold2d(input: torch.Tensor, *, kernel_size: IntOrTuple, padding: Union[str, IntOrTuple],
             stride: IntOrTuple, dilation: IntOrTuple) -> torch.Tensor:
    """``torch.nn.functional.unfold`` of ``(B, C, H, W)`` with ``"same"``/``"valid"`` padding
    too: ``(B, C·kh·kw, L)``."""
    return _unfold(input, 2, kernel_size, padding, stride, dilation)


def unfold3d(tensor: torch.Tensor, *, kernel_size: IntOrTuple, padding: Union[str, IntOrTuple] = 0,
             stride: IntOrTuple = 1, dilation: IntOrTuple = 1) -> torch.Tensor:
    """The same for ``(B, C, D, H, W)``: ``(B, C·kd·kh·kw, L)``."""
    if tensor.dim() != 5:
        raise ValueError(f"unfold3d takes a (B, C, D, H, W) tensor, got shape {tuple(tensor.shape)}")
    return _unfold(tensor, 3, kernel_size, padding, stride, dilation)


def filter_dilated_rows(tensor: torch.Tensor, dilation: Tuple[int, ...], dilated_kernel_size: Tuple[int, ...],
                        kernel_size: Tuple[int, ...]) -> torch.Tensor:
    """Keep, in each of the last ``len(kernel_size)`` dimensions (a dilated kernel window of size
    ``dilated_kernel_size``), only the positions ``0, d, 2d, ...`` the dilated kernel reads:
    ``(..., *dilated_kernel_size)`` -> ``(..., *kernel_size)``."""
    rank = len(kernel_size)
    offset = tensor.dim() - rank
    for i in range(rank):
        keep = torch.arange(0, dilated_kernel_size[i], dilation[i], device=tensor.device)
        tensor = tensor.index_select(offset + i, keep)
    return tensor
