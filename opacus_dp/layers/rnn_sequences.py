"""Input/output layouts of the DP recurrent layers.

Internally every sequence is a padded, batch-major tensor ``(B, T, F)`` in the caller's
batch order, plus optional per-sample ``lengths``. This module converts from and back to
what torch's recurrent layers accept and return: ``(T, B, F)``, ``(B, T, F)``
(``batch_first``), unbatched ``(T, F)`` and ``PackedSequence`` (sorted or not).
A packed output reuses the input's ``batch_sizes``/``sorted_indices``/``unsorted_indices``,
exactly like torch.
"""

from dataclasses import dataclass
from typing import Optional

import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence


@dataclass
class SequenceLayout:
    """How the caller's input was laid out, to lay the output out the same way."""

    batch_first: bool
    unbatched: bool = False
    packed: Optional[PackedSequence] = None
    lengths: Optional[torch.Tensor] = None  # (B,) int64 on CPU, caller's batch order


def to_batch_major(input, batch_first: bool, input_size: int, owner: str):
    """``input`` -> (``x`` of shape (B, T, input_size), :class:`SequenceLayout`)."""
    if isinstance(input, PackedSequence):
        x, lengths = pad_packed_sequence(input, batch_first=True)
        layout = SequenceLayout(batch_first, packed=input, lengths=lengths)
    elif isinstance(input, torch.Tensor) and input.dim() in (2, 3):
        layout = SequenceLayout(batch_first, unbatched=input.dim() == 2)
        if layout.unbatched:
            x = input.unsqueeze(0)
        else:
            x = input if batch_first else input.transpose(0, 1)
    else:
        got = tuple(input.shape) if isinstance(input, torch.Tensor) else type(input).__name__
        raise ValueError(f"{owner}: input must be a 3-D tensor, an unbatched 2-D tensor or a "
                         f"PackedSequence, got {got}")
    if x.shape[1] == 0:
        raise ValueError(f"{owner}: the input sequence is empty; the sequence length must be > 0")
    if x.shape[-1] != input_size:
        raise ValueError(f"{owner}: input has {x.shape[-1]} features, expected "
                         f"input_size={input_size}")
    return x, layout


def valid_steps(layout: SequenceLayout, steps: int, device) -> Optional[torch.Tensor]:
    """(B, T) bool, True where step t < length of sample b; None when all steps are valid."""
    if layout.lengths is None:
        return None
    return torch.arange(steps).unsqueeze(0).lt(layout.lengths.unsqueeze(1)).to(device)


def from_batch_major(output: torch.Tensor, layout: SequenceLayout):
    """(B, T, H) output -> the caller's layout (same packing/order as the input)."""
    if layout.packed is not None:
        sorted_indices = layout.packed.sorted_indices
        lengths = layout.lengths
        if sorted_indices is not None:
            output = output.index_select(0, sorted_indices)
            lengths = lengths.index_select(0, sorted_indices.cpu())
        data = pack_padded_sequence(output, lengths, batch_first=True, enforce_sorted=True).data
        return PackedSequence(data, layout.packed.batch_sizes, sorted_indices,
                              layout.packed.unsorted_indices)
    if layout.unbatched:
        return output.squeeze(0)
    return output if layout.batch_first else output.transpose(0, 1)
