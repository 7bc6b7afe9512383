"""``scripts/benchmark_layers.py``: its ``bk`` column computes the real DP-SGD quantities.

The ``bk`` timing runs forward, backward, per-sample norms, flat clip factors and clipped sums;
the helper doing the last three is checked against a batch-size-1 autograd loop, and a short
run of the script must time every column for a Linear and a Conv layer.
"""

import pytest
import torch
import torch.nn as nn

from opacus_dp.grad_sample.bookkeeping.module import BookkeepingGradSampleModule
from tests.script_loading import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmark_layers.py", "benchmark_layers")


def _clipped_sum_oracle(layer: nn.Module, x: torch.Tensor, clip: float):
    """``Σ_i min(1, C/‖g_i‖) g_i`` from one backward pass per sample."""
    params = [p for p in layer.parameters() if p.requires_grad]
    grads = []
    for i in range(x.shape[0]):
        out = layer(x[i : i + 1])
        grads.append(torch.autograd.grad(0.5 * out.pow(2).sum(), params))
    totals = [sum(g.pow(2).sum() for g in sample).sqrt() for sample in grads]
    factors = [min(1.0, clip / (float(n) + 1e-6)) for n in totals]
    sums = [sum(f * sample[k] for f, sample in zip(factors, grads)) for k in range(len(params))]
    return sums, totals


@pytest.mark.parametrize("make, shape", [
    (lambda: nn.Linear(6, 4), (5, 6)),
    (lambda: nn.Linear(6, 4), (5, 3, 6)),
    (lambda: nn.Conv2d(2, 3, 3, padding=1), (4, 2, 5, 5)),
])
def test_bk_column_computes_the_clipped_sum(bench, make, shape):
    torch.manual_seed(0)
    layer = make().double()
    x = torch.randn(*shape, dtype=torch.float64)
    expected, norms = _clipped_sum_oracle(layer, x, bench.CLIP)
    assert max(norms) > bench.CLIP  # some samples are clipped, so the factors matter
    model = BookkeepingGradSampleModule(layer, batch_first=True, loss_reduction="sum")
    bench._loss(model(x)).backward()
    for got, want in zip(bench.clipped_sums(model), expected):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_short_run_times_every_column(bench, capsys):
    pytest.importorskip("opacus")
    rows = bench.main(["--repeats", "1", "--warmup", "0", "--only", "Conv1d", "--clock", "cpu"])
    assert [row["layer"] for row in rows] == ["Conv1d"]
    assert all(rows[0]["median_s"][kind] > 0 for kind in bench.KINDS), rows[0]
    assert "bk x" in capsys.readouterr().out
