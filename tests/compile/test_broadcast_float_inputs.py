"""A layer called on one float sample broadcast over the batch (a fixed position table of shape
``(1, T, d)`` projected by a ``Linear``), compiled: the tapped call records its input as the eager
hook keeps it, one row expanded by a stride of 0, not ``B`` copies, and trains as eagerly."""

import math
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp import PrivacyEngine
from tests.compile.helpers import CLIP, RTOL, ATOL, watch_tapped_calls

pytestmark = pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")

LENGTH, WIDTH, SIZES = 5, 6, (8, 6, 8)


def sinusoids(length: int, width: int) -> torch.Tensor:
    """The fixed position table ``(1, length, width)`` of Vaswani et al. 2017."""
    position = torch.arange(length, dtype=torch.float32)[:, None]
    rate = torch.exp(-math.log(10000.0) * torch.arange(0, width, 2, dtype=torch.float32) / width)
    table = torch.zeros(length, width)
    table[:, 0::2], table[:, 1::2] = torch.sin(position * rate), torch.cos(position * rate)
    return table[None]


class ProjectedPositions(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("table", sinusoids(LENGTH, WIDTH))
        self.inputs = nn.Linear(WIDTH, WIDTH)
        self.positions = nn.Linear(WIDTH, WIDTH)  # called on the (1, T, d) table
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.inputs(x) + self.positions(self.table)).mean(dim=1))


def batch(n: int):
    generator = torch.Generator().manual_seed(100 + n)
    return torch.randn(n, LENGTH, WIDTH, generator=generator), torch.randint(0, 3, (n,), generator=generator)


def training(mode: str, backend=None):
    """The parameters after one step per batch size of ``SIZES`` (σ = 0, clipping active)."""
    torch.manual_seed(0)
    model = ProjectedPositions()
    x, y = batch(max(SIZES))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        made = PrivacyEngine(accountant="rdp").make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=len(x)), noise_multiplier=0.0,
            max_grad_norm=CLIP, poisson_sampling=False, grad_sample_mode=mode)
    private, optimizer = made[0], made[1]
    criterion = made[2] if len(made) == 4 else nn.CrossEntropyLoss()  # ghost's runs its second pass
    if backend is not None:
        private.compile(backend=backend)
    for n in SIZES:
        x, y = batch(n)
        optimizer.zero_grad()
        criterion(private(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost", "bk"])
def test_the_broadcast_input_is_recorded_as_one_row_and_trains_as_eagerly(mode, backend, monkeypatch):
    recorded = []
    watch_tapped_calls(monkeypatch.setattr, lambda records: recorded.append({path: args[0] for path, args, *_ in records}))
    got, expected = training(mode, backend), training(mode)
    torch.manual_seed(0)
    start = [p.detach() for p in ProjectedPositions().parameters()]
    assert max((e - s).abs().max().item() for e, s in zip(expected, start)) > 1e-3
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=RTOL, atol=ATOL)
    assert len(recorded) == len(SIZES) - 1  # the first forward learns the calls eagerly
    for calls, n in zip(recorded, SIZES[1:]):
        table, inputs = calls["positions"], calls["inputs"]
        assert table.shape == (n, LENGTH, WIDTH) and table.stride(0) == 0
        assert table.untyped_storage().nbytes() == LENGTH * WIDTH * table.element_size()
        torch.testing.assert_close(table[n - 1], sinusoids(LENGTH, WIDTH)[0], rtol=0, atol=0)
        assert inputs.stride(0) == LENGTH * WIDTH  # batched inputs are copied as they are
        torch.testing.assert_close(inputs, batch(n)[0], rtol=0, atol=0)
