"""GradSampleModule: repeated calls, tied weights, several passes, batch dimension checks."""

import pytest
import torch
import torch.nn as nn

from opacus_dp.grad_sample import GradSampleModule

from tests.grad_sample.oracle import (
    assert_grad_samples_close,
    batch_loss,
    gsm_grad_samples,
    oracle_grad_samples,
)


class TiedLanguageModel(nn.Module):
    """Input embedding and output projection share one Parameter."""

    def __init__(self, vocab=7, dim=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.hidden = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens):
        return self.out(torch.tanh(self.hidden(self.embed(tokens))))


class Recurrent(nn.Module):
    """One Linear cell applied at every time step (a layer called several times per forward)."""

    def __init__(self, dim=3):
        super().__init__()
        self.cell = nn.Linear(2 * dim, dim)

    def forward(self, x):  # x: (B, T, dim)
        h = torch.zeros_like(x[:, 0])
        for t in range(x.shape[1]):
            h = torch.tanh(self.cell(torch.cat([x[:, t], h], dim=-1)))
        return h


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_tied_weights_sum_both_uses(loss_reduction):
    model = TiedLanguageModel().double()
    tokens = torch.randint(0, 7, (4, 5))
    expected = oracle_grad_samples(model, (tokens,))
    assert_grad_samples_close(gsm_grad_samples(model, (tokens,), loss_reduction=loss_reduction), expected)


@pytest.mark.parametrize("force_functorch", [False, True])
def test_layer_called_in_a_loop_sums_per_call_gradients(force_functorch):
    model = Recurrent().double()
    x = torch.randn(3, 4, 3, dtype=torch.double)
    expected = oracle_grad_samples(model, (x,))
    assert_grad_samples_close(gsm_grad_samples(model, (x,), force_functorch=force_functorch), expected)


class Pair(nn.Module):
    """Applies the same model to two inputs in one forward (a siamese pair per sample)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, a, b):
        return self.model(a), self.model(b)


def test_two_forwards_one_backward_are_summed_per_sample():
    model = nn.Sequential(nn.Linear(3, 2), nn.Tanh(), nn.Linear(2, 2)).double()
    a, b = torch.randn(4, 3, dtype=torch.double), torch.randn(4, 3, dtype=torch.double)
    expected = oracle_grad_samples(Pair(model), (a, b))
    gsm = GradSampleModule(model)
    batch_loss((gsm(a), gsm(b)), 4, "mean").backward()
    actual = {"model." + n: p.grad_sample for n, p in gsm.trainable_parameters()}
    gsm.close()
    assert_grad_samples_close(actual, expected)


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_separate_backward_passes_concatenate_batches(loss_reduction):
    model = nn.Sequential(nn.Embedding(6, 3), nn.Linear(3, 2)).double()
    first, second = torch.randint(0, 6, (3, 2)), torch.randint(0, 6, (2, 2))
    expected = oracle_grad_samples(model, (torch.cat([first, second]),))
    gsm = GradSampleModule(model, loss_reduction=loss_reduction)
    for tokens in (first, second):
        batch_loss(gsm(tokens), tokens.shape[0], loss_reduction).backward()
    actual = {n: p.grad_sample for n, p in gsm.trainable_parameters()}
    gsm.close()
    assert_grad_samples_close(actual, expected)


def test_forbidden_accumulation_raises_on_second_pass():
    gsm = GradSampleModule(nn.Linear(2, 2))
    gsm.forbid_grad_accumulation()
    gsm(torch.randn(3, 2)).sum().backward()
    with pytest.raises(ValueError, match="second batch"):
        gsm(torch.randn(3, 2)).sum().backward()
    gsm.zero_grad()
    gsm(torch.randn(3, 2)).sum().backward()
    assert gsm.weight.grad_sample.shape == (3, 2, 2)
    gsm.close()


class SequenceFirstCell(nn.Linear):
    """A cell that always receives (B, features), like the DP RNN cells."""

    _dp_batch_dim = 0


class SequenceFirstModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(9, 3)
        self.mix = nn.Linear(3, 3)
        self.cell = SequenceFirstCell(3, 3)

    def forward(self, tokens):  # tokens: (T, B)
        x = self.mix(self.embed(tokens))
        h = 0
        for t in range(x.shape[0]):
            h = torch.tanh(self.cell(x[t]) + h)
        return h


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_sequence_first_model_with_batch_first_cells(loss_reduction):
    model = SequenceFirstModel().double()
    tokens = torch.randint(0, 9, (4, 3))
    expected = oracle_grad_samples(model, (tokens,), batch_dim=1)
    actual = gsm_grad_samples(model, (tokens,), loss_reduction=loss_reduction, batch_first=False)
    assert_grad_samples_close(actual, expected)


def test_wrong_batch_dimension_is_reported():
    gsm = GradSampleModule(SequenceFirstModel(), batch_first=True)
    with pytest.raises(ValueError) as error:
        gsm(torch.randint(0, 9, (4, 3))).sum().backward()
    message = str(error.value)
    assert "cell (SequenceFirstCell)" in message and "mix (Linear)" in message
    assert "batch_first=True" in message and "3" in message and "4" in message
    gsm.close()


def test_missing_batch_dimension_is_reported():
    gsm = GradSampleModule(nn.Linear(3, 2), batch_first=False)
    with pytest.raises(ValueError, match=r"<root module> \(Linear\).*shape \(2,\)"):
        gsm(torch.randn(3))
    gsm.close()


def test_per_call_sums_never_write_into_a_samplers_result():
    """Calls of one layer are summed in place only into a tensor the store allocated: the first
    call's per-sample gradient (which a sampler may share with others) is left as it was."""
    from opacus_dp.grad_sample.per_sample_store import PerSampleGradStore

    store = PerSampleGradStore(batch_first=True, loss_reduction="sum")
    param = nn.Parameter(torch.zeros(2))
    calls = [torch.randn(3, 2, dtype=torch.double) for _ in range(4)]
    kept = [c.clone() for c in calls]
    x = torch.ones(1, requires_grad=True)

    def add_all(_):
        for c in calls:
            store.add(param, c, "cell")

    x.register_hook(add_all)
    (x * 2).sum().backward()
    assert all(torch.equal(c, k) for c, k in zip(calls, kept))
    torch.testing.assert_close(param.grad_sample, sum(kept), rtol=0, atol=1e-12)
