"""DPRNNCell/DPGRUCell/DPLSTMCell against torch's cells with the same weights (float64)."""

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from opacus_dp.grad_sample import GradSampleModule
from opacus_dp.layers import DPGRUCell, DPLSTMCell, DPRNNCell
from tests.layers.common import assert_outputs_close, output_loss

CELLS = {
    "rnn_tanh": (DPRNNCell, nn.RNNCell, {"nonlinearity": "tanh"}),
    "rnn_relu": (DPRNNCell, nn.RNNCell, {"nonlinearity": "relu"}),
    "gru": (DPGRUCell, nn.GRUCell, {}),
    "lstm": (DPLSTMCell, nn.LSTMCell, {}),
}


def cell_pair(kind, bias=True):
    dp_cls, torch_cls, extra = CELLS[kind]
    reference = torch_cls(3, 4, bias=bias, dtype=torch.float64, **extra)
    cell = dp_cls(3, 4, bias=bias, dtype=torch.float64, **extra)
    cell.load_state_dict(reference.state_dict())
    return reference, cell


def random_state(kind, leading, gen):
    h = torch.randn(*leading, 4, dtype=torch.float64, generator=gen)
    if kind != "lstm":
        return h
    return h, torch.randn(*leading, 4, dtype=torch.float64, generator=gen)


@settings(max_examples=20, deadline=None)
@given(kind=st.sampled_from(sorted(CELLS)), bias=st.booleans(), unbatched=st.booleans(),
       with_hx=st.booleans(), batch=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_cells_match_torch(kind, bias, unbatched, with_hx, batch, seed):
    gen = torch.Generator().manual_seed(seed)
    reference, cell = cell_pair(kind, bias)
    leading = () if unbatched else (batch,)
    x = torch.randn(*leading, 3, dtype=torch.float64, generator=gen)
    args = (x, random_state(kind, leading, gen)) if with_hx else (x,)
    expected, actual = reference(*args), cell(*args)
    assert_outputs_close(actual, expected)
    output_loss(expected).backward()
    output_loss(actual).backward()
    for name, param in reference.named_parameters():
        torch.testing.assert_close(getattr(cell, name).grad, param.grad, atol=1e-12, rtol=0)


@pytest.mark.parametrize("kind", sorted(CELLS))
def test_cell_state_dicts_are_torch_state_dicts(kind):
    reference, cell = cell_pair(kind)
    assert list(cell.state_dict()) == list(reference.state_dict())
    dp_cls, torch_cls, extra = CELLS[kind]
    fresh = torch_cls(3, 4, dtype=torch.float64, **extra)
    fresh.load_state_dict(cell.state_dict())
    x = torch.randn(2, 3, dtype=torch.float64)
    assert_outputs_close(cell(x), fresh(x))


@pytest.mark.parametrize("kind", sorted(CELLS))
def test_cell_unrolled_in_a_loop_has_per_sample_gradients_of_torch(kind):
    """A cell called once per step: GradSampleModule sums the calls of each sample."""
    gen = torch.Generator().manual_seed(3)
    reference, cell = cell_pair(kind)
    xs = torch.randn(5, 3, 3, dtype=torch.float64, generator=gen)  # (T, B, F)

    def unroll(module, inputs):
        state, total = None, 0
        for x in inputs:
            state = module(x) if state is None else module(x, state)
            total = total + output_loss(state)
        return total

    gsm = GradSampleModule(cell, batch_first=True, loss_reduction="sum")
    unroll(gsm, xs).backward()
    for i in range(3):
        reference.zero_grad()
        unroll(reference, xs[:, i : i + 1]).backward()
        for name, param in reference.named_parameters():
            torch.testing.assert_close(getattr(cell, name).grad_sample[i], param.grad, atol=1e-11,
                                       rtol=0)
    gsm.close()


def test_lstm_cell_projection_matches_lstm_step():
    lstm = nn.LSTM(3, 4, proj_size=2, dtype=torch.float64)
    cell = DPLSTMCell(3, 4, proj_size=2, dtype=torch.float64)
    cell.load_state_dict({k[: -len("_l0")]: v for k, v in lstm.state_dict().items()})
    x = torch.randn(1, 5, 3, dtype=torch.float64)
    _, (h, c) = lstm(x)
    assert_outputs_close(cell(x[0]), (h[0], c[0]))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: DPGRUCell(3, 0), "hidden_size"),
        (lambda: DPRNNCell(3, 4, nonlinearity="gelu"), "nonlinearity"),
        (lambda: DPGRUCell(3, 4)(torch.randn(2, 5)), "input"),
        (lambda: DPGRUCell(3, 4)(torch.randn(2, 3), torch.randn(3, 4)), "hx"),
        (lambda: DPLSTMCell(3, 4, proj_size=4), "proj_size"),
    ],
)
def test_cell_errors_name_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()
