"""nn.Linear per-sample gradients against the batch-size-1 autograd oracle and Opacus 1.6."""

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from opacus_dp.grad_sample import GradSampleModule
from opacus_dp.grad_sample.linear import linear_grad_sample
from opacus_dp.grad_sample.registry import GRAD_SAMPLERS

from tests.grad_sample.oracle import (
    assert_grad_samples_close,
    gsm_grad_samples,
    oracle_grad_samples,
)


def test_linear_is_registered():
    assert GRAD_SAMPLERS[nn.Linear] is linear_grad_sample


@settings(max_examples=20, deadline=None)
@given(
    batch=st.integers(1, 4),
    middle=st.lists(st.integers(1, 3), max_size=2),
    features=st.tuples(st.integers(1, 4), st.integers(1, 4)),
    bias=st.booleans(),
    batch_first=st.booleans(),
    loss_reduction=st.sampled_from(["mean", "sum"]),
)
def test_linear_matches_oracle(batch, middle, features, bias, batch_first, loss_reduction):
    layer = nn.Linear(*features, bias=bias).double()
    shape = [batch, *middle, features[0]]
    if not batch_first:
        if not middle:
            return  # a 2-D sequence-first input has no separate batch dimension
        shape[0], shape[1] = shape[1], shape[0]
    x = torch.randn(*shape, dtype=torch.double)
    expected = oracle_grad_samples(layer, (x,), batch_dim=0 if batch_first else 1)
    actual = gsm_grad_samples(
        layer, (x,), loss_reduction=loss_reduction, batch_first=batch_first
    )
    assert_grad_samples_close(actual, expected)


def test_linear_with_frozen_bias_returns_only_weight():
    layer = nn.Linear(3, 2).double()
    layer.bias.requires_grad_(False)
    x = torch.randn(4, 3, dtype=torch.double)
    expected = oracle_grad_samples(layer, (x,))
    assert_grad_samples_close(gsm_grad_samples(layer, (x,)), expected)
    assert not hasattr(layer.bias, "grad_sample")


@pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")  # Opacus's hooks (the reference)
@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_linear_matches_opacus(loss_reduction):
    import opacus

    torch.manual_seed(1)
    ours = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    theirs = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(6, 2, 5, dtype=torch.double)
    actual = gsm_grad_samples(ours, (x,), loss_reduction=loss_reduction)
    reference = opacus.GradSampleModule(theirs, loss_reduction=loss_reduction)
    out = reference(x)
    loss = (0.5 * out * out + 0.3 * out).sum()
    (loss / 6 if loss_reduction == "mean" else loss).backward()
    expected = {n: p.grad_sample for n, p in theirs.named_parameters()}
    assert_grad_samples_close(actual, expected)


def test_linear_empty_batch_end_to_end():
    layer = nn.Linear(3, 2)
    gsm = GradSampleModule(layer)
    gsm(torch.zeros(0, 3)).sum().backward()
    assert layer.weight.grad_sample.shape == (0, 2, 3)
    assert layer.bias.grad_sample.shape == (0, 2)
    gsm.close()
