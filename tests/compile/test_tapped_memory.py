"""The inputs a tapped call records leave the compiled graph as plain values: no gradient flows
to them, so AOT autograd gives the compiled backward no zero-filled gradient for each of them
(it materialises one for every differentiable graph output that gets no gradient)."""

import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp import PrivacyEngine
from tests.compile.helpers import watch_tapped_calls
from tests.script_loading import load_script

pytestmark = pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")
BATCH, POSITIONS, WIDTH = 128, 16, 256


def model() -> nn.Module:
    """Two hidden layers whose inputs require grad (each ``BATCH × POSITIONS × WIDTH``, 2 MiB)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                         nn.Linear(WIDTH, 10), nn.Flatten(), nn.Linear(10 * POSITIONS, 10))


def private_step(compiled: bool):
    """One ``bk`` step of :func:`model` (σ = 1), compiled with ``aot_eager`` or not."""
    module = model()
    x, y = torch.randn(BATCH, POSITIONS, WIDTH), torch.randint(0, 10, (BATCH,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        private, optimizer, _ = PrivacyEngine().make_private(
            module=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=BATCH), noise_multiplier=1.0,
            max_grad_norm=1.0, grad_sample_mode="bk", poisson_sampling=False)
    if compiled:
        private.compile(backend="aot_eager")

    def step():
        optimizer.zero_grad()
        nn.functional.cross_entropy(private(x), y).backward()
        optimizer.step()
    return step


def test_recorded_inputs_do_not_require_grad(monkeypatch):
    seen = []
    watch_tapped_calls(monkeypatch.setattr, lambda records: seen.extend(
        t for _, args, *_ in records for t in args if isinstance(t, torch.Tensor)))
    step = private_step(compiled=True)
    for _ in range(3):
        step()
    assert len(seen) == 2 * 4  # the two later forwards, four tapped calls each
    assert not any(t.requires_grad for t in seen)


@pytest.mark.slow
def test_a_compiled_step_holds_no_gradient_buffers_for_the_recorded_inputs():
    """The tensors' peak (the CPU allocator's count) of the compiled step stays within the bytes
    of the zero gradients AOT autograd would add for the two differentiable recorded inputs
    (4 MiB) of the eager step's: before the recorded copies were detached it was 5.6 MiB above."""
    peak = load_script("memory_probe.py", "memory_probe_under_test").allocated_peak_mib
    peaks = {}
    for compiled in (False, True):
        step = private_step(compiled)
        for _ in range(3):  # the first compiled forward learns the calls; then compiled code
            step()
        peaks[compiled] = peak(step)
    zero_gradients_mib = 2 * BATCH * POSITIONS * WIDTH * 4 / 2 ** 20
    assert peaks[True] - peaks[False] < zero_gradients_mib, peaks
