"""The masks of ``nn.MultiheadAttention`` turned into one additive float mask.

torch's conventions (see ``nn.MultiheadAttention.forward``): a boolean mask is True where
attention is *not* allowed (becomes ``-inf``), a float mask is added to the scores.
``attn_mask`` is ``(L, S)`` or ``(N * num_heads, L, S)`` (``(num_heads, L, S)`` unbatched);
``key_padding_mask`` is ``(N, S)`` (``(S,)`` unbatched). Both are summed into one mask of
shape ``(N or 1, num_heads or 1, L, S + extra)``, where ``extra`` always-visible key
positions (``add_bias_kv``, ``add_zero_attn``) get a zero column, like torch.
"""

from typing import Optional

import torch
import torch.nn.functional as F


def _as_additive(mask: torch.Tensor, name: str, dtype: torch.dtype) -> torch.Tensor:
    if mask.dtype == torch.bool:
        additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        return additive.masked_fill_(mask, float("-inf"))
    if not torch.is_floating_point(mask):
        raise TypeError(f"DPMultiheadAttention: {name} must be a bool or floating point tensor, "
                        f"got dtype {mask.dtype}")
    return mask.to(dtype)


def _attn_mask_4d(attn_mask: torch.Tensor, batch: int, heads: int, tgt_len: int, src_len: int,
                  unbatched: bool) -> torch.Tensor:
    if attn_mask.dim() == 2 and tuple(attn_mask.shape) == (tgt_len, src_len):
        return attn_mask.view(1, 1, tgt_len, src_len)
    if attn_mask.dim() == 3 and tuple(attn_mask.shape) == (batch * heads, tgt_len, src_len):
        return attn_mask.view(batch, heads, tgt_len, src_len)
    leading = "num_heads" if unbatched else "batch * num_heads"
    raise ValueError(f"DPMultiheadAttention: attn_mask must have shape {(tgt_len, src_len)} or "
                     f"({leading}, {tgt_len}, {src_len}) = {(batch * heads, tgt_len, src_len)}, "
                     f"got {tuple(attn_mask.shape)}")


def additive_attention_mask(attn_mask: Optional[torch.Tensor],
                            key_padding_mask: Optional[torch.Tensor], *, batch: int, heads: int,
                            tgt_len: int, src_len: int, extra: int, unbatched: bool,
                            dtype: torch.dtype) -> Optional[torch.Tensor]:
    """Sum of both masks as an additive float mask broadcastable to (N, H, L, S + extra)."""
    total = None
    if attn_mask is not None:
        mask = _as_additive(attn_mask, "attn_mask", dtype)
        total = _attn_mask_4d(mask, batch, heads, tgt_len, src_len, unbatched)
    if key_padding_mask is not None:
        padding = key_padding_mask.unsqueeze(0) if unbatched else key_padding_mask
        if tuple(padding.shape) != (batch, src_len):
            expected = (src_len,) if unbatched else (batch, src_len)
            raise ValueError(f"DPMultiheadAttention: key_padding_mask must have shape {expected}, "
                             f"got {tuple(key_padding_mask.shape)}")
        padding = _as_additive(padding, "key_padding_mask", dtype).view(batch, 1, 1, src_len)
        total = padding if total is None else total + padding
    if total is not None and extra > 0:
        total = F.pad(total, (0, extra))
    return total
