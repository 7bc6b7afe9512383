"""nn.Embedding per-sample gradients against the batch-size-1 autograd oracle and Opacus 1.6."""

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from opacus_dp.errors import UnsupportedModuleError
from opacus_dp.grad_sample import GradSampleModule

from tests.grad_sample.oracle import (
    assert_grad_samples_close,
    gsm_grad_samples,
    oracle_grad_samples,
)


@settings(max_examples=20, deadline=None)
@given(
    batch=st.integers(1, 4),
    positions=st.lists(st.integers(1, 3), max_size=2),
    num_rows=st.integers(1, 6),
    padding=st.booleans(),
    scale_grad_by_freq=st.booleans(),
    batch_first=st.booleans(),
    loss_reduction=st.sampled_from(["mean", "sum"]),
    seed=st.integers(0, 1000),
)
def test_embedding_matches_oracle(
    batch, positions, num_rows, padding, scale_grad_by_freq, batch_first, loss_reduction, seed
):
    if not batch_first and not positions:
        return  # a 1-D sequence-first input has no separate batch dimension
    torch.manual_seed(seed)
    layer = nn.Embedding(
        num_rows, 3, padding_idx=0 if padding else None, scale_grad_by_freq=scale_grad_by_freq
    ).double()
    shape = [batch, *positions]
    if not batch_first:
        shape[0], shape[1] = shape[1], shape[0]
    x = torch.randint(0, num_rows, shape)
    expected = oracle_grad_samples(layer, (x,), batch_dim=0 if batch_first else 1)
    actual = gsm_grad_samples(
        layer, (x,), loss_reduction=loss_reduction, batch_first=batch_first
    )
    assert_grad_samples_close(actual, expected)


def test_padding_row_gets_no_gradient():
    layer = nn.Embedding(4, 2, padding_idx=1)
    x = torch.tensor([[1, 1, 2], [1, 3, 3]])
    grads = gsm_grad_samples(layer, (x,), loss_reduction="sum")
    assert torch.all(grads["weight"][:, 1] == 0)
    assert torch.any(grads["weight"][:, 3] != 0)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")  # Opacus's hooks (the reference)
@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_embedding_matches_opacus(loss_reduction):
    import opacus

    ours = nn.Sequential(nn.Embedding(7, 3), nn.Linear(3, 2)).double()
    theirs = nn.Sequential(nn.Embedding(7, 3), nn.Linear(3, 2)).double()
    theirs.load_state_dict(ours.state_dict())
    x = torch.randint(0, 7, (5, 4))
    actual = gsm_grad_samples(ours, (x,), loss_reduction=loss_reduction)
    reference = opacus.GradSampleModule(theirs, loss_reduction=loss_reduction)
    out = reference(x)
    loss = (0.5 * out * out + 0.3 * out).sum()
    (loss / 5 if loss_reduction == "mean" else loss).backward()
    expected = {n: p.grad_sample for n, p in theirs.named_parameters()}
    assert_grad_samples_close(actual, expected)


@pytest.mark.parametrize(
    "layer, words",
    [
        (nn.Embedding(5, 2, max_norm=1.0), "max_norm"),
        (nn.Embedding(5, 2, sparse=True), "sparse"),
    ],
)
def test_embedding_options_that_break_per_sample_gradients_are_refused(layer, words):
    model = nn.Sequential(nn.Linear(2, 2), layer)
    with pytest.raises(UnsupportedModuleError, match=rf"1 \(Embedding\).*{words}"):
        GradSampleModule(model)
    assert not GradSampleModule.is_supported(model)
    layer.weight.requires_grad_(False)
    # frozen max_norm still renormalises the looked-up rows in place (no noise): refused
    assert GradSampleModule.is_supported(model) == (words != "max_norm")


def test_embedding_empty_batch_end_to_end():
    layer = nn.Embedding(5, 2)
    gsm = GradSampleModule(layer)
    gsm(torch.zeros(0, 3, dtype=torch.long)).sum().backward()
    assert layer.weight.grad_sample.shape == (0, 5, 2)
    gsm.close()
