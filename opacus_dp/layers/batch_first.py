"""Building blocks of the DP layers whose calls always have the batch on dimension 0.

The class attribute ``_dp_batch_dim = 0`` tells ``GradSampleModule`` that activations and
backprops of these layers are batch-first whatever the wrapper's ``batch_first`` is: the
DP layers rearrange their inputs themselves, so the per-sample axis is never guessed.
"""

import torch
import torch.nn as nn

from opacus_dp.layers.arguments import check_positive_int


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
    """Appends a learned vector as one extra step at the end of every sequence.

    ``forward(x)`` with ``x`` of shape ``(S, B, E)`` (``(B, S, E)`` if ``batch_first``)
    returns ``S + 1`` steps, the last being ``bias`` for every sample; this is
    ``add_bias_kv`` of multi-head attention. ``bias`` has torch's shape ``(1, 1, E)``; its
    per-sample gradient is the backprop of the appended step. Like any plain layer, its
    batch dimension under ``GradSampleModule`` is the wrapper's ``batch_first``.
    """

    def __init__(self, embed_dim: int, batch_first: bool = False, device=None, dtype=None):
        super().__init__()
        check_positive_int(type(self).__name__, "embed_dim", embed_dim)
        self.embed_dim, self.batch_first = embed_dim, batch_first
        self.bias = nn.Parameter(torch.empty(1, 1, embed_dim, device=device, dtype=dtype))
        nn.init.xavier_normal_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            layout = "(batch, seq, E)" if self.batch_first else "(seq, batch, E)"
            raise ValueError(f"{type(self).__name__} expects input of shape {layout} with "
                             f"E={self.embed_dim}, got {tuple(x.shape)}")
        if self.batch_first:
            return torch.cat([x, self.bias.expand(x.shape[0], 1, self.embed_dim)], dim=1)
        return torch.cat([x, self.bias.expand(1, x.shape[1], self.embed_dim)], dim=0)

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, batch_first={self.batch_first}"


class BatchFirstSequenceBias(SequenceBias):
    """:class:`SequenceBias` whose calls always have the batch on dim 0 (used inside
    DPMultiheadAttention): ``(B, S, E) -> (B, S + 1, E)``."""

    _dp_batch_dim = 0

    def __init__(self, embed_dim: int, device=None, dtype=None):
        super().__init__(embed_dim, batch_first=True, device=device, dtype=dtype)
