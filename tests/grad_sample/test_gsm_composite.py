"""A small composite model: GradSampleModule against the oracle and against Opacus 1.6."""

import pytest
import torch
import torch.nn as nn

from tests.grad_sample.oracle import (
    assert_grad_samples_close,
    batch_loss,
    gsm_grad_samples,
    oracle_grad_samples,
)


class TextClassifier(nn.Module):
    def __init__(self, inplace=False):
        super().__init__()
        self.embed = nn.Embedding(11, 4)
        self.tags = nn.EmbeddingBag(6, 4, mode="mean")
        self.conv = nn.Conv1d(4, 3, 3, padding=1)
        self.act = nn.ReLU(inplace=inplace)
        self.head = nn.Linear(3, 2)

    def forward(self, tokens, tags):
        x = self.embed(tokens).transpose(1, 2) + self.tags(tags).unsqueeze(-1)
        return self.head(self.act(self.conv(x)).mean(-1))


def inputs(batch=5):
    return torch.randint(0, 11, (batch, 6)), torch.randint(0, 6, (batch, 3))


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_composite_with_inplace_activation_matches_oracle(loss_reduction):
    model = TextClassifier(inplace=True).double()
    args = inputs()
    expected = oracle_grad_samples(model, args)
    assert_grad_samples_close(gsm_grad_samples(model, args, loss_reduction=loss_reduction), expected)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")  # Opacus's hooks (the reference)
@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_composite_matches_opacus(loss_reduction):
    import opacus

    ours = TextClassifier().double()
    theirs = TextClassifier().double()
    theirs.load_state_dict(ours.state_dict())
    tokens, _ = inputs()
    # Opacus's EmbeddingBag sampler needs 1-D input + offsets and drops repeated indices
    # inside a bag, so the bags here hold distinct tags.
    tags = torch.stack([torch.randperm(6)[:3] for _ in range(5)])
    offsets = torch.arange(0, tags.numel(), tags.shape[1])
    actual = gsm_grad_samples(ours, (tokens, tags), loss_reduction=loss_reduction)
    reference = opacus.GradSampleModule(_Flat(theirs), loss_reduction=loss_reduction)
    batch_loss(reference(tokens, tags.reshape(-1), offsets), 5, loss_reduction).backward()
    expected = {n: p.grad_sample for n, p in theirs.named_parameters()}
    assert_grad_samples_close(actual, expected)


class _Flat(nn.Module):
    """The same classifier, called with its tags as 1-D input plus offsets."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens, flat_tags, offsets):
        m = self.model
        x = m.embed(tokens).transpose(1, 2) + m.tags(flat_tags, offsets).unsqueeze(-1)
        return m.head(m.act(m.conv(x)).mean(-1))
