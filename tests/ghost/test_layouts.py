"""Sequence-first models (``batch_first=False``) with layers whose inputs torch always takes
batch first (convolutions, GroupNorm, InstanceNorm, recurrent cells): every mode's private
step against the float64 per-sample oracle. The batch equals the channel count, so a layer
read along the wrong dimension would run without a shape error."""

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp import PrivacyEngine
from tests.engine.helpers import median_clipped_mean
from tests.ghost.helpers import private_update
from tests.grad_sample.oracle import default_loss, oracle_grad_samples, trainable

BATCH = WIDTH = 4
STEPS = 5


class SequenceFirst(nn.Module):
    """Input ``(T, B, WIDTH)``: a Linear on the sequence-first layout, then ``layer`` on the
    batch-first ``(B, WIDTH, T)`` torch requires (a cell runs over the positions)."""

    def __init__(self, layer):
        super().__init__()
        self.proj, self.layer = nn.Linear(WIDTH, WIDTH), layer

    def forward(self, x):
        h = self.proj(x)
        if isinstance(self.layer, nn.RNNCellBase):
            state = None
            for t in range(h.shape[0]):
                state = self.layer(h[t], state)
            return state
        return self.layer(h.permute(1, 2, 0))


LAYERS = {
    "conv1d": lambda: nn.Conv1d(WIDTH, WIDTH, 3),
    "conv1d_groups": lambda: nn.Conv1d(WIDTH, WIDTH, 2, groups=2),
    "group_norm": lambda: nn.GroupNorm(2, WIDTH),
    "instance_norm": lambda: nn.InstanceNorm1d(WIDTH, affine=True),
    "gru_cell": lambda: nn.GRUCell(WIDTH, WIDTH),
}


def sequence_first_loader(x):
    """Batches of ``(T, B, WIDTH)`` from samples ``(T, WIDTH)``."""
    collate = lambda rows: [torch.stack([r[0] for r in rows], dim=1)]  # noqa: E731
    return DataLoader(TensorDataset(x), batch_size=BATCH, collate_fn=collate)


@pytest.mark.parametrize("mode", ["hooks", "functorch", "bk", "ghost", "auto"])
@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_batch_first_layers_in_a_sequence_first_model_equal_the_oracle(layer, mode):
    torch.manual_seed(0)
    model = SequenceFirst(LAYERS[layer]()).double()  # float64: the norms cancel most of proj's gradient
    x = torch.randn(BATCH, STEPS, WIDTH, dtype=torch.float64) * 2
    m64 = copy.deepcopy(model)
    grads = oracle_grad_samples(m64, (x.transpose(0, 1),), batch_dim=1)
    names = [n for n, _ in trainable(m64)]
    rows = [grads[n] for n in names]
    bound, expected = median_clipped_mean(rows, BATCH)
    updates = private_update(model, sequence_first_loader(x), mode, bound, BATCH, batch_first=False)
    scale = max(e.abs().max().item() for e in expected)  # a norm after proj zeroes proj.bias's gradient
    for name, u, e in zip(names, updates, expected):
        torch.testing.assert_close(u, e, rtol=1e-9, atol=1e-9 * scale, msg=lambda m: f"update of {name}: {m}")


class SequenceFirstHead(nn.Module):
    """``(T, B, WIDTH)`` → Linear → mean over positions → LayerNorm and a Linear head on the
    2-D ``(B, WIDTH)`` summary: a feature-last layer's 2-D input has the batch on dim 0 in a
    sequence-first model too (B = WIDTH: reading dim 1 raised no shape error)."""

    def __init__(self):
        super().__init__()
        self.proj, self.norm, self.head = nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.head(self.norm(torch.tanh(self.proj(x)).mean(dim=0)))


@pytest.mark.parametrize("mode", ["hooks", "functorch", "bk", "ghost", "auto"])
def test_two_dimensional_head_of_a_sequence_first_model_equals_the_oracle(mode):
    torch.manual_seed(1)
    model = SequenceFirstHead().double()
    x = torch.randn(BATCH, STEPS, WIDTH, dtype=torch.float64)
    grads = oracle_grad_samples(copy.deepcopy(model), (x.transpose(0, 1),), batch_dim=1)
    names = [n for n, _ in trainable(model)]
    rows = [grads[n] for n in names]
    bound, expected = median_clipped_mean(rows, BATCH)
    updates = private_update(model, sequence_first_loader(x), mode, bound, BATCH, batch_first=False)
    for name, u, e in zip(names, updates, expected):
        torch.testing.assert_close(u, e, rtol=1e-9, atol=1e-12, msg=lambda m: f"update of {name}: {m}")


class SequenceFirstWithId(nn.Module):
    """``(T, B, WIDTH)`` inputs plus a per-example id ``(B,)``: the id's Embedding has a 2-D
    ``(B, WIDTH)`` output, batch on dim 0 (WIDTH = B: reading dim 1 mixed the examples)."""

    def __init__(self):
        super().__init__()
        self.proj, self.ids = nn.Linear(WIDTH, WIDTH), nn.Embedding(6, WIDTH)
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x, ids):
        return self.head(torch.tanh(self.proj(x)).mean(dim=0) + self.ids(ids))


@pytest.mark.parametrize("mode", ["hooks", "functorch", "bk", "ghost", "auto"])
def test_embedding_of_a_per_example_id_in_a_sequence_first_model_equals_the_oracle(mode):
    torch.manual_seed(2)
    model = SequenceFirstWithId().double()
    x = torch.randn(BATCH, STEPS, WIDTH, dtype=torch.float64)
    ids = torch.tensor([0, 3, 5, 3])
    m64 = copy.deepcopy(model)
    names = [n for n, _ in trainable(model)]
    per_sample = []
    for i in range(BATCH):  # one example at a time: (T, 1, WIDTH) and its id
        grads = torch.autograd.grad(default_loss(m64(x[i:i + 1].transpose(0, 1), ids[i:i + 1])),
                                    [p for _, p in trainable(m64)])
        per_sample.append(grads)
    rows = [torch.stack([g[k] for g in per_sample]) for k in range(len(names))]
    bound, expected = median_clipped_mean(rows, BATCH)
    collate = lambda items: (torch.stack([i[0] for i in items], dim=1), torch.stack([i[1] for i in items]))  # noqa: E731
    loader = DataLoader(TensorDataset(x, ids), batch_size=BATCH, collate_fn=collate)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = PrivacyEngine(accountant="rdp").make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), data_loader=loader,
            noise_multiplier=0.0, max_grad_norm=bound, batch_first=False, poisson_sampling=False,
            grad_sample_mode=mode, criterion=lambda out, *_: default_loss(out) / BATCH)
    gsm, optimizer, loader = result[0], result[1], result[-1]
    criterion = result[2] if mode == "ghost" else (lambda out: default_loss(out) / BATCH)
    before = [p.detach().clone() for p in model.parameters()]
    xb, idb = next(iter(loader))
    criterion(gsm(xb, idb)).backward()
    optimizer.step()
    for name, b, p, e in zip(names, before, model.parameters(), expected):
        torch.testing.assert_close(b - p.detach(), e, rtol=1e-9, atol=1e-12,
                                   msg=lambda m: f"update of {name}: {m}")
