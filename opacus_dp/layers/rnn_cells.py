"""Recurrent cells built from :class:`RNNLinear` projections (drop-ins for torch's cells).

Every weight lives in an ``RNNLinear`` (``ih``: input projection, ``hh``: recurrent
projection, ``hr``: LSTM output projection), whose calls always carry the full batch on
dim 0, so per-sample gradients come from the Linear sampler. Gate formulas are torch's
(see ``torch.nn.RNNCell``, ``GRUCell``, ``LSTMCell``), with ``σ`` the logistic sigmoid:

* RNN:  ``h' = act(W_ih x + b_ih + W_hh h + b_hh)``, ``act`` = tanh or relu;
* GRU:  gates ``r, z, n`` (in this order in the weights):
  ``r = σ(.)``, ``z = σ(.)``, ``n = tanh(W_in x + b_in + r ⊙ (W_hn h + b_hn))``,
  ``h' = (1 - z) ⊙ n + z ⊙ h``;
* LSTM: gates ``i, f, g, o``: ``c' = σ(f) ⊙ c + σ(i) ⊙ tanh(g)``,
  ``h' = σ(o) ⊙ tanh(c')``, then ``h' = W_hr h'`` when ``proj_size > 0``.

State-dict keys are torch's (``weight_ih``, ``weight_hh``, ``bias_ih``, ``bias_hh``,
``weight_hr``), so ``DPLSTMCell.load_state_dict(nn.LSTMCell(...).state_dict())`` works and
vice versa. Weights are initialised like torch: ``U(-1/sqrt(hidden_size), 1/sqrt(hidden_size))``.
"""

import abc
import math
from typing import Tuple

import torch
import torch.nn as nn

from opacus_dp.layers.arguments import check_positive_int
from opacus_dp.layers.batch_first import RNNLinear
from opacus_dp.layers.param_rename import StateDictAliasMixin

State = Tuple[torch.Tensor, ...]

_TORCH_NAMES = (
    ("ih.weight", "weight_ih"),
    ("hh.weight", "weight_hh"),
    ("ih.bias", "bias_ih"),
    ("hh.bias", "bias_hh"),
    ("hr.weight", "weight_hr"),
)


class DPRNNCellBase(StateDictAliasMixin, nn.Module, abc.ABC):
    """A cell with ``num_gates * hidden_size`` wide projections ``ih`` and ``hh``.

    ``recurrence(input_gates, state)`` advances one step given ``input_gates = ih(x)``,
    so a layer can project a whole sequence with one ``ih`` call. ``state`` is a tuple:
    ``(h,)`` for RNN/GRU and ``(h, c)`` for LSTM, each ``(B, size)``.
    """

    num_gates = 1
    # Projections whose output gradients are the same numbers at each step: ``ih``'s output at
    # position ``t`` and ``hh``'s output at step ``t`` are added into the gates (see
    # opacus_dp.grad_sample.bookkeeping.step_gradients); not the GRU's.
    _dp_shared_gate_gradients: Tuple[Tuple[str, str], ...] = ()

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True, proj_size: int = 0,
                 device=None, dtype=None):
        super().__init__()
        name = type(self).__name__
        check_positive_int(name, "input_size", input_size)
        check_positive_int(name, "hidden_size", hidden_size)
        check_positive_int(name, "proj_size", proj_size, allow_zero=True)
        if proj_size >= hidden_size:
            raise ValueError(f"{name}: proj_size ({proj_size}) must be smaller than hidden_size "
                             f"({hidden_size})")
        self.input_size, self.hidden_size = input_size, hidden_size
        self.bias, self.proj_size = bias, proj_size
        factory = {"device": device, "dtype": dtype}
        width = self.num_gates * hidden_size
        self.ih = RNNLinear(input_size, width, bias=bias, **factory)
        self.hh = RNNLinear(proj_size or hidden_size, width, bias=bias, **factory)
        if proj_size > 0:
            self.hr = RNNLinear(hidden_size, proj_size, bias=False, **factory)
        self.reset_parameters()
        present = {n for n, _ in self.named_parameters()}
        self._install_state_dict_aliases([(i, e) for i, e in _TORCH_NAMES if i in present])

    @property
    def output_size(self) -> int:
        """Size of ``h`` (``proj_size`` if set, else ``hidden_size``)."""
        return self.proj_size or self.hidden_size

    def state_sizes(self) -> Tuple[int, ...]:
        """Sizes of the state tensors: ``(h,)`` or ``(h, c)``."""
        return (self.output_size,)

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.hidden_size)
        for p in self.parameters():
            nn.init.uniform_(p, -bound, bound)

    @abc.abstractmethod
    def recurrence(self, input_gates: torch.Tensor, state: State) -> State:
        """One step from ``input_gates = ih(x_t)`` of shape ``(B, num_gates * hidden)``. The cells
        whose gradients ``_dp_shared_gate_gradients`` declares also take ``project``, what
        computes ``hh(h)`` (default ``self.hh``; :mod:`~opacus_dp.layers.joined_steps`)."""

    def _initial_state(self, hx, batch: int, like: torch.Tensor) -> State:
        if hx is None:
            return tuple(like.new_zeros(batch, s) for s in self.state_sizes())
        hx = tuple(hx) if isinstance(hx, (tuple, list)) else (hx,)
        sizes = self.state_sizes()
        if len(hx) != len(sizes):
            want = "a tuple (h, c)" if len(sizes) == 2 else "a single tensor h"
            raise ValueError(f"{type(self).__name__}: hx must be {want}")
        for k, (h, size) in enumerate(zip(hx, sizes)):
            if tuple(h.shape) != (batch, size):
                raise ValueError(f"{type(self).__name__}: hx[{k}] must have shape "
                                 f"{(batch, size)}, got {tuple(h.shape)}")
        return hx

    def forward(self, input: torch.Tensor, hx=None):
        """torch's cell API: ``input`` is ``(B, input_size)`` or unbatched ``(input_size,)``."""
        if input.dim() not in (1, 2) or input.shape[-1] != self.input_size:
            raise ValueError(f"{type(self).__name__}: input must have shape (batch, "
                             f"{self.input_size}) or ({self.input_size},), "
                             f"got {tuple(input.shape)}")
        unbatched = input.dim() == 1
        if unbatched:
            input = input.unsqueeze(0)
            if isinstance(hx, (tuple, list)):
                hx = tuple(h.unsqueeze(0) for h in hx)
            elif hx is not None:
                hx = hx.unsqueeze(0)
        state = self.recurrence(self.ih(input), self._initial_state(hx, input.shape[0], input))
        if unbatched:
            state = tuple(s.squeeze(0) for s in state)
        return state if len(state) > 1 else state[0]


class DPRNNCell(DPRNNCellBase):
    """Drop-in for ``nn.RNNCell``: ``h' = act(W_ih x + b_ih + W_hh h + b_hh)``."""

    num_gates = 1
    _dp_shared_gate_gradients = (("ih", "hh"),)

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True,
                 nonlinearity: str = "tanh", device=None, dtype=None):
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(
                f"DPRNNCell: nonlinearity must be 'tanh' or 'relu', got {nonlinearity!r}")
        super().__init__(input_size, hidden_size, bias, device=device, dtype=dtype)
        self.nonlinearity = nonlinearity

    def recurrence(self, input_gates: torch.Tensor, state: State, project=None) -> State:
        pre = input_gates + (project or self.hh)(state[0])
        return (torch.tanh(pre) if self.nonlinearity == "tanh" else torch.relu(pre),)


class DPGRUCell(DPRNNCellBase):
    """Drop-in for ``nn.GRUCell`` (gate order r, z, n)."""

    num_gates = 3

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True, device=None,
                 dtype=None):
        super().__init__(input_size, hidden_size, bias, device=device, dtype=dtype)

    def recurrence(self, input_gates: torch.Tensor, state: State) -> State:
        h = state[0]
        x_r, x_z, x_n = input_gates.chunk(3, dim=-1)
        h_r, h_z, h_n = self.hh(h).chunk(3, dim=-1)
        r = torch.sigmoid(x_r + h_r)
        z = torch.sigmoid(x_z + h_z)
        n = torch.tanh(x_n + r * h_n)
        return (n + z * (h - n),)


class DPLSTMCell(DPRNNCellBase):
    """Drop-in for ``nn.LSTMCell`` (gate order i, f, g, o); ``proj_size`` adds ``W_hr``."""

    num_gates = 4
    _dp_shared_gate_gradients = (("ih", "hh"),)

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True, device=None,
                 dtype=None, proj_size: int = 0):
        super().__init__(input_size, hidden_size, bias, proj_size, device=device, dtype=dtype)

    def state_sizes(self) -> Tuple[int, ...]:
        return (self.output_size, self.hidden_size)

    def recurrence(self, input_gates: torch.Tensor, state: State, project=None) -> State:
        h, c = state
        i, f, g, o = (input_gates + (project or self.hh)(h)).chunk(4, dim=-1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        if self.proj_size > 0:
            h = self.hr(h)
        return h, c


CELL_TYPES = {"RNN_TANH": DPRNNCell, "RNN_RELU": DPRNNCell, "GRU": DPGRUCell, "LSTM": DPLSTMCell}
