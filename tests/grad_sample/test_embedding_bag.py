"""nn.EmbeddingBag per-sample gradients (each bag is a sample) against an autograd oracle."""

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from opacus_dp.grad_sample import GradSampleModule

from tests.grad_sample.oracle import (
    assert_grad_samples_close,
    batch_loss,
    gsm_grad_samples,
    oracle_from_samples,
    oracle_grad_samples,
)


def run_gsm(layer, args, kwargs, batch_size, loss_reduction):
    return gsm_grad_samples(
        layer, args, kwargs, loss_reduction=loss_reduction, batch_size=batch_size
    )


def bag_samples(bags, weights):
    """One (args, kwargs) per bag, as a 1-D input with a single offset."""
    samples = []
    for i, bag in enumerate(bags):
        kwargs = {"offsets": torch.tensor([0])}
        if weights is not None:
            kwargs["per_sample_weights"] = weights[i]
        samples.append(((bag,), kwargs))
    return samples


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 4), min_size=1, max_size=4),
    mode=st.sampled_from(["sum", "mean", "max"]),
    padding=st.booleans(),
    weighted=st.booleans(),
    include_last_offset=st.booleans(),
    loss_reduction=st.sampled_from(["mean", "sum"]),
    seed=st.integers(0, 1000),
    by_freq=st.booleans(),
)
def test_offsets_input_matches_oracle(
    lengths, mode, padding, weighted, include_last_offset, loss_reduction, seed, by_freq
):
    """(``scale_grad_by_freq``: the oracle's bag alone counts the frequencies in the sample.)"""
    torch.manual_seed(seed)
    weighted = weighted and mode == "sum"
    by_freq = by_freq and mode != "max"  # torch refuses it with max
    layer = nn.EmbeddingBag(
        6, 3, mode=mode, padding_idx=2 if padding else None,
        include_last_offset=include_last_offset, scale_grad_by_freq=by_freq,
    ).double()
    bags = [torch.randint(0, 6, (n,)) for n in lengths]
    weights = [torch.randn(n, dtype=torch.double) for n in lengths] if weighted else None
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    offsets = starts if include_last_offset else starts[:-1]
    kwargs = {"offsets": offsets}
    if weighted:
        kwargs["per_sample_weights"] = torch.cat(weights)
    oracle_layer = nn.EmbeddingBag(6, 3, mode=mode, padding_idx=layer.padding_idx,
                                   scale_grad_by_freq=by_freq).double()
    oracle_layer.load_state_dict(layer.state_dict())
    expected = oracle_from_samples(oracle_layer, bag_samples(bags, weights))
    actual = run_gsm(layer, (torch.cat(bags),), kwargs, len(lengths), loss_reduction)
    assert_grad_samples_close(actual, expected)


@pytest.mark.parametrize("mode, by_freq", [("sum", False), ("mean", False), ("max", False),
                                           ("sum", True), ("mean", True)])
@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_2d_input_matches_oracle(mode, by_freq, loss_reduction):
    layer = nn.EmbeddingBag(5, 3, mode=mode, padding_idx=4, scale_grad_by_freq=by_freq).double()
    x = torch.tensor([[0, 1, 1], [4, 4, 4], [2, 4, 3], [3, 3, 0], [1, 1, 1]])
    expected = oracle_grad_samples(layer, (x,))
    assert_grad_samples_close(run_gsm(layer, (x,), {}, 5, loss_reduction), expected)


def test_2d_input_with_per_sample_weights_positional():
    layer = nn.EmbeddingBag(5, 3, mode="sum").double()
    x = torch.randint(0, 5, (3, 4))
    w = torch.randn(3, 4, dtype=torch.double)
    expected = oracle_grad_samples(layer, (x, None, w))
    assert_grad_samples_close(run_gsm(layer, (x, None, w), {}, 3, "mean"), expected)


def test_embedding_bag_is_batch_first_even_for_sequence_first_models():
    layer = nn.EmbeddingBag(5, 3).double()
    x = torch.randint(0, 5, (4, 2))
    expected = oracle_grad_samples(layer, (x,))
    actual = gsm_grad_samples(layer, (x,), batch_first=False, batch_size=4)
    assert_grad_samples_close(actual, expected)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")  # Opacus's hooks (the reference)
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_matches_opacus(mode):
    import opacus

    ours = nn.EmbeddingBag(8, 3, mode=mode).double()
    theirs = nn.EmbeddingBag(8, 3, mode=mode).double()
    theirs.load_state_dict(ours.state_dict())
    x = torch.tensor([0, 3, 5, 1, 2, 7, 6, 4])  # no repeated index inside a bag
    offsets = torch.tensor([0, 3, 4, 6])
    actual = run_gsm(ours, (x, offsets), {}, 4, "mean")
    reference = opacus.GradSampleModule(theirs)
    batch_loss(reference(x, offsets), 4, "mean").backward()
    assert_grad_samples_close(actual, {"weight": theirs.weight.grad_sample})


def test_empty_batch_of_bags():
    layer = nn.EmbeddingBag(5, 2)
    gsm = GradSampleModule(layer)
    out = gsm(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    out.sum().backward()
    assert layer.weight.grad_sample.shape == (0, 5, 2)
    gsm.close()


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_offsets_input_in_functorch_mode_uses_the_bag_sampler(mode):
    """The fallback cannot cut bags out of a 1-D input: ``force_functorch`` keeps the bag sampler."""
    layer = nn.EmbeddingBag(6, 3, mode=mode).double()
    bags = [torch.tensor([0, 1, 1]), torch.tensor([5]), torch.tensor([2, 3])]
    kwargs = {"offsets": torch.tensor([0, 3, 4])}
    expected = oracle_from_samples(layer, bag_samples(bags, None))
    actual = gsm_grad_samples(layer, (torch.cat(bags),), kwargs, batch_size=3, force_functorch=True)
    assert_grad_samples_close(actual, expected)
