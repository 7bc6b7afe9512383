"""Opacus 0.x/1.x ``opacus.utils.packed_sequences``: lengths of the sequences of a PackedSequence."""

from typing import List

import torch


def compute_seq_lengths(batch_sizes: torch.Tensor) -> List[int]:
    """The length of each sequence of a ``PackedSequence`` from its ``batch_sizes`` (the number of
    sequences still running at each time step), in the packed (decreasing length) order.

    >>> compute_seq_lengths(torch.tensor([3, 2, 2, 1]))
    [4, 3, 1]
    """
    sizes = [int(b) for b in batch_sizes]
    if any(b <= 0 for b in sizes) or sizes != sorted(sizes, reverse=True):
        raise ValueError(f"batch_sizes must be positive and non-increasing (a PackedSequence's), got {sizes}")
    num_sequences = sizes[0] if sizes else 0
    return [sum(1 for b in sizes if b > i) for i in range(num_sequences)]


__all__ = ["compute_seq_lengths"]
