"""One ``optimizer.step()`` per batch of the loader ``make_private`` returns
(``opacus_dp/data/step_per_batch.py``): a batch that got no step is refused when the next one is
handed out or the pass ends, so the accountant never records fewer steps than batches trained on.

Oracle: the number of batches the loop received against the accountant's recorded steps."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp import PrivacyEngine
from opacus_dp.data import DPDataLoader
from opacus_dp.data.step_per_batch import SkippedBatchError

pytestmark = pytest.mark.filterwarnings("ignore::opacus_dp.engine.private_step.SecureModeNotice")


def private_run(batch_size: int = 1, num_workers: int = 0, seed: int = 0):
    """40 examples, ``q = batch_size/40``: with batch size 1 about a third of the batches are empty."""
    torch.manual_seed(seed)
    data = TensorDataset(torch.randn(40, 3), torch.randint(0, 2, (40,)))
    model = nn.Linear(3, 2)
    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=batch_size, num_workers=num_workers),
        noise_multiplier=1.0, max_grad_norm=1.0)
    return engine, model, optimizer, loader


def train(model, optimizer, x, y):
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()


def recorded_steps(engine) -> int:
    return sum(steps for _, _, steps in engine.accountant.history)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_skipping_an_empty_batch_is_refused_at_the_next_batch(num_workers):
    engine, model, optimizer, loader = private_run(num_workers=num_workers)
    received = 0
    with pytest.raises(SkippedBatchError, match="got no optimizer.step"):
        for x, y in loader:
            received += 1
            if len(x) == 0:
                continue
            train(model, optimizer, x, y)
    assert 1 <= received < len(loader)
    assert recorded_steps(engine) == received - 1  # every batch received but the skipped one, then refused


def test_a_caught_exception_that_drops_the_batch_is_refused():
    engine, model, optimizer, loader = private_run(batch_size=8)
    with pytest.raises(SkippedBatchError):
        for i, (x, y) in enumerate(loader):
            try:
                if i == 2:
                    raise FloatingPointError("a NaN loss, caught by the loop")
                train(model, optimizer, x, y)
            except FloatingPointError:
                pass
    assert recorded_steps(engine) == 2


def test_every_batch_stepped_including_the_empty_ones_is_accepted_and_recorded():
    engine, model, optimizer, loader = private_run()
    received = empty = 0
    for _ in range(2):
        for x, y in loader:
            received, empty = received + 1, empty + (len(x) == 0)
            train(model, optimizer, x, y)
    assert empty > 0 and received == 2 * len(loader) == recorded_steps(engine)


def test_break_then_a_new_pass_is_accepted():
    engine, model, optimizer, loader = private_run(batch_size=8)
    for i, (x, y) in enumerate(loader):
        if i == 2:
            break  # this batch was handed out but not used: nothing to account
        train(model, optimizer, x, y)
    for x, y in loader:
        train(model, optimizer, x, y)
    assert recorded_steps(engine) == 2 + len(loader)


def test_skipping_the_last_batch_of_a_pass_is_refused_when_the_pass_ends():
    engine, model, optimizer, loader = private_run(batch_size=8)
    with pytest.raises(SkippedBatchError):
        for i, (x, y) in enumerate(loader):
            if i < len(loader) - 1:
                train(model, optimizer, x, y)
    assert recorded_steps(engine) == len(loader) - 1


def test_taking_batches_ahead_is_refused():
    _, _, _, loader = private_run(batch_size=8)
    with pytest.raises(SkippedBatchError):
        list(loader)


def test_a_loader_not_connected_to_an_optimizer_checks_nothing():
    data = TensorDataset(torch.randn(40, 3))
    loader = DPDataLoader(data, sample_rate=0.1, generator=torch.Generator().manual_seed(0))
    assert len(list(loader)) == len(loader) == len(list(loader))


def test_a_pass_resumed_inside_drops_its_first_batches_unchecked_then_checks():
    _, model, optimizer, loader = private_run(batch_size=8)
    state = loader.generator.get_state()
    full = []
    for x, y in loader.iter_after(0):
        full.append(x.clone())
        train(model, optimizer, x, y)
    loader.generator.set_state(state)
    resumed = loader.iter_after(2)  # the first two batches drawn again and dropped
    x, y = next(resumed)
    assert torch.equal(x, full[2])
    with pytest.raises(SkippedBatchError):
        next(resumed)  # the third batch got no step
