"""Shared test utilities for the DP layers: matching torch/DP pairs and output comparison."""

import torch
import torch.nn as nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

from opacus_dp.layers import DPGRU, DPLSTM, DPRNN

INPUT_SIZE, HIDDEN_SIZE, PROJ_SIZE = 3, 4, 2

# (name, DP class, torch class, extra constructor arguments)
RNN_KINDS = {
    "rnn_tanh": (DPRNN, nn.RNN, {"nonlinearity": "tanh"}),
    "rnn_relu": (DPRNN, nn.RNN, {"nonlinearity": "relu"}),
    "gru": (DPGRU, nn.GRU, {}),
    "lstm": (DPLSTM, nn.LSTM, {}),
    "lstm_proj": (DPLSTM, nn.LSTM, {"proj_size": PROJ_SIZE}),
}


def rnn_pair(kind: str, **options):
    """A float64 torch recurrent layer and the DP layer loaded from its state dict."""
    dp_cls, torch_cls, extra = RNN_KINDS[kind]
    reference = torch_cls(INPUT_SIZE, HIDDEN_SIZE, **extra, **options).double()
    layer = dp_cls(INPUT_SIZE, HIDDEN_SIZE, **extra, **options).double()
    layer.load_state_dict(reference.state_dict())
    return reference, layer


def rnn_input(batch: int, steps: int, batch_first: bool, kind: str, generator: torch.Generator):
    """Returns ``(input, lengths)``; ``kind`` is one of 'tensor', 'unbatched',
    'packed_sorted', 'packed_unsorted'."""
    x = torch.randn(batch, steps, INPUT_SIZE, dtype=torch.float64, generator=generator)
    if kind == "unbatched":
        return x[0], None
    if kind == "tensor":
        return (x if batch_first else x.transpose(0, 1)), None
    lengths = torch.randint(1, steps + 1, (batch,), generator=generator)
    lengths[0] = steps
    if kind == "packed_sorted":
        lengths = lengths.sort(descending=True).values
    padded = x if batch_first else x.transpose(0, 1)
    packed = pack_padded_sequence(padded, lengths, batch_first=batch_first,
                                  enforce_sorted=kind == "packed_sorted")
    return packed, lengths


def rnn_hx(reference: nn.Module, batch: int, unbatched: bool, generator: torch.Generator):
    """A random initial state of the right shape for ``reference`` (h_0 or (h_0, c_0))."""
    layers = reference.num_layers * (2 if reference.bidirectional else 1)
    leading = (layers,) if unbatched else (layers, batch)
    out_size = getattr(reference, "proj_size", 0) or reference.hidden_size
    h = torch.randn(*leading, out_size, dtype=torch.float64, generator=generator)
    if isinstance(reference, nn.LSTM):
        c = torch.randn(*leading, reference.hidden_size, dtype=torch.float64, generator=generator)
        return h, c
    return h


def flat_tensors(value):
    """Every tensor of a nested output (PackedSequence fields included), in order."""
    if isinstance(value, PackedSequence):
        return [t for t in value if t is not None]
    if isinstance(value, torch.Tensor):
        return [value]
    if value is None:
        return []
    return [t for item in value for t in flat_tensors(item)]


def assert_outputs_close(actual, expected, atol=1e-12):
    assert type(actual) is type(expected)
    got, want = flat_tensors(actual), flat_tensors(expected)
    assert len(got) == len(want)
    for a, e in zip(got, want):
        assert a.shape == e.shape and a.dtype == e.dtype
        torch.testing.assert_close(a, e, atol=atol, rtol=0, equal_nan=True)


def output_loss(output) -> torch.Tensor:
    """A nonlinear scalar of every floating output tensor."""
    total = 0
    for t in flat_tensors(output):
        if t.is_floating_point():
            total = total + (0.5 * t * t + 0.3 * t).sum()
    return total
