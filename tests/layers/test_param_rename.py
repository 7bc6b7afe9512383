"""State-dict key aliasing of the DP layers when they are nested inside other modules."""

import pytest
import torch
import torch.nn as nn

from opacus_dp.grad_sample import GradSampleModule
from opacus_dp.layers import DPLSTM, DPMultiheadAttention


class _Reference(nn.Module):
    def __init__(self, lstm_cls, mha_cls):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(3, 3), lstm_cls(3, 4, bidirectional=True))
        self.attention = mha_cls(8, 2, add_bias_kv=True)


def test_nested_layers_use_torch_keys_under_their_prefix():
    ours = _Reference(DPLSTM, DPMultiheadAttention)
    theirs = _Reference(nn.LSTM, nn.MultiheadAttention)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())
    theirs.load_state_dict(ours.state_dict())
    assert torch.equal(ours.encoder[1].weight_hh_l0_reverse, theirs.encoder[1].weight_hh_l0_reverse)
    assert torch.equal(ours.attention.bias_v, theirs.attention.bias_v)


def test_nested_missing_and_unexpected_keys_use_torch_names():
    ours = _Reference(DPLSTM, DPMultiheadAttention)
    state = _Reference(nn.LSTM, nn.MultiheadAttention).state_dict()
    del state["encoder.1.bias_ih_l0_reverse"], state["attention.in_proj_bias"]
    state["encoder.1.weight_ih_l7"] = torch.zeros(1)
    result = ours.load_state_dict(state, strict=False)
    assert result.missing_keys == ["encoder.1.bias_ih_l0_reverse", "attention.in_proj_bias"]
    assert result.unexpected_keys == ["encoder.1.weight_ih_l7"]
    assert not any("_alias_load_prefix" in vars(m) for m in ours.modules())


def test_wrapped_layer_state_dict_carries_the_wrapper_prefix():
    layer = DPLSTM(3, 4)
    gsm = GradSampleModule(layer)
    assert list(gsm.state_dict()) == ["_module." + k for k in nn.LSTM(3, 4).state_dict()]
    gsm.close()


def test_parameters_are_registered_once():
    layer = DPLSTM(3, 4, num_layers=2, proj_size=2)
    names = [n for n, _ in layer.named_parameters()]
    assert len(names) == len({id(p) for p in layer.parameters()}) == len(layer.state_dict())
    assert all(n.startswith(("l0.", "l1.")) for n in names)
    with pytest.raises(AttributeError, match="weight_ih_l5"):
        layer.weight_ih_l5
