"""Building blocks of the DP layers whose calls always have the batch on dimension 0.

The class attribute ``_dp_batch_dim = 0`` tells ``GradSampleModule`` that activations and
backprops of these layers are batch-first whatever the wrapper's ``batch_first`` is: the
DP layers rearrange their inputs themselves, so the per-sample axis is never guessed.
"""

import torch
import torch.nn as nn


class BatchFirstLinear(nn.Linear):
    """``nn.Linear`` that is always called with the batch on dim 0: ``y = x W^T + b``.

    Used for every projection inside DPRNN/DPGRU/DPLSTM cells and DPMultiheadAttention.
    Its per-sample gradient is the Linear one, summed over the middle dimensions
    and over repeated calls (one call per time step).
    """

    _dp_batch_dim = 0


RNNLinear = BatchFirstLinear
"""Name under which Opacus exposes the recurrent cells' linear layer (same class)."""


class SequenceBias(nn.Module):
    """Appends a learned vector as one extra step at the end of a batch-first sequence.

    ``forward(x)`` with ``x`` of shape ``(B, S, E)`` returns ``(B, S + 1, E)`` whose last
    step is ``bias`` for every sample; this is ``add_bias_kv`` of multi-head attention.
    ``bias`` has torch's shape ``(1, 1, E)``; its per-sample gradient is the backprop of the
    appended step.
    """

    _dp_batch_dim = 0

    def __init__(self, embed_dim: int, device=None, dtype=None):
        super().__init__()
        if not isinstance(embed_dim, int) or embed_dim <= 0:
            raise ValueError(f"SequenceBias: embed_dim must be a positive int, got {embed_dim!r}")
        self.embed_dim = embed_dim
        self.bias = nn.Parameter(torch.empty(1, 1, embed_dim, device=device, dtype=dtype))
        nn.init.xavier_normal_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(
                f"SequenceBias expects input of shape (batch, seq, {self.embed_dim}), "
                f"got {tuple(x.shape)}"
            )
        return torch.cat([x, self.bias.expand(x.shape[0], 1, self.embed_dim)], dim=1)

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}"
