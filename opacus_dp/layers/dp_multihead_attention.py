"""DPMultiheadAttention: drop-in for ``nn.MultiheadAttention`` built from separate linears.

Same constructor and ``forward`` contract as torch. With ``Q = X_q W_q^T + b_q`` (and
likewise ``K``, ``V``, split into ``num_heads`` heads of size ``d = embed_dim / num_heads``):

    ``A = softmax(Q K^T / sqrt(d) + M)``,  ``out = concat_heads(dropout(A) V) W_o^T + b_o``

where ``M`` is the additive mask built from ``attn_mask`` and ``key_padding_mask``
(:mod:`opacus_dp.layers.attention_masks`). ``add_bias_kv`` appends the learned vectors
``bias_k``/``bias_v`` as one more key/value step (a ``BatchFirstSequenceBias``),
``add_zero_attn`` appends a step of zeros after the heads are split. The returned
attention weights are ``A`` after dropout, averaged over heads if ``average_attn_weights``.

All projections are ``BatchFirstLinear`` (``qlinear``, ``klinear``, ``vlinear``,
``out_proj``) and are called with the batch on dim 0 whatever ``batch_first`` is, so the
per-sample gradients come from the Linear sampler and never depend on a guessed layout.

``is_causal`` is torch's hint that ``attn_mask`` is the causal mask: as in torch,
``attn_mask`` is then required, and it is the mask that is applied.

State dicts use torch's keys: ``in_proj_weight`` (or ``q/k/v_proj_weight`` when
``kdim``/``vdim`` differ from ``embed_dim``), ``in_proj_bias``, ``bias_k``, ``bias_v``,
``out_proj.weight``, ``out_proj.bias``; ``in_proj_*`` are concatenations of the q/k/v
tensors (with ``keep_vars=True`` they are therefore not leaf parameters).
"""

import math
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from opacus_dp.layers.arguments import check_positive_int, check_probability
from opacus_dp.layers.attention_masks import additive_attention_mask
from opacus_dp.layers.batch_first import BatchFirstLinear, BatchFirstSequenceBias, SequenceBias
from opacus_dp.layers.param_rename import report_external_names

# SequenceBias is re-exported for the Opacus 1.x import path of the same module.
__all__ = ["DPMultiheadAttention", "SequenceBias"]

_PROJECTIONS = ("qlinear", "klinear", "vlinear")
_PACKED_TORCH_PARAMETERS = ("in_proj_weight", "in_proj_bias", "q_proj_weight", "k_proj_weight",
                            "v_proj_weight")


def _torch_layout(module: "DPMultiheadAttention") -> List[Tuple[str, List[str]]]:
    """``[(torch_key, [internal keys concatenated along dim 0]), ...]`` in torch's order."""
    layout = []
    if module._qkv_same_embed_dim:
        layout.append(("in_proj_weight", [f"{p}.weight" for p in _PROJECTIONS]))
    else:
        layout += [(f"{p[0]}_proj_weight", [f"{p}.weight"]) for p in _PROJECTIONS]
    if module.qlinear.bias is not None:
        layout.append(("in_proj_bias", [f"{p}.bias" for p in _PROJECTIONS]))
    if module.add_bias_kv:
        layout += [("bias_k", ["seq_bias_k.bias"]), ("bias_v", ["seq_bias_v.bias"])]
    layout.append(("out_proj.weight", ["out_proj.weight"]))
    if module.out_proj.bias is not None:
        layout.append(("out_proj.bias", ["out_proj.bias"]))
    return layout


def _save_torch_keys(module, state_dict, prefix, local_metadata):
    """Post-hook of ``state_dict``: emit torch's keys (q/k/v concatenated) in torch's order."""
    for torch_key, internal_keys in _torch_layout(module):
        parts = [state_dict.pop(prefix + k) for k in internal_keys]
        state_dict[prefix + torch_key] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def _load_torch_keys(module, state_dict, prefix, local_metadata, strict, missing_keys,
                     unexpected_keys, error_msgs):
    """Pre-hook of ``load_state_dict``: split torch's keys into the internal ones."""
    module.__dict__["_alias_load_prefix"] = prefix
    for torch_key, internal_keys in _torch_layout(module):
        if prefix + torch_key not in state_dict or [torch_key] == internal_keys:
            continue
        value = state_dict.pop(prefix + torch_key)
        parts = value.chunk(len(internal_keys), dim=0) if len(internal_keys) > 1 else (value,)
        for key, part in zip(internal_keys, parts):
            state_dict[prefix + key] = part


def _report_torch_keys(module, incompatible_keys):
    """Post-hook of ``load_state_dict``: missing/unexpected keys under torch's names."""
    renames = [(k, torch_key) for torch_key, keys in _torch_layout(module) for k in keys]
    report_external_names(module, incompatible_keys, renames)


class DPMultiheadAttention(nn.Module):
    """Drop-in for ``nn.MultiheadAttention`` (same arguments, outputs and state dict)."""

    # torch's Transformer layers read this first to choose their fused inference path, which
    # would use packed in-projection tensors and bypass this module; None turns that path off
    # (``in_proj_weight`` still raises, naming the q/k/v projections).
    in_proj_bias = None

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: Optional[int] = None,
                 vdim: Optional[int] = None, batch_first: bool = False, device=None, dtype=None):
        super().__init__()
        _check_sizes(embed_dim, num_heads, kdim, vdim, dropout)
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.head_dim = embed_dim // num_heads
        self.dropout, self.batch_first = float(dropout), batch_first
        self.add_bias_kv, self.add_zero_attn = add_bias_kv, add_zero_attn
        factory = {"device": device, "dtype": dtype}
        self.qlinear = BatchFirstLinear(embed_dim, embed_dim, bias=bias, **factory)
        self.klinear = BatchFirstLinear(self.kdim, embed_dim, bias=bias, **factory)
        self.vlinear = BatchFirstLinear(self.vdim, embed_dim, bias=bias, **factory)
        if add_bias_kv:
            self.seq_bias_k = BatchFirstSequenceBias(embed_dim, **factory)
            self.seq_bias_v = BatchFirstSequenceBias(embed_dim, **factory)
        self.out_proj = BatchFirstLinear(embed_dim, embed_dim, bias=bias, **factory)
        self._reset_parameters()
        self.register_state_dict_post_hook(_save_torch_keys)
        self.register_load_state_dict_pre_hook(_load_torch_keys)
        self.register_load_state_dict_post_hook(_report_torch_keys)

    def _reset_parameters(self) -> None:
        """torch's initialisation: Xavier-uniform q/k/v (as one (3E, E) matrix when the dims
        agree), zero biases, Xavier-normal ``bias_k``/``bias_v``."""
        linears = [getattr(self, p) for p in _PROJECTIONS]
        if self._qkv_same_embed_dim:
            bound = math.sqrt(6.0 / (self.embed_dim + 3 * self.embed_dim))
            for linear in linears:
                nn.init.uniform_(linear.weight, -bound, bound)
        else:
            for linear in linears:
                nn.init.xavier_uniform_(linear.weight)
        for linear in linears + [self.out_proj]:
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in _PACKED_TORCH_PARAMETERS:
                raise AttributeError(
                    f"DPMultiheadAttention has no {name!r}: the q/k/v projections are the separate "
                    "layers qlinear, klinear and vlinear (state_dict() still emits torch's keys)"
                ) from None
            raise

    @property
    def bias_k(self) -> Optional[nn.Parameter]:
        return self.seq_bias_k.bias if self.add_bias_kv else None

    @property
    def bias_v(self) -> Optional[nn.Parameter]:
        return self.seq_bias_v.bias if self.add_bias_kv else None

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(N, S, E) -> (N, H, S, d)."""
        return x.view(x.shape[0], x.shape[1], self.num_heads, self.head_dim).transpose(1, 2)

    def _project(self, query, key, value):
        """Batch-first inputs -> per-head Q, K, V with the extra key/value steps appended."""
        q, k, v = self.qlinear(query), self.klinear(key), self.vlinear(value)
        if self.add_bias_kv:
            k, v = self.seq_bias_k(k), self.seq_bias_v(v)
        q, k, v = self._split_heads(q), self._split_heads(k), self._split_heads(v)
        if self.add_zero_attn:
            zeros = k.new_zeros(k.shape[0], self.num_heads, 1, self.head_dim)
            k, v = torch.cat([k, zeros], dim=2), torch.cat([v, zeros], dim=2)
        return q, k, v

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: Optional[torch.Tensor] = None, need_weights: bool = True,
                attn_mask: Optional[torch.Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """torch's contract: returns ``(attn_output, attn_weights or None)``."""
        unbatched = self._check_inputs(query, key, value)
        if is_causal and attn_mask is None:
            raise ValueError("DPMultiheadAttention: is_causal=True is a hint that attn_mask is the "
                             "causal mask; pass attn_mask (e.g. "
                             "nn.Transformer.generate_square_subsequent_mask(L))")
        query, key, value = (self._batch_major(x, unbatched) for x in (query, key, value))
        batch, tgt_len, src_len = query.shape[0], query.shape[1], key.shape[1]
        mask = additive_attention_mask(
            attn_mask, key_padding_mask, batch=batch, heads=self.num_heads, tgt_len=tgt_len,
            src_len=src_len, extra=int(self.add_bias_kv) + int(self.add_zero_attn),
            unbatched=unbatched, dtype=query.dtype)
        q, k, v = self._project(query, key, value)
        scores = torch.matmul(q * math.sqrt(1.0 / self.head_dim), k.transpose(-2, -1))
        if mask is not None:
            scores = scores + mask
        weights = F.dropout(torch.softmax(scores, dim=-1), self.dropout, self.training)
        heads = torch.matmul(weights, v).transpose(1, 2).reshape(batch, tgt_len, self.embed_dim)
        output = self._caller_layout(self.out_proj(heads), unbatched)
        if not need_weights:
            return output, None
        weights = weights.mean(dim=1) if average_attn_weights else weights
        return output, weights.squeeze(0) if unbatched else weights

    def _batch_major(self, x: torch.Tensor, unbatched: bool) -> torch.Tensor:
        if unbatched:
            return x.unsqueeze(0)
        return x if self.batch_first else x.transpose(0, 1)

    def _caller_layout(self, x: torch.Tensor, unbatched: bool) -> torch.Tensor:
        if unbatched:
            return x.squeeze(0)
        return x if self.batch_first else x.transpose(0, 1)

    def _check_inputs(self, query, key, value) -> bool:
        """Validates shapes; returns True for unbatched (2-D) inputs."""
        if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError("DPMultiheadAttention: query, key and value must all be 3-D "
                             f"(batched) or all 2-D (unbatched), got {query.dim()}-D, "
                             f"{key.dim()}-D, {value.dim()}-D")
        for name, x, size in (("query", query, self.embed_dim), ("key", key, self.kdim),
                              ("value", value, self.vdim)):
            if x.shape[-1] != size:
                raise ValueError(f"DPMultiheadAttention: {name} has {x.shape[-1]} features, "
                                 f"expected {size}")
        if key.shape[:-1] != value.shape[:-1]:
            raise ValueError(f"DPMultiheadAttention: key {tuple(key.shape)} and value "
                             f"{tuple(value.shape)} must have the same sequence and batch sizes")
        batch_dim = 0 if self.batch_first else 1
        if query.dim() == 3 and query.shape[batch_dim] != key.shape[batch_dim]:
            raise ValueError(f"DPMultiheadAttention: query and key batch sizes differ "
                             f"({query.shape[batch_dim]} vs {key.shape[batch_dim]}); "
                             f"batch_first={self.batch_first}")
        return query.dim() == 2

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}, "
                f"kdim={self.kdim}, vdim={self.vdim}, batch_first={self.batch_first}")


def _check_sizes(embed_dim, num_heads, kdim, vdim, dropout) -> None:
    owner = "DPMultiheadAttention"
    for name, value in (("embed_dim", embed_dim), ("num_heads", num_heads), ("kdim", kdim),
                        ("vdim", vdim)):
        if value is not None:
            check_positive_int(owner, name, value)
    if embed_dim % num_heads != 0:
        raise ValueError(f"{owner}: embed_dim ({embed_dim}) must be divisible by "
                         f"num_heads ({num_heads})")
    check_probability(owner, "dropout", dropout)
