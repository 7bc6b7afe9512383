"""Layers that torch implements with fused kernels, rebuilt so that DP-SGD can compute
per-sample gradients: recurrent layers/cells and multi-head attention.

All of them accept the state dicts of their torch counterparts and produce state dicts
that torch loads. Their per-sample gradient functions live in
:mod:`opacus_dp.grad_sample.dp_layers` (registered when :mod:`opacus_dp.grad_sample` is imported).
"""

from opacus_dp.layers.batch_first import (
    BatchFirstLinear,
    BatchFirstSequenceBias,
    RNNLinear,
    SequenceBias,
)
from opacus_dp.layers.dp_multihead_attention import DPMultiheadAttention
from opacus_dp.layers.dp_rnn import DPGRU, DPLSTM, DPRNN, DPRNNBase
from opacus_dp.layers.param_rename import StateDictAliasMixin
from opacus_dp.layers.rnn_cells import DPGRUCell, DPLSTMCell, DPRNNCell, DPRNNCellBase

__all__ = [
    "DPMultiheadAttention",
    "DPRNN",
    "DPGRU",
    "DPLSTM",
    "DPRNNBase",
    "DPRNNCell",
    "DPGRUCell",
    "DPLSTMCell",
    "DPRNNCellBase",
    "BatchFirstLinear",
    "BatchFirstSequenceBias",
    "RNNLinear",
    "SequenceBias",
    "StateDictAliasMixin",
]

from opacus_dp.layers.dpddp import (  # noqa: E402,F401  (Opacus 0.x import path)
    DifferentiallyPrivateDistributedDataParallel,
)

from opacus_dp.submodules import submodule_getattr  # noqa: E402

__getattr__ = submodule_getattr(__name__)  # sub-modules as attributes, as in Opacus
