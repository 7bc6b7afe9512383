"""The ``ghost`` mode's two-pass backward (norms pass, then sums pass) against the oracle."""

import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp import PrivacyEngine
from opacus_dp.grad_sample.bookkeeping.ghost_criterion import GhostLoss
from opacus_dp.layers import DPLSTM
from tests.engine.helpers import clipped_sum_oracle

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Recurrent(nn.Module):
    """Embedding, a DPLSTM (its recurrent projection is called once per step) and a head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.lstm = DPLSTM(4, 8, batch_first=True)  # hh: 8 -> 32 over 5 steps, ghost
        self.head = nn.Linear(8, 3)

    def forward(self, tokens):
        out, _ = self.lstm(self.emb(tokens))
        return self.head(out[:, -1])


def private(model, clipping, bound):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(accountant="rdp")
    data = TensorDataset(torch.randint(0, 7, (6, 4)), torch.randint(0, 3, (6,)))
    return engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                               data_loader=DataLoader(data, batch_size=6), noise_multiplier=0.0,
                               max_grad_norm=bound, clipping=clipping, poisson_sampling=False,
                               grad_sample_mode="ghost")


def oracle_sums(model, tokens, target, bound, per_layer):
    params = list(model.parameters())
    rows = [torch.autograd.grad(nn.functional.cross_entropy(model(tokens[i:i + 1]), target[i:i + 1],
                                                            reduction="sum"), params)
            for i in range(len(tokens))]
    grads = [torch.stack([r[j] for r in rows]) for j in range(len(params))]
    return clipped_sum_oracle(grads, bound, per_layer)


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_two_pass_backward_equals_the_oracle_and_stores_no_output_gradients(clipping):
    torch.manual_seed(0)
    model = Recurrent().double()
    tokens, target = torch.randint(0, 7, (6, 5)), torch.randint(0, 3, (6,))
    bound = 0.2 if clipping == "flat" else [0.1] * len(list(model.parameters()))
    expected = oracle_sums(model, tokens, target, bound, clipping == "per_layer")
    gsm, optimizer, criterion, _ = private(model, clipping, bound)
    loss = criterion(gsm(tokens), target) * 1.0 + 0.0
    assert isinstance(loss, GhostLoss)
    loss.backward()
    (resolved,) = gsm._bookkeeper._resolved
    assert resolved.ghost_calls == [] and resolved.sums, "ghost layers' sums were streamed"
    assert resolved.modes["lstm.l0.hh (BatchFirstLinear)"] == "ghost"
    assert all(p.grad is None for p in model.parameters())
    params = optimizer.params
    sums = gsm.clipped_sums(params, optimizer.clipper.clip_factors(gsm.per_sample_norms(params)))
    for got, want in zip(sums, expected):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_changing_the_clipping_bound_between_backward_and_step_is_refused():
    torch.manual_seed(0)
    model = Recurrent().double()
    gsm, optimizer, criterion, _ = private(model, "flat", 0.2)
    criterion(gsm(torch.randint(0, 7, (6, 5))), torch.randint(0, 3, (6,))).backward()
    optimizer.max_grad_norm = 0.1
    with pytest.raises(RuntimeError, match="clip factors changed"):
        optimizer.step()


def test_plain_tensor_backward_in_ghost_mode_is_one_bookkeeping_pass():
    torch.manual_seed(0)
    model = Recurrent().double()
    tokens, target = torch.randint(0, 7, (6, 5)), torch.randint(0, 3, (6,))
    expected = oracle_sums(model, tokens, target, 0.2, False)
    gsm, optimizer, criterion, _ = private(model, "flat", 0.2)
    criterion(gsm(tokens), target).value.backward()
    params = optimizer.params
    sums = gsm.clipped_sums(params, optimizer.clipper.clip_factors(gsm.per_sample_norms(params)))
    for got, want in zip(sums, expected):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_empty_batch_step_in_ghost_mode_adds_only_noise():
    torch.manual_seed(0)
    model = Recurrent().double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(accountant="rdp")
    data = TensorDataset(torch.randint(0, 7, (6, 4)), torch.randint(0, 3, (6,)))
    gsm, optimizer, criterion, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(data, batch_size=6), noise_multiplier=0.0, max_grad_norm=1.0,
        poisson_sampling=False, grad_sample_mode="ghost", loss_reduction="sum",
        criterion=nn.CrossEntropyLoss(reduction="sum"))
    before = [p.detach().clone() for p in model.parameters()]
    criterion(gsm(torch.zeros(0, 4, dtype=torch.long)), torch.zeros(0, dtype=torch.long)).backward()
    optimizer.step()
    assert len(engine.accountant) == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


class _DonatingBackward(torch.autograd.Function):
    """Identity whose backward fails as a ``torch.compile``d backward with donated buffers
    does under ``retain_graph=True`` (the message torch raises there)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("This backward function was compiled with non-empty donated buffers "
                           "which requires create_graph=False and retain_graph=False.")


class Donating(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(7, 4), nn.Linear(4, 3)

    def forward(self, tokens):
        return self.head(_DonatingBackward.apply(self.emb(tokens)).mean(1))


def test_a_backward_that_cannot_keep_its_graph_names_the_way_out():
    """The two passes need ``retain_graph=True``; a compiled backward that refuses it gets an
    error naming ``grad_sample_mode='bk'`` (and nothing is updated)."""
    torch.manual_seed(0)
    model = Donating()
    before = [p.detach().clone() for p in model.parameters()]
    module, optimizer, criterion, loader = private(model, "flat", 1.0)
    tokens, target = next(iter(loader))
    with pytest.raises(RuntimeError, match="grad_sample_mode='bk'"):
        criterion(module(tokens), target).backward()
    assert all(torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))
