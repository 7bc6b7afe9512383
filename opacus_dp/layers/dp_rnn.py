"""DPRNN, DPGRU and DPLSTM: drop-ins for ``nn.RNN``, ``nn.GRU`` and ``nn.LSTM``.

Same constructor arguments, forward contract (tensor, ``batch_first``, unbatched 2-D input,
``PackedSequence`` sorted or not, optional ``hx``) and state-dict keys (``weight_ih_l0``,
``bias_hh_l1_reverse``, ``weight_hr_l0``, ...) as torch, so state dicts load both ways.

Each layer/direction is a cell (:mod:`opacus_dp.layers.rnn_cells`) whose projections are
``RNNLinear`` modules always called with the full batch on dim 0: ``ih`` once on the
whole ``(B, T, F)`` sequence, ``hh`` once per time step on ``(B, H)``. Per-sample
gradients thus come from the Linear sampler, summed over the calls.

Variable lengths (PackedSequence) are handled by padding and running every time step on
the full batch with the update masked: ``state_b <- state_b' if t < len_b else state_b``.
A finished sequence keeps its state (so ``h_n`` is the state at its last valid step, and
the reverse direction starts at ``len_b - 1`` from ``h_0``), and the masked update gives
its discarded step exactly zero gradient, so its per-sample gradient is unchanged.
Dropout (training only) is applied to each layer's output except the last, like torch.
"""

import warnings
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from opacus_dp.layers.arguments import check_positive_int, check_probability
from opacus_dp.layers.batch_first import RNNLinear
from opacus_dp.layers.joined_steps import joined_steps
from opacus_dp.layers.param_rename import StateDictAliasMixin
from opacus_dp.layers.rnn_cells import (
    CELL_TYPES,
    DPGRUCell,
    DPLSTMCell,
    DPRNNCell,
    DPRNNCellBase,
    State,
)
from opacus_dp.layers.rnn_sequences import from_batch_major, to_batch_major, valid_steps

# The cells and RNNLinear are re-exported here because Opacus 1.x users import them from
# ``opacus.layers.dp_rnn``.
__all__ = ["DPRNNBase", "DPRNN", "DPGRU", "DPLSTM", "DPRNNCellBase", "DPRNNCell", "DPGRUCell",
           "DPLSTMCell", "RNNLinear"]


def _run_direction(cell: DPRNNCellBase, x: torch.Tensor, state: State,
                   valid: Optional[torch.Tensor], reverse: bool) -> Tuple[torch.Tensor, State]:
    """Runs ``cell`` over ``x`` (B, T, F); returns outputs (B, T, H_out) and the final state.

    The input projection of all steps is cut into steps once (``unbind``): its backward stacks
    the steps' gradients, where indexing ``[:, t]`` at every step would make each step's backward
    write a zero gradient of the whole sequence (``T`` times the projection's size per step)."""
    gates = cell.ih(x)
    input_gates = gates.unbind(1)
    steps = x.shape[1]
    joined = joined_steps(cell, gates)  # a wrapper's: hh's steps recorded as one call
    outputs: List[Optional[torch.Tensor]] = [None] * steps
    for t in (reversed(range(steps)) if reverse else range(steps)):
        if joined is None:
            new_state = cell.recurrence(input_gates[t], state)
        else:
            joined.keep(t, state[0])
            new_state = cell.recurrence(input_gates[t], state, joined.project)
        if valid is not None:
            keep = valid[:, t : t + 1]
            new_state = tuple(torch.where(keep, new, old) for new, old in zip(new_state, state))
        state = new_state
        outputs[t] = state[0]
    if joined is not None:
        joined.finish(gates)
    return torch.stack(outputs, dim=1), state


class DPRNNBase(StateDictAliasMixin, nn.Module):
    """Common implementation; ``mode`` is 'RNN_TANH', 'RNN_RELU', 'GRU' or 'LSTM'.

    Cells are submodules ``l{k}`` and ``l{k}_reverse``; their parameters appear in
    ``named_parameters()`` as e.g. ``l0.ih.weight`` while ``state_dict()`` and attribute
    access (``layer.weight_ih_l0``) use torch's names.
    """

    def __init__(self, mode: str, input_size: int, hidden_size: int, num_layers: int = 1,
                 bias: bool = True, batch_first: bool = False, dropout: float = 0.0,
                 bidirectional: bool = False, proj_size: int = 0, device=None, dtype=None):
        super().__init__()
        name = type(self).__name__
        check_positive_int(name, "num_layers", num_layers)
        check_probability(name, "dropout", dropout)
        if dropout > 0 and num_layers == 1:
            warnings.warn(f"{name}: dropout={dropout} has no effect with num_layers=1 (dropout is "
                          "applied between layers)")
        self.mode, self.input_size, self.hidden_size = mode, input_size, hidden_size
        self.num_layers, self.bias, self.batch_first = num_layers, bias, batch_first
        self.dropout, self.bidirectional, self.proj_size = float(dropout), bidirectional, proj_size
        self.num_directions = 2 if bidirectional else 1
        self._cell_names: List[str] = []
        self._build_cells(device, dtype)
        self._install_state_dict_aliases(self._torch_aliases())

    def _make_cell(self, layer_input: int, device, dtype) -> DPRNNCellBase:
        if self.mode == "LSTM":
            options = {"proj_size": self.proj_size}
        elif self.mode == "GRU":
            options = {}
        else:
            options = {"nonlinearity": "tanh" if self.mode == "RNN_TANH" else "relu"}
        cell_type = CELL_TYPES[self.mode]
        return cell_type(layer_input, self.hidden_size, self.bias, device=device, dtype=dtype,
                         **options)

    def _build_cells(self, device, dtype) -> None:
        output_size = self.proj_size or self.hidden_size
        for layer in range(self.num_layers):
            layer_input = self.input_size if layer == 0 else output_size * self.num_directions
            for suffix in ("", "_reverse")[: self.num_directions]:
                cell_name = f"l{layer}{suffix}"
                self.add_module(cell_name, self._make_cell(layer_input, device, dtype))
                self._cell_names.append(cell_name)

    def _torch_aliases(self) -> List[Tuple[str, str]]:
        aliases = []
        for cell_name in self._cell_names:
            for _, external in getattr(self, cell_name).state_dict_aliases():
                aliases.append((f"{cell_name}.{external}", f"{external}_{cell_name}"))
        return aliases

    @property
    def all_weights(self) -> List[List[nn.Parameter]]:
        """Parameters per layer and direction, in torch's order (like ``nn.LSTM.all_weights``)."""
        return [[getattr(self, external) for internal, external in self._torch_aliases()
                 if internal.startswith(cell_name + ".")] for cell_name in self._cell_names]

    def flatten_parameters(self) -> None:
        """No-op, for compatibility with torch's cuDNN-backed layers."""

    def reset_parameters(self) -> None:
        for cell_name in self._cell_names:
            getattr(self, cell_name).reset_parameters()

    def _initial_states(self, hx, batch: int, like: torch.Tensor, unbatched: bool) -> List[State]:
        """Per-cell initial states from torch's ``hx`` ((L*D, B, H) or a (h, c) pair)."""
        cell0 = getattr(self, self._cell_names[0])
        count = len(self._cell_names)
        if hx is None:
            return [tuple(like.new_zeros(batch, s) for s in cell0.state_sizes())] * count
        is_pair = isinstance(hx, (tuple, list))
        if is_pair != (self.mode == "LSTM") or (is_pair and len(hx) != 2):
            want = "a tuple (h_0, c_0)" if self.mode == "LSTM" else "a single tensor h_0"
            raise ValueError(f"{type(self).__name__}: hx must be {want}")
        parts = tuple(hx) if is_pair else (hx,)
        states = []
        for k, (h, size) in enumerate(zip(parts, cell0.state_sizes())):
            expected = (count, size) if unbatched else (count, batch, size)
            if tuple(h.shape) != expected:
                raise ValueError(f"{type(self).__name__}: hx[{k}] must have shape {expected} "
                                 "(num_layers * num_directions, batch, size), "
                                 f"got {tuple(h.shape)}")
            states.append(h.unsqueeze(1) if unbatched else h)
        return [tuple(s[i] for s in states) for i in range(count)]

    def _final_states(self, finals: List[State], unbatched: bool):
        stacked = tuple(torch.stack(parts, dim=0) for parts in zip(*finals))
        if unbatched:
            stacked = tuple(s.squeeze(1) for s in stacked)
        return stacked if self.mode == "LSTM" else stacked[0]

    def forward(self, input, hx=None):
        """torch's contract: returns ``(output, h_n)`` (``(output, (h_n, c_n))`` for LSTM)."""
        x, layout = to_batch_major(input, self.batch_first, self.input_size, type(self).__name__)
        states = self._initial_states(hx, x.shape[0], x, layout.unbatched)
        valid = valid_steps(layout, x.shape[1], x.device)
        finals: List[State] = []
        for layer in range(self.num_layers):
            outputs = []
            for direction in range(self.num_directions):
                index = layer * self.num_directions + direction
                cell = getattr(self, self._cell_names[index])
                out, final = _run_direction(cell, x, states[index], valid, reverse=direction == 1)
                outputs.append(out)
                finals.append(final)
            x = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]
            if layer < self.num_layers - 1 and self.dropout > 0:
                x = F.dropout(x, self.dropout, self.training)
        return from_batch_major(x, layout), self._final_states(finals, layout.unbatched)

    def extra_repr(self) -> str:
        text = f"{self.input_size}, {self.hidden_size}, num_layers={self.num_layers}"
        if self.proj_size:
            text += f", proj_size={self.proj_size}"
        return text + (f", bias={self.bias}, batch_first={self.batch_first}, "
                       f"dropout={self.dropout}, bidirectional={self.bidirectional}")


class DPRNN(DPRNNBase):
    """Drop-in for ``nn.RNN`` (Elman RNN, tanh or relu)."""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1,
                 nonlinearity: str = "tanh", bias: bool = True, batch_first: bool = False,
                 dropout: float = 0.0, bidirectional: bool = False, device=None, dtype=None):
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"DPRNN: nonlinearity must be 'tanh' or 'relu', got {nonlinearity!r}")
        super().__init__(f"RNN_{nonlinearity.upper()}", input_size, hidden_size, num_layers, bias,
                         batch_first, dropout, bidirectional, device=device, dtype=dtype)
        self.nonlinearity = nonlinearity


class DPGRU(DPRNNBase):
    """Drop-in for ``nn.GRU``."""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False,
                 device=None, dtype=None):
        super().__init__("GRU", input_size, hidden_size, num_layers, bias, batch_first, dropout,
                         bidirectional, device=device, dtype=dtype)


class DPLSTM(DPRNNBase):
    """Drop-in for ``nn.LSTM``, including ``proj_size`` (``h_t = W_hr(o_t ⊙ tanh(c_t))``)."""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False,
                 proj_size: int = 0, device=None, dtype=None):
        super().__init__("LSTM", input_size, hidden_size, num_layers, bias, batch_first, dropout,
                         bidirectional, proj_size, device=device, dtype=dtype)
