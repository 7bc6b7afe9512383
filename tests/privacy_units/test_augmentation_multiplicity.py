"""``augmentation_multiplicity=K``: every sampled example is K rows (K independent augmentations
by the dataset's random transform), their gradients averaged before clipping, accounted as one
example (De et al. 2022).

Oracle: the K rows of each example as delivered (captured from the batch), per-row gradients
from an autograd loop, their mean clipped to C, summed, divided by ⌊q·N⌋."""

import copy

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

from opacus_dp import PrivacyEngine
from opacus_dp.data.loader_facts import expected_batch_size_for
from tests.distributed.oracle import sgd_step
from tests.privacy_units.oracle import unit_update

N, K, LR, C = 20, 4, 0.5, 0.05


class Jittered(Dataset):
    """Each read adds fresh noise (a random augmentation) to a fixed example."""

    def __init__(self):
        g = torch.Generator().manual_seed(5)
        self.x, self.y = torch.randn(N, 6, generator=g) * 3, torch.randint(0, 3, (N,), generator=g)

    def __len__(self):
        return N

    def __getitem__(self, i):
        return self.x[i] + 0.5 * torch.randn(6), self.y[i]


def _run(mode, steps=3):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    reference = copy.deepcopy(model)
    engine = PrivacyEngine()
    out = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                              data_loader=DataLoader(Jittered(), batch_size=5), noise_multiplier=0.0,
                              max_grad_norm=C, grad_sample_mode=mode, augmentation_multiplicity=K)
    return engine, out, reference


@pytest.mark.parametrize("mode", ["hooks", "ghost", "bk", "functorch"])
def test_update_is_clipped_mean_of_augmentations(mode):
    engine, out, reference = _run(mode)
    private, optimizer, loader = out[0], out[1], out[-1]
    criterion = out[2] if mode == "ghost" else nn.CrossEntropyLoss()
    divisor = expected_batch_size_for(N, loader.sample_rate)
    distinct = 0
    for step, (x, y) in enumerate(loader):
        sizes = loader.unit_channel.latest().sizes()
        assert sizes == [K] * (x.shape[0] // K) and x.shape[0] % K == 0
        if x.shape[0]:
            distinct += int(not torch.allclose(x[0], x[1]))  # the K rows are different augmentations
            assert torch.equal(y.view(-1, K), y.view(-1, K)[:, :1].expand(-1, K))  # of one example
        criterion(private(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        sgd_step(reference, unit_update(reference, nn.functional.cross_entropy, x, y, sizes, C, divisor), LR)
        for p, q in zip(private.parameters(), reference.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
        if step == 2:
            break
    assert distinct > 0


def test_accounted_as_examples():
    """The history is that of the example-level run over the same loader: (σ, q = 1/len, steps)."""
    engine, out, _ = _run("hooks")
    optimizer, loader = out[1], out[-1]
    plain = PrivacyEngine()
    model = nn.Linear(6, 3)
    plain_out = plain.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                   data_loader=DataLoader(Jittered(), batch_size=5), noise_multiplier=0.0,
                                   max_grad_norm=C)
    assert loader.sample_rate == plain_out[-1].sample_rate == 1 / 4 and len(loader) == len(plain_out[-1])
    for x, y in loader:
        nn.functional.cross_entropy(out[0](x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert engine.accountant.history == [(0.0, 0.25, len(loader))]
    assert engine.accountant.privacy_unit == "example"
