"""Autocast without a scaler, in every mode: bfloat16 (float32's range, no scaler needed) and
float16 (where nothing overflows) match the float32 oracle to their rounding, and no sample's
clipped contribution exceeds the bound; bfloat16 parameters keep float32 norms, sums and noise."""

import pytest
import torch

from tests.precision.helpers import (MODES, clipped_sum, mlp, per_sample_grads, private, relative_error,
                                     squared_error)

pytestmark = pytest.mark.filterwarnings("ignore:secure_mode")

# relative to each tensor's largest entry: ~8 units of the autocast dtype (u: bf16 2⁻⁸, fp16 2⁻¹¹);
# measured at most 2 (7e-3 and 1e-3)
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 4e-3}


def _data(n=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def _autocast_backward(module, criterion, x, y, dtype):
    with torch.autocast("cpu", dtype=dtype):
        out = module(x)
    loss = criterion(out.float(), y) if criterion is not None else squared_error(out, y)
    loss.backward()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("clipping,c", [("flat", 0.5), ("flat", 50.0), ("per_layer", 0.5)])
def test_matches_the_float32_oracle(dtype, mode, clipping, c):
    x, y = _data()
    _, module, optimizer, criterion = private(mlp(), x, y, mode=mode, clipping=clipping, c=c)
    _autocast_backward(module, criterion, x, y, dtype)
    optimizer.step()
    want = clipped_sum(per_sample_grads(mlp(), x, y), clipping, c)
    assert relative_error([p.grad for p in optimizer.params], want) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", MODES)
def test_no_sample_contributes_more_than_the_bound(dtype, mode):
    worst = 0.0
    for seed in range(5):
        x, y = 3 * torch.randn(1, 8), 5 * torch.randn(1, 4)
        _, module, optimizer, criterion = private(mlp(seed), x, y, mode=mode, c=1e-2)
        _autocast_backward(module, criterion, x, y, dtype)
        optimizer.step()
        worst = max(worst, float(torch.sqrt(sum(p.grad.double().pow(2).sum() for p in optimizer.params))))
    assert 0.9e-2 < worst <= 1e-2 * (1 + 1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_bfloat16_parameters_keep_float32_norms_sums_and_noise(mode):
    x, y = _data()
    _, module, optimizer, criterion = private(mlp(dtype=torch.bfloat16), x.bfloat16(), y, mode=mode,
                                              c=0.5, sigma=1.0, seed=0)
    seen = []
    add_noise = optimizer.add_noise
    optimizer.add_noise = lambda sums: seen.extend(s.dtype for s in sums) or add_noise(sums)
    out = module(x.bfloat16())
    (criterion(out.float(), y) if criterion is not None else squared_error(out, y)).backward()
    optimizer.step()
    assert seen and set(seen) == {torch.float32}
    assert all(p.grad.dtype == torch.bfloat16 for p in optimizer.params)
