"""Half-precision models: clip factors, clipped sums and noise are formed in float32, so one
sample's contribution stays within the clipping bound to float32 rounding (in bfloat16 the
per-sample norms and products alone would leave it up to ~0.5 % above), and ``p.grad`` is cast
to the parameter's dtype only after the noise."""

import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import opacus_dp


def _private(dtype, mode, clipping="flat", sigma=0.0, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)).to(dtype)
    x = (3 * torch.randn(1, 5, 64)).to(dtype)
    y = torch.randint(0, 8, (1,))
    count = len(list(model.parameters()))
    bound = 1.0 if clipping == "flat" else [1.0 / count ** 0.5] * count
    extra = {"criterion": nn.CrossEntropyLoss()} if mode == "ghost" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = opacus_dp.PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=1), noise_multiplier=sigma,
            max_grad_norm=bound, clipping=clipping, grad_sample_mode=mode,
            poisson_sampling=False, **extra)
    criterion = out[2] if len(out) == 4 else nn.CrossEntropyLoss()
    return model, out[0], out[1], criterion, x, y


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["hooks", "ghost", "bk"])
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_one_samples_clipped_contribution_stays_within_the_bound(dtype, mode, clipping):
    worst = 0.0
    for seed in range(8):
        _, model, optimizer, criterion, x, y = _private(dtype, mode, clipping, seed=seed)
        optimizer.zero_grad()
        criterion(model(x).float().mean(dim=1), y).backward()
        optimizer.clip_and_accumulate()
        sums = list(optimizer.logical_batch.sums.values())
        assert sums and all(s.dtype == torch.float32 for s in sums)
        worst = max(worst, torch.sqrt(sum(s.double().pow(2).sum() for s in sums)).item())
        optimizer.logical_batch.drop()
    assert 0.9 < worst <= 1.0 + 1e-6  # the gradients are large: clipping is active


def test_noise_is_added_in_float32_and_the_gradient_cast_afterwards():
    module, model, optimizer, criterion, x, y = _private(torch.bfloat16, "bk", sigma=1.0)
    seen = []
    add_noise = optimizer.add_noise
    optimizer.add_noise = lambda sums: seen.extend(s.dtype for s in sums) or add_noise(sums)
    optimizer.zero_grad()
    criterion(model(x).float().mean(dim=1), y).backward()
    optimizer.step()
    assert seen and set(seen) == {torch.float32}
    assert all(p.grad.dtype == torch.bfloat16 for p in module.parameters())


class SharedUnderAutocast(nn.Module):
    """A float32 model run under bfloat16 autocast, one Linear called twice (as a recurrent
    layer's hidden projection): the first call rounds a float32 input, the second a bf16 one."""

    def __init__(self):
        super().__init__()
        self.shared, self.head = nn.Linear(64, 64), nn.Linear(64, 8)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.head(torch.tanh(self.shared(torch.tanh(self.shared(x))))).float().mean(dim=1)


@pytest.mark.parametrize("mode", ["hooks", "ghost", "bk", "auto"])
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_autocast_with_a_layer_called_twice_stays_within_the_bound(mode, clipping):
    """Norms and clipped sums both use the inputs as autocast rounded them (the merged calls'
    norms used the rounded inputs, the sums the float32 ones: 1.00025 × C)."""
    worst = 0.0
    for seed in range(6):
        torch.manual_seed(seed)
        model, x, y = SharedUnderAutocast(), 3 * torch.randn(1, 5, 64), torch.randint(0, 8, (1,))
        count = len(list(model.parameters()))
        bound = 1e-3 if clipping == "flat" else [1e-3 / count ** 0.5] * count
        extra = {"criterion": nn.CrossEntropyLoss()} if mode == "ghost" else {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = opacus_dp.PrivacyEngine().make_private(
                module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                data_loader=DataLoader(TensorDataset(x, y), batch_size=1), noise_multiplier=0.0,
                max_grad_norm=bound, clipping=clipping, grad_sample_mode=mode, poisson_sampling=False, **extra)
        criterion = out[2] if len(out) == 4 else nn.CrossEntropyLoss()
        criterion(out[0](x), y).backward()
        out[1].clip_and_accumulate()
        worst = max(worst, torch.sqrt(sum(s.double().pow(2).sum() for s in out[1].logical_batch.sums.values())).item())
    assert 0.9e-3 < worst <= 1e-3 * (1.0 + 1e-6)
