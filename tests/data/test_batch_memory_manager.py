"""BatchMemoryManager: physical batches, the skip-signal pattern, and equivalence of training.

Oracle for the splitting: a twin DPDataLoader with the same generator seed yields the logical
batches; each must arrive as ``max(1, ceil(n/m))`` consecutive chunks of at most ``m`` examples,
with ``do_skip=True`` signalled before every chunk but the last. Oracle for training: DP-SGD
steps computed by hand (per-sample autograd, clipping, sum, ÷ expected batch size).
"""

import math

import numpy as np
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp.data import BatchMemoryManager, DPDataLoader
from opacus_dp.utils.batch_memory_manager import BatchMemoryManager as CompatBatchMemoryManager


class RecordingOptimizer:
    """Stands in for DPOptimizer: records every ``signal_skip_step`` call."""

    def __init__(self):
        self.signals = []

    def signal_skip_step(self, do_skip=True):
        self.signals.append(do_skip)


def seeded(seed):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def indexed_dataset(n):
    """Examples (index, feature row): the index identifies which examples a batch holds."""
    return TensorDataset(torch.arange(n), torch.randn(n, 2))


def logical_batches(dataset, q, steps, seed):
    return [b[0].tolist() for b in DPDataLoader(dataset, sample_rate=q, steps=steps, generator=seeded(seed))]


def run_physical(dataset, q, steps, seed, max_size, num_workers=0):
    """[(indices, trailing shape, signals recorded when the chunk was handed out)]."""
    loader = DPDataLoader(dataset, sample_rate=q, steps=steps, generator=seeded(seed), num_workers=num_workers)
    optimizer = RecordingOptimizer()
    chunks = []
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=max_size, optimizer=optimizer) as physical:
        for index, features in physical:
            chunks.append((index.tolist(), tuple(features.shape[1:]), list(optimizer.signals)))
    return chunks, optimizer.signals


def check_against_logical(chunks, signals, logical, max_size):
    position = 0
    for batch in logical:
        k = max(1, math.ceil(len(batch) / max_size))
        group = chunks[position : position + k]
        assert sum((c[0] for c in group), []) == batch
        assert all(len(c[0]) <= max_size for c in group)
        # chunk sizes as balanced as np.array_split makes them
        if batch:
            assert [len(c[0]) for c in group] == [len(a) for a in np.array_split(batch, k)]
        assert signals[position : position + k] == [True] * (k - 1) + [False]
        for offset, chunk in enumerate(group):
            assert len(chunk[2]) == position + offset + 1  # signalled before the chunk is handed out
            assert chunk[1] == (2,)
        position += k
    assert position == len(chunks) == len(signals)


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 30), q=st.floats(0.02, 1.0), max_size=st.integers(1, 8), seed=st.integers(0, 10**6))
def test_chunks_and_signals_match_logical_batches(n, q, max_size, seed):
    dataset = indexed_dataset(n)
    steps = 6
    chunks, signals = run_physical(dataset, q, steps, seed, max_size)
    check_against_logical(chunks, signals, logical_batches(dataset, q, steps, seed), max_size)


def test_empty_logical_batch_gives_one_empty_physical_batch_that_steps():
    dataset = indexed_dataset(3)
    logical = logical_batches(dataset, 0.05, 30, seed=1)
    assert any(len(b) == 0 for b in logical)
    chunks, signals = run_physical(dataset, 0.05, 30, 1, max_size=2)
    check_against_logical(chunks, signals, logical, 2)
    assert signals.count(False) == 30  # one real step per logical batch


def test_signals_stay_in_order_with_worker_prefetching():
    dataset = indexed_dataset(40)
    chunks, signals = run_physical(dataset, 0.3, 5, seed=2, max_size=3, num_workers=2)
    check_against_logical(chunks, signals, logical_batches(dataset, 0.3, 5, seed=2), 3)


def test_fixed_size_loader_is_split_too():
    dataset = indexed_dataset(10)
    optimizer = RecordingOptimizer()
    loader = DataLoader(dataset, batch_size=4)
    with CompatBatchMemoryManager(data_loader=loader, max_physical_batch_size=3, optimizer=optimizer) as physical:
        sizes = [len(b[0]) for b in physical]
        assert len(physical) == math.ceil(3 * 4 / 3)
    assert sizes == [2, 2, 2, 2, 2] and optimizer.signals == [True, False, True, False, False]


def test_length_is_ceil_of_expected_physical_batches():
    loader = DPDataLoader(indexed_dataset(100), sample_rate=0.1)
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=4, optimizer=RecordingOptimizer()) as physical:
        assert len(physical) == math.ceil(10 * 10 / 4)
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=50, optimizer=RecordingOptimizer()) as physical:
        assert len(physical) == 10  # at least one physical batch per logical batch


@pytest.mark.parametrize("bad", [0, -3])
def test_non_positive_physical_size_is_rejected(bad):
    loader = DPDataLoader(indexed_dataset(10), sample_rate=0.5)
    with pytest.raises(ValueError, match="max_physical_batch_size"):
        BatchMemoryManager(data_loader=loader, max_physical_batch_size=bad, optimizer=RecordingOptimizer())


def test_bad_arguments_are_named():
    loader = DPDataLoader(indexed_dataset(10), sample_rate=0.5)
    with pytest.raises(TypeError, match="max_physical_batch_size"):
        BatchMemoryManager(data_loader=loader, max_physical_batch_size=2.5, optimizer=RecordingOptimizer())
    with pytest.raises(TypeError, match="signal_skip_step"):
        BatchMemoryManager(data_loader=loader, max_physical_batch_size=2, optimizer=object())
    with pytest.raises(ValueError, match="batch_size=None"):
        BatchMemoryManager(
            data_loader=DataLoader(indexed_dataset(4), batch_size=None),
            max_physical_batch_size=2,
            optimizer=RecordingOptimizer(),
        )


# ------------------------------------------------------------- with the real DPOptimizer


def oracle_dp_sgd(weight, bias, dataset, batches, clip, expected_batch_size, lr):
    """Hand-computed DP-SGD with σ = 0: per-sample grads, flat clipping to ``clip``, sum, ÷ E|B|."""
    w, b = weight.clone(), bias.clone()
    x_all, y_all = dataset.tensors
    for batch in batches:
        total_w, total_b = torch.zeros_like(w), torch.zeros_like(b)
        for i in batch:
            wi, bi = w.clone().requires_grad_(), b.clone().requires_grad_()
            loss = ((x_all[i] @ wi.T + bi - y_all[i]) ** 2).sum()
            gw, gb = torch.autograd.grad(loss, (wi, bi))
            norm = torch.sqrt(gw.pow(2).sum() + gb.pow(2).sum())
            factor = min(1.0, clip / (norm.item() + 1e-6))
            total_w += factor * gw
            total_b += factor * gb
        w -= lr * total_w / expected_batch_size
        b -= lr * total_b / expected_batch_size
    return w, b


def test_training_through_batch_memory_manager_equals_logical_dp_sgd():
    from opacus_dp.grad_sample import GradSampleModule
    from opacus_dp.optim import DPOptimizer

    n, q, steps, clip, lr, seed = 16, 0.4, 4, 0.3, 0.5, 3
    dataset = TensorDataset(torch.randn(n, 3, dtype=torch.float64), torch.randn(n, 1, dtype=torch.float64))
    linear = nn.Linear(3, 1).double()
    w0, b0 = linear.weight.detach().clone(), linear.bias.detach().clone()
    model = GradSampleModule(linear, loss_reduction="sum")
    optimizer = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr),
        noise_multiplier=0.0,
        max_grad_norm=clip,
        expected_batch_size=q * n,
    )
    real_steps = []
    optimizer.attach_step_hook(lambda opt: real_steps.append(1))
    loader = DPDataLoader(dataset, sample_rate=q, steps=steps, generator=seeded(seed))
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=2, optimizer=optimizer) as physical:
        for x, y in physical:
            ((model(x) - y) ** 2).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    twin = DPDataLoader(TensorDataset(torch.arange(n)), sample_rate=q, steps=steps, generator=seeded(seed))
    batches = [b[0].tolist() for b in twin]
    w, b = oracle_dp_sgd(w0, b0, dataset, batches, clip, q * n, lr)
    assert len(real_steps) == steps
    torch.testing.assert_close(linear.weight.detach(), w, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(linear.bias.detach(), b, rtol=1e-9, atol=1e-9)


# ------------------------------------------------ loops that leave a logical batch unfinished
def private_linear(n=16, seed=3):
    """``(dataset, linear, grad-sample model, DPOptimizer with σ = 0, real-step counter)``."""
    from opacus_dp.grad_sample import GradSampleModule
    from opacus_dp.optim import DPOptimizer

    torch.manual_seed(seed)
    dataset = TensorDataset(torch.randn(n, 3, dtype=torch.float64), torch.randn(n, 1, dtype=torch.float64))
    linear = nn.Linear(3, 1).double()
    model = GradSampleModule(linear, loss_reduction="sum")
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), noise_multiplier=0.0,
                            max_grad_norm=0.3, expected_batch_size=0.4 * n)
    real_steps = []
    optimizer.attach_step_hook(lambda opt: real_steps.append(1))
    return dataset, linear, model, optimizer, real_steps


def train_chunk(model, optimizer, x, y):
    ((model(x) - y) ** 2).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_a_loop_left_inside_a_logical_batch_leaves_nothing_for_the_next_step():
    """``break`` after the first chunk of a logical batch: its clipped gradients are dropped
    (with a warning), so the next loop's first step is exactly the oracle's step on its own
    logical batch, not merged with the unfinished one."""
    dataset, linear, model, optimizer, real_steps = private_linear()
    loader = DPDataLoader(dataset, sample_rate=0.4, steps=3, generator=seeded(5))
    first = next(iter(DPDataLoader(TensorDataset(torch.arange(16)), sample_rate=0.4, steps=3,
                                   generator=seeded(5))))[0]
    assert len(first) > 2, "the seed must give a first logical batch of several chunks"
    with pytest.warns(RuntimeWarning, match="dropped"):
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=2, optimizer=optimizer) as physical:
            for x, y in physical:
                train_chunk(model, optimizer, x, y)
                break
    assert real_steps == []
    w0, b0 = linear.weight.detach().clone(), linear.bias.detach().clone()
    loader = DPDataLoader(dataset, sample_rate=0.4, steps=1, generator=seeded(6))
    batch = next(iter(DPDataLoader(TensorDataset(torch.arange(16)), sample_rate=0.4, steps=1,
                                   generator=seeded(6))))[0].tolist()
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=2, optimizer=optimizer) as physical:
        for x, y in physical:
            train_chunk(model, optimizer, x, y)
    w, b = oracle_dp_sgd(w0, b0, dataset, [batch], 0.3, 0.4 * 16, 0.5)
    assert real_steps == [1]
    torch.testing.assert_close(linear.weight.detach(), w, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(linear.bias.detach(), b, rtol=1e-9, atol=1e-9)


def test_skipping_the_step_of_an_empty_logical_batch_is_refused():
    """``if len(x) == 0: continue`` leaves a Poisson step untaken (unaccounted) and would shift
    every later step boundary: the next chunk is refused, naming the cause."""
    dataset, linear, model, optimizer, _ = private_linear(n=4)
    loader = DPDataLoader(dataset, sample_rate=0.05, steps=40, generator=seeded(0))
    with pytest.raises(RuntimeError, match="empty batch skipped"):
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=2, optimizer=optimizer) as physical:
            for x, y in physical:
                if len(x) == 0:
                    continue
                train_chunk(model, optimizer, x, y)


def test_a_skipped_step_inside_a_logical_batch_only_drops_its_signal():
    """No ``step()`` after a chunk that is not the last of its logical batch: its signal is
    dropped, the per-sample gradients of its backward pass join the next ``step()`` of the same
    logical batch, and the training equals the oracle's logical DP-SGD."""
    dataset, linear, model, optimizer, real_steps = private_linear()
    w0, b0 = linear.weight.detach().clone(), linear.bias.detach().clone()
    loader = DPDataLoader(dataset, sample_rate=0.4, steps=3, generator=seeded(5))
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=2, optimizer=optimizer) as physical:
        for chunk, (x, y) in enumerate(physical):
            ((model(x) - y) ** 2).sum().backward()
            if chunk != 0:  # the first chunk's step is left out (its backward is not)
                optimizer.step()
                optimizer.zero_grad()
    twin = DPDataLoader(TensorDataset(torch.arange(16)), sample_rate=0.4, steps=3, generator=seeded(5))
    batches = [b[0].tolist() for b in twin]
    assert len(batches[0]) > 2
    w, b = oracle_dp_sgd(w0, b0, dataset, batches, 0.3, 0.4 * 16, 0.5)
    assert len(real_steps) == 3
    torch.testing.assert_close(linear.weight.detach(), w, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(linear.bias.detach(), b, rtol=1e-9, atol=1e-9)
