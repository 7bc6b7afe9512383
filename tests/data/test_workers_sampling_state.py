"""With worker processes a DP loader draws batches ahead of the loop; what it hands out, what a
checkpoint saves (``sampling_state()``) and where a new pass starts must still be those of a loader
without workers: the draws after the last batch handed out (``opacus_dp/data/data_loader.py``).

Oracle: the same loader with ``num_workers=0``, from the same seed."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp import PrivacyEngine
from opacus_dp.data import DPDataLoader

pytestmark = pytest.mark.filterwarnings("ignore::opacus_dp.engine.private_step.SecureModeNotice")

INDICES = TensorDataset(torch.arange(30))


def loader(num_workers: int) -> DPDataLoader:
    return DPDataLoader(INDICES, sample_rate=0.2, num_workers=num_workers, prefetch_factor=3 if num_workers else None,
                        generator=torch.Generator().manual_seed(11))


def passes(data: DPDataLoader, lengths):
    """The batches of passes left after ``lengths[i]`` batches (``None``: run to the end), and the
    sampling state after each."""
    seen, states = [], []
    for length in lengths:
        for i, (batch,) in enumerate(data):
            if length is not None and i == length:
                break
            seen.append(batch.tolist())
        states.append(data.sampling_state())
    return seen, states


@pytest.mark.parametrize("lengths", [[2, None, 1, 3], [None, 0, 4], [1, 1, 1]])
def test_passes_left_early_continue_where_the_loop_stopped(lengths):
    plain_batches, plain_states = passes(loader(0), lengths)
    ahead_batches, ahead_states = passes(loader(2), lengths)
    assert ahead_batches == plain_batches
    assert all(torch.equal(a, b) for a, b in zip(ahead_states, plain_states))


def private(num_workers: int, seed: int = 3, user_ids=None):
    fixed = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(40, 3, generator=fixed), torch.randint(0, 2, (40,), generator=fixed))
    torch.manual_seed(seed)  # the resumed run's model starts elsewhere, then loads the checkpoint
    model = nn.Linear(3, 2)
    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, dp_loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=8, num_workers=num_workers, generator=torch.Generator().manual_seed(5)),
        noise_multiplier=0.5, max_grad_norm=1.0, noise_generator=torch.Generator().manual_seed(7),
        **({} if user_ids is None else dict(privacy_unit="user", user_ids=user_ids, max_examples_per_user=2)))
    return engine, model, optimizer, dp_loader


def train(model, optimizer, dp_loader, steps: int):
    for i, (x, y) in enumerate(dp_loader):
        if i == steps:
            break
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


USERS = [i % 13 for i in range(40)]  # 13 users of 3 or 4 examples, 2 of them drawn when sampled


@pytest.mark.parametrize("user_ids", [None, USERS], ids=["examples", "users"])
def test_a_checkpoint_taken_with_workers_resumes_the_uninterrupted_run(tmp_path, user_ids):
    """Oracle: the same run without workers (a pass of 2 steps, then one of 4: each pass goes on
    from the batches handed out, not from those the workers drew ahead)."""
    _, model, optimizer, dp_loader = private(num_workers=0, user_ids=user_ids)
    train(model, optimizer, dp_loader, 2)
    train(model, optimizer, dp_loader, 4)
    oracle = [p.detach().clone() for p in model.parameters()]

    engine, model, optimizer, dp_loader = private(num_workers=2, user_ids=user_ids)
    train(model, optimizer, dp_loader, 2)  # the workers have drawn further ahead
    engine.save_checkpoint(path=tmp_path / "ckpt.pt", module=model, optimizer=optimizer, data_loader=dp_loader)
    train(model, optimizer, dp_loader, 4)
    assert all(torch.equal(a, b.detach()) for a, b in zip(oracle, model.parameters()))

    engine, model, optimizer, dp_loader = private(num_workers=2, seed=9, user_ids=user_ids)
    engine.load_checkpoint(path=tmp_path / "ckpt.pt", module=model, optimizer=optimizer, data_loader=dp_loader)
    train(model, optimizer, dp_loader, 4)
    assert all(torch.equal(a, b.detach()) for a, b in zip(oracle, model.parameters()))
    assert len(engine.accountant) == 6
