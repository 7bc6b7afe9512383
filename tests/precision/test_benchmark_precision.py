"""``scripts/benchmark.py --precision``: the private and the non-private variants run their
forward pass in the same precision (autocast), float16 with a GradScaler."""

import pytest
import torch
import torch.nn as nn

from tests.script_loading import load_script

pytestmark = [pytest.mark.filterwarnings("ignore:GradScaler is going to stop"),
              pytest.mark.filterwarnings("ignore:secure_mode")]


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmark.py", "benchmark_precision_under_test")


def _workload(seen):
    from benchmark_models import Workload

    def build(layers=None):
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        model[2].register_forward_hook(lambda module, args, out: seen.append(out.dtype))
        return model

    def batch():
        g = torch.Generator().manual_seed(0)
        return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)

    return Workload("tiny", build, batch, "test model")


@pytest.mark.parametrize("precision,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16),
                                             ("fp16", torch.float16)])
@pytest.mark.parametrize("variant", ["non-private", "hooks", "ghost", "bk"])
def test_every_variant_runs_in_the_chosen_precision(bench, monkeypatch, precision, dtype, variant):
    seen, stepped = [], []

    class RecordingScaler(torch.amp.GradScaler):
        def step(self, optimizer, *args, **kwargs):
            stepped.append(type(optimizer).__name__)
            return super().step(optimizer, *args, **kwargs)

    monkeypatch.setattr(torch.amp, "GradScaler", RecordingScaler)
    workload = _workload(seen)
    x, y = workload.batch()
    step = bench.build_step(workload, variant, x, y, precision)
    step()
    step()
    assert seen and set(seen) == {dtype}
    expected = "SGD" if variant == "non-private" else "DPOptimizer"
    assert stepped == ([expected] * 2 if precision == "fp16" else [])
    assert bench.parse_args(["--precision", precision]).precision == precision
