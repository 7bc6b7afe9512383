"""Under DDP the norms-only modes skip autograd's weight gradients, as on one device: the engine
switches DDP's own synchronisation off, so nothing reads them. A DDP with ``static_graph=True``
keeps its synchronisation, and with it the weight gradients its hooks wait for."""

import warnings

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from opacus_dp import PrivacyEngine
from tests.distributed.spawn import run_on_ranks

pytestmark = pytest.mark.distributed


def weight_grads_of_one_step(rank, world_size):
    """For each DDP setting: whether the wrapper skips, ``p.grad`` after ``backward()`` and the
    parameters after two private steps (σ = 0)."""
    report = {}
    for static in (False, True):
        torch.manual_seed(0)
        model = DistributedDataParallel(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)),
                                        static_graph=static)
        data = TensorDataset(torch.randn(16, 6), torch.randint(0, 3, (16,)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gsm, optimizer, loader = PrivacyEngine().make_private(
                module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                data_loader=DataLoader(data, batch_size=4, sampler=DistributedSampler(data, shuffle=False)), noise_multiplier=0.0, max_grad_norm=0.3,
                grad_sample_mode="bk", poisson_sampling=False)
        grads = []
        for step, (x, y) in enumerate(loader):
            optimizer.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(gsm(x), y).backward()
            grads.append([p.grad is not None for p in model.parameters()])
            optimizer.step()
            if step == 1:
                break
        report[static] = {"skips": gsm.skips_weight_grads, "grads": grads,
                          "final": [p.detach().clone() for p in model.parameters()]}
    return report


@pytest.fixture(scope="module")
def reports():
    return run_on_ranks(weight_grads_of_one_step, 2, timeout=90)


def test_ddp_without_static_graph_forms_no_weight_gradient(reports):
    for report in reports:
        assert report[False]["skips"]
        assert not any(any(step) for step in report[False]["grads"])


def test_static_graph_keeps_its_weight_gradients_and_the_same_update(reports):
    for report in reports:
        assert not report[True]["skips"]
        assert all(all(step) for step in report[True]["grads"])
        for skipped, kept in zip(report[False]["final"], report[True]["final"]):
            torch.testing.assert_close(skipped, kept, rtol=1e-6, atol=1e-7)
    for a, b in zip(reports[0][False]["final"], reports[1][False]["final"]):
        assert torch.equal(a, b)
