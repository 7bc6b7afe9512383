"""DPRNN/DPGRU/DPLSTM against torch's nn.RNN/GRU/LSTM with the same weights (float64)."""

import copy
import io

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from opacus_dp.layers import DPGRU, DPLSTM, DPRNN
from tests.layers.common import (
    HIDDEN_SIZE,
    INPUT_SIZE,
    RNN_KINDS,
    assert_outputs_close,
    output_loss,
    rnn_hx,
    rnn_input,
    rnn_pair,
)


@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from(sorted(RNN_KINDS)),
    num_layers=st.integers(1, 2),
    bidirectional=st.booleans(),
    batch_first=st.booleans(),
    bias=st.booleans(),
    with_hx=st.booleans(),
    input_kind=st.sampled_from(["tensor", "unbatched", "packed_sorted", "packed_unsorted"]),
    batch=st.integers(1, 4),
    steps=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_forward_and_gradients_match_torch(kind, num_layers, bidirectional, batch_first, bias,
                                           with_hx, input_kind, batch, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    reference, layer = rnn_pair(kind, num_layers=num_layers, bidirectional=bidirectional,
                                batch_first=batch_first, bias=bias)
    x, _ = rnn_input(batch, steps, batch_first, input_kind, gen)
    args = (x, rnn_hx(reference, batch, input_kind == "unbatched", gen)) if with_hx else (x,)
    expected, actual = reference(*args), layer(*args)
    assert_outputs_close(actual, expected)

    output_loss(expected).backward()
    output_loss(actual).backward()
    for name, param in reference.named_parameters():
        torch.testing.assert_close(getattr(layer, name).grad, param.grad, atol=1e-11, rtol=0)


@pytest.mark.parametrize("kind", sorted(RNN_KINDS))
def test_state_dict_keys_order_and_shapes_equal_torch(kind):
    reference, layer = rnn_pair(kind, num_layers=2, bidirectional=True)
    theirs, ours = reference.state_dict(), layer.state_dict()
    assert list(ours) == list(theirs)
    assert all(ours[k].shape == theirs[k].shape for k in theirs)


@pytest.mark.parametrize("kind", sorted(RNN_KINDS))
def test_state_dict_loads_both_ways(kind):
    dp_cls, torch_cls, extra = RNN_KINDS[kind]
    layer = dp_cls(INPUT_SIZE, HIDDEN_SIZE, num_layers=2, bidirectional=True, **extra).double()
    reference = torch_cls(INPUT_SIZE, HIDDEN_SIZE, num_layers=2, bidirectional=True, **extra)
    reference = reference.double()
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(5, 2, INPUT_SIZE, dtype=torch.float64)
    assert_outputs_close(layer(x), reference(x))
    fresh = dp_cls(INPUT_SIZE, HIDDEN_SIZE, num_layers=2, bidirectional=True, **extra).double()
    fresh.load_state_dict(reference.state_dict())
    assert_outputs_close(fresh(x), reference(x))


def test_torch_names_resolve_to_the_cell_parameters():
    reference, layer = rnn_pair("lstm_proj", num_layers=2, bidirectional=True)
    assert layer.weight_ih_l1_reverse is layer.l1_reverse.ih.weight
    assert layer.weight_hr_l0 is layer.l0.hr.weight
    assert len(list(layer.parameters())) == len(list(reference.parameters()))
    assert [[p.shape for p in ws] for ws in layer.all_weights] == [
        [p.shape for p in ws] for ws in reference.all_weights
    ]
    with pytest.raises(AttributeError):
        layer.weight_ih_l2


@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_dropout_is_inactive_in_eval_and_between_layers_in_training(kind):
    reference, layer = rnn_pair(kind, num_layers=2, dropout=0.5)
    x = torch.randn(4, 3, INPUT_SIZE, dtype=torch.float64)
    reference.eval(), layer.eval()
    assert_outputs_close(layer(x), reference(x))
    # p = 1 drops the whole first-layer output: deterministic, so torch must agree exactly.
    reference, layer = rnn_pair(kind, num_layers=2, dropout=1.0)
    assert_outputs_close(layer(x), reference(x))
    layer.eval()
    assert not torch.allclose(layer(x)[0], reference(x)[0])


def test_dropout_with_one_layer_warns_like_torch():
    with pytest.warns(UserWarning, match="dropout"):
        DPLSTM(INPUT_SIZE, HIDDEN_SIZE, dropout=0.2)


def test_empty_batch_gives_empty_outputs_like_torch():
    reference, layer = rnn_pair("lstm", bidirectional=True)
    x = torch.randn(3, 0, INPUT_SIZE, dtype=torch.float64)
    assert_outputs_close(layer(x), reference(x))


def test_copy_and_pickle_keep_torch_state_dict():
    _, layer = rnn_pair("gru", num_layers=2, bidirectional=True)
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    for clone in (copy.deepcopy(layer), torch.load(buffer, weights_only=False)):
        assert list(clone.state_dict()) == list(layer.state_dict())
        assert clone.weight_hh_l1_reverse is clone.l1_reverse.hh.weight
        x = torch.randn(2, 3, INPUT_SIZE, dtype=torch.float64)
        assert_outputs_close(clone(x), layer(x))


def test_internal_parameter_names_load_too():
    _, layer = rnn_pair("lstm")
    internal = {name: p.detach().clone() for name, p in layer.named_parameters()}
    fresh = DPLSTM(INPUT_SIZE, HIDDEN_SIZE).double()
    fresh.load_state_dict(internal)
    assert torch.equal(fresh.weight_ih_l0, layer.weight_ih_l0)


def test_missing_keys_are_reported_with_torch_names():
    reference = nn.LSTM(INPUT_SIZE, HIDDEN_SIZE, bias=False)
    with pytest.raises(RuntimeError, match="bias_ih_l0"):
        DPLSTM(INPUT_SIZE, HIDDEN_SIZE).load_state_dict(reference.state_dict())


@pytest.mark.parametrize(
    "build, call, message",
    [
        (lambda: DPLSTM(3, 4, proj_size=4), None, "proj_size"),
        (lambda: DPGRU(3, 4, num_layers=0), None, "num_layers"),
        (lambda: DPRNN(3, 4, nonlinearity="sigmoid"), None, "nonlinearity"),
        (lambda: DPGRU(3, 4, dropout=1.5), None, "dropout"),
        (lambda: DPGRU(0, 4), None, "input_size"),
        (lambda: DPLSTM(3, 4), lambda m: m(torch.randn(2, 5, 4)), "input_size=3"),
        (lambda: DPLSTM(3, 4), lambda m: m(torch.randn(2, 5, 3), torch.zeros(1, 5, 4)), "tuple"),
        (lambda: DPGRU(3, 4), lambda m: m(torch.randn(2, 5, 3), torch.zeros(1, 2, 4)), r"hx\[0\]"),
        (lambda: DPGRU(3, 4), lambda m: m(torch.randn(1, 2, 5, 3)), "3-D"),
        (lambda: DPGRU(3, 4), lambda m: m(torch.randn(0, 2, 3)), "empty"),
    ],
)
def test_bad_arguments_raise_clear_errors(build, call, message):
    with pytest.raises(ValueError, match=message):
        module = build()
        call(module)


def test_proj_size_is_refused_outside_lstm():
    with pytest.raises(TypeError):
        DPGRU(3, 4, proj_size=2)


class _SequenceSizedOutputs(TorchDispatchMode):
    """Counts the operations that write a tensor of at least ``elements`` elements."""

    def __init__(self, elements: int):
        super().__init__()
        self.elements, self.names = elements, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.numel() >= self.elements:
            self.names.append(func.overloadpacket.__name__)
        return out


@pytest.mark.parametrize("mode", ["LSTM", "GRU", "RNN_TANH"])
def test_the_backward_pass_does_not_zero_the_whole_sequence_at_every_step(mode):
    """The input projection of all steps is cut into steps once: its backward stacks the steps'
    gradients. Indexing it at every step made each step's backward write a zero gradient of the
    whole sequence (T of them, T² memory traffic: most of a DPLSTM step's time)."""
    layer = {"LSTM": DPLSTM, "GRU": DPGRU, "RNN_TANH": DPRNN}[mode](8, 16, batch_first=True)
    x = torch.randn(4, 32, 8)
    out = layer(x)[0]
    projection = 4 * 32 * {"LSTM": 4, "GRU": 3, "RNN_TANH": 1}[mode] * 16  # B · T · (gates · H)
    with _SequenceSizedOutputs(projection) as written:
        out.sum().backward()
    # the steps' gradients stacked once (and viewed), not a sequence-sized tensor per step
    assert len(written.names) < 32 // 4, written.names
    reference = getattr(nn, mode.split("_")[0])(8, 16, batch_first=True)
    reference.load_state_dict(layer.state_dict())
    reference(x)[0].sum().backward()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(getattr(layer, name).grad, p.grad, rtol=1e-5, atol=1e-6)
