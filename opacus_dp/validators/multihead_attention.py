"""Opacus 1.x's import path ``opacus.validators.multihead_attention`` (re-exports only): validate /
fix an ``nn.MultiheadAttention`` (fixed: DPMultiheadAttention; :mod:`opacus_dp.compat.layer_validators`)."""

from opacus_dp.compat.layer_validators import fix_multihead_attention as fix
from opacus_dp.compat.layer_validators import validate_multihead_attention as validate

__all__ = ["fix", "validate"]
