"""The norms-only modes inside DP-SGD: PrivacyEngine (both APIs), DPOptimizer, BatchMemoryManager.

With σ = 0 one private step must equal the hand-clipped mean of the oracle's per-sample
gradients (batch-size-1 autograd), for flat and per-layer clipping; the same code path with
σ > 0 must add noise of std σ·C / B.
"""

import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp import PrivacyEngine
from opacus_dp.data import BatchMemoryManager
from opacus_dp.grad_sample import BookkeepingGradSampleModule
from opacus_dp.grad_sample.bookkeeping.ghost_criterion import GhostCriterion
from tests.engine.helpers import clipped_sum_oracle

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
N, T, FEATURES, CLASSES = 16, 3, 4, 2
LR = 1.0


class TinySequenceModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(FEATURES, 5)
        self.ln = nn.LayerNorm(5)
        self.head = nn.Linear(5, CLASSES)

    def forward(self, x):
        return self.head(self.ln(torch.tanh(self.fc(x))).mean(dim=1))


def model_and_data(seed=0):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(N, T, FEATURES, generator=g, dtype=torch.float64) * 3
    y = torch.randint(0, CLASSES, (N,), generator=g)
    return TinySequenceModel().double(), TensorDataset(x, y)


def oracle_step(model, x, y, bounds, per_layer, divisor):
    """Parameters after one σ = 0 DP-SGD step of plain SGD on the logical batch (x, y)."""
    params = [p for p in model.parameters()]
    rows = []
    for i in range(len(x)):
        loss = nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1], reduction="sum")
        rows.append(torch.autograd.grad(loss, params))
    grads = [torch.stack([r[j] for r in rows]) for j in range(len(params))]
    assert max(g.reshape(len(g), -1).norm(dim=1).max() for g in grads) > min(
        bounds if per_layer else [bounds]), "clipping must be active"
    sums = clipped_sum_oracle(grads, bounds, per_layer)
    return [p.detach() - LR * s / divisor for p, s in zip(params, sums)]


def quiet_engine(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PrivacyEngine(*args, **kwargs)


@pytest.mark.parametrize("mode", ["bk", "ghost", "auto"])
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_one_logical_step_with_batch_memory_manager_equals_the_oracle(mode, clipping):
    model, data = model_and_data()
    start = TinySequenceModel().double()
    start.load_state_dict(model.state_dict())
    bounds = 0.5 if clipping == "flat" else [0.3] * 6
    engine = quiet_engine(accountant="rdp")
    torch.manual_seed(3)
    result = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        data_loader=DataLoader(data, batch_size=8), noise_multiplier=0.0, max_grad_norm=bounds,
        clipping=clipping, grad_sample_mode=mode)
    gsm, optimizer, loader = result[0], result[1], result[-1]
    assert isinstance(gsm, BookkeepingGradSampleModule) and len(result) == (4 if mode == "ghost" else 3)
    criterion = result[2] if mode == "ghost" else nn.CrossEntropyLoss()
    seen = []
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=3, optimizer=optimizer) as physical:
        for x, y in physical:
            seen.append((x, y))
            criterion(gsm(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            if len(engine.accountant) == 1:
                break
    assert len(seen) > 1, "the logical batch must span several physical batches"
    x, y = torch.cat([s[0] for s in seen]), torch.cat([s[1] for s in seen])
    expected = oracle_step(start, x, y, bounds, clipping == "per_layer", optimizer.expected_batch_size)
    for got, want in zip(model.parameters(), expected):
        torch.testing.assert_close(got.detach(), want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_classic_api_virtual_steps_in_bk_mode(clipping):
    model, data = model_and_data(seed=5)
    start = TinySequenceModel().double()
    start.load_state_dict(model.state_dict())
    x, y = data.tensors
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine = quiet_engine(model, batch_size=8, sample_size=N, noise_multiplier=0.0,
                          max_grad_norm=0.4, clip_per_layer=clipping == "per_layer",
                          grad_sample_mode="bk")
    engine.attach(optimizer)
    assert isinstance(engine.grad_sample_module, BookkeepingGradSampleModule)
    for part, rows in enumerate((slice(0, 5), slice(5, 8))):
        nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        optimizer.virtual_step() if part == 0 else optimizer.step()
        optimizer.zero_grad()
    bounds = 0.4 if clipping == "flat" else [0.4] * 6
    expected = oracle_step(start, x[:8], y[:8], bounds, clipping == "per_layer", 8)
    for got, want in zip(model.parameters(), expected):
        torch.testing.assert_close(got.detach(), want, rtol=1e-9, atol=1e-12)
    engine.detach()
    assert all(p.requires_grad for p in model.parameters())


def test_noise_std_is_sigma_c_over_b_in_bk_mode():
    torch.manual_seed(0)
    model = nn.Linear(200, 10)
    engine = quiet_engine(accountant="rdp")
    loader = DataLoader(TensorDataset(torch.randn(40, 200), torch.zeros(40, 10)), batch_size=20)
    gsm, optimizer, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), data_loader=loader,
        noise_multiplier=2.0, max_grad_norm=1.5, poisson_sampling=False, grad_sample_mode="bk",
        noise_generator=torch.Generator().manual_seed(11))
    x = torch.zeros(20, 200)  # zero input and zero targets: the loss gradient is exactly 0
    nn.functional.mse_loss(gsm(x) * 0, torch.zeros(20, 10)).backward()
    before = model.weight.detach().clone()
    optimizer.step()
    noise = (before - model.weight.detach()).flatten()
    expected = 2.0 * 1.5 / 20
    assert abs(noise.std().item() / expected - 1) < 0.05  # 2000 draws: 5% is > 3 std errors


def test_ghost_criterion_per_sequence_token_mean():
    torch.manual_seed(0)
    logits, target = torch.randn(3, 4, 5), torch.randint(0, 5, (3, 4))
    target[0, :2] = -100
    criterion = GhostCriterion(nn.CrossEntropyLoss(ignore_index=-100))
    per_token = nn.functional.cross_entropy(logits.reshape(12, 5), target.reshape(12),
                                            reduction="none").view(3, 4)
    valid = (target != -100).sum(dim=1)
    expected = (per_token.sum(dim=1) / valid).mean()
    torch.testing.assert_close(criterion(logits.reshape(12, 5), target.reshape(12), shape=(3, 4, 5)),
                               expected)
    torch.testing.assert_close(criterion(logits.reshape(12, 5), target.reshape(12)),
                               nn.functional.cross_entropy(logits.reshape(12, 5), target.reshape(12),
                                                           ignore_index=-100))
    with pytest.raises(ValueError, match="reduction"):
        GhostCriterion(nn.CrossEntropyLoss(reduction="sum"), "mean")


def test_wrap_module_refuses_a_wrapper_of_the_other_kind():
    model, data = model_and_data()
    engine = quiet_engine(accountant="rdp")
    gsm = BookkeepingGradSampleModule(model)
    with pytest.raises(ValueError, match="grad_sample_mode='hooks'"):
        engine.make_private(module=gsm, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                            data_loader=DataLoader(data, batch_size=8), noise_multiplier=0.0,
                            max_grad_norm=1.0, grad_sample_mode="hooks")
