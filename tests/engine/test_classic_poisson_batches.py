"""The classic engine with ``poisson=True`` in one process: each Poisson batch of a live
``DPDataLoader`` of the engine's rate gets its own step. Two batches merged with
``virtual_step`` would be recorded as one draw of rate q although the step's batch was a draw
of about 2q, where an example may even count twice (2C)."""

import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

from opacus_dp import PrivacyEngine
from opacus_dp.data import DPDataLoader
from opacus_dp.data.step_per_batch import SkippedBatchError

N, Q = 64, 0.125


def setting(rate=Q):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(N, 4), torch.randint(0, 2, (N,)))
    loader = DPDataLoader(data, sample_rate=rate, generator=torch.Generator().manual_seed(1))
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(model, sample_rate=Q, poisson=True, sample_size=N, noise_multiplier=1.0,
                               max_grad_norm=1.0)
        engine.attach(optimizer)
    return engine, model, optimizer, loader


def backward(model, x, y):
    nn.functional.cross_entropy(model(x), y, reduction="sum").backward()


def test_two_poisson_batches_merged_into_one_step_are_refused():
    engine, model, optimizer, loader = setting()
    with pytest.raises(SkippedBatchError, match="no optimizer.step"):
        for i, (x, y) in enumerate(loader):
            backward(model, x, y)
            if i % 2:
                optimizer.step()
                optimizer.zero_grad()
            else:
                optimizer.virtual_step()
    assert engine.steps <= 1  # refused when the second batch of the first pair was asked for


def test_one_step_per_batch_pieces_of_a_batch_and_a_loader_of_another_rate_pass():
    """Oracle: the accountant's record, one step per batch handed out (empty ones included)."""
    engine, model, optimizer, loader = setting()
    batches = 0
    for x, y in loader:
        for piece in range(2):  # one Poisson batch cut into two pieces (memory): one step
            backward(model, x[piece::2], y[piece::2])
            if piece == 0:
                optimizer.virtual_step()
        optimizer.step()
        optimizer.zero_grad()
        batches += 1
    assert engine.steps == batches == len(loader)
    merged = setting(rate=2 * Q)[3]  # a loader of another rate is not the engine's: its merging is the user's
    assert sum(1 for _ in merged) == len(merged)


def test_after_detach_the_loader_iterates_without_steps():
    engine, model, optimizer, loader = setting()
    for x, y in loader:
        backward(model, x, y)
        optimizer.step()
        optimizer.zero_grad()
        break
    engine.detach()
    assert sum(1 for _ in loader) == len(loader)
