"""The classic engine under FSDP2 keeps one noise stream per rank after ``load_state_dict`` and
``_set_seed`` (each rank noises its own shard): rank 0's saved stream loaded on every rank, or one
seed given to every rank, must not make the ranks add the same draws to different coordinates.
Under DDP (rank 0 noises alone) the saved stream is restored as it was.

Every rank is seeded alike (as training scripts do) and steps on a zero gradient, so the update
of the first weight is the step's noise alone; rank r's shard is its rows [30·r, 30·(r+1)).
"""

import math
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.distributed.spawn import run_on_ranks
from tests.distributed.workers import wrap
from tests.engine.helpers import restore_classic

pytestmark = pytest.mark.distributed

D, K = 100, 60  # first weight K×D: 3000 coordinates in each of the two shards
BATCH, SAMPLES, WORLD = 8, 64, 2
EXPECTED_STD = 1.0 * 1.0 / (BATCH * WORLD)  # σ·C / expected global batch, lr = 1
CORRELATION_TOL = 5 / math.sqrt(K // WORLD * D)  # 5 standard errors of independent shards' correlation


def _engine(fsdp=True, fast_noise=False):
    """Model, SGD and an unattached classic engine; every rank seeded alike."""
    from opacus_dp import PrivacyEngine

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, K, bias=False), nn.Linear(K, 4, bias=False))
    if not fsdp:
        model = wrap(model, "dpddp")
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(model, batch_size=BATCH, sample_size=SAMPLES, noise_multiplier=1.0,
                               max_grad_norm=1.0, fsdp=fsdp, fast_noise=fast_noise)
    return model, optimizer, engine


def _noise_step(model, optimizer) -> torch.Tensor:
    """The first weight's update (gathered whole) of one step on a zero gradient: its noise."""
    weight = next(model.parameters())
    before = weight.full_tensor().detach().clone()
    (model(torch.randn(BATCH, D)).sum() * 0.0).backward()
    optimizer.step()
    optimizer.zero_grad()
    return weight.full_tensor().detach() - before


def _resumed(path, load_before_attach: bool, fast_noise) -> torch.Tensor:
    """A fresh run resumed from rank 0's ``engine.state_dict()`` at ``path``: its first noise."""
    model, optimizer, engine = _engine(fast_noise=fast_noise)
    restore_classic(engine, optimizer, torch.load(path, weights_only=False), load_before_attach)
    return _noise_step(model, optimizer)


def _seeded(seed: int, fast_noise) -> torch.Tensor:
    """A fresh attached run reseeded with ``engine._set_seed(seed)`` on every rank: its first noise."""
    model, optimizer, engine = _engine(fast_noise=fast_noise)
    engine.attach(optimizer)
    engine._set_seed(seed)
    return _noise_step(model, optimizer)


def fsdp_job(rank, world_size, path, fast_noise):
    model, optimizer, engine = _engine(fast_noise=fast_noise)
    engine.attach(optimizer)
    first = _noise_step(model, optimizer)
    if rank == 0:
        torch.save(engine.state_dict(), path)
    dist.barrier()
    return {"first": first, "load_then_attach": _resumed(path, True, fast_noise),
            "attach_then_load": _resumed(path, False, fast_noise), "resumed_again": _resumed(path, False, fast_noise),
            "seeded": _seeded(42, fast_noise), "seeded_again": _seeded(42, fast_noise)}


def ddp_job(rank, world_size, path):
    model, optimizer, engine = _engine(fsdp=False)
    engine.attach(optimizer)
    (model(torch.randn(BATCH, D)).sum() * 0.0).backward()
    optimizer.step()
    if rank == 0:
        torch.save(engine.state_dict(), path)
    dist.barrier()
    saved = torch.load(path, weights_only=False)
    engine.load_state_dict(saved)
    return {"saved": saved["noise_generator_state"], "loaded": engine._dp_optimizer.noise_state_dict()}


@pytest.fixture(scope="module", params=[False, "philox"], ids=["default_noise", "philox_noise"])
def fsdp_updates(tmp_path_factory, request):
    """The updates of :func:`fsdp_job` with the default noise and a keyed one (``fast_noise``)."""
    path = os.path.join(tmp_path_factory.mktemp("classic_fsdp"), "state.pt")
    return run_on_ranks(fsdp_job, WORLD, path, request.param, timeout=120)[0]  # full tensors: alike on ranks


def _shard_correlation(update: torch.Tensor) -> float:
    rows = K // WORLD
    first, second = update[:rows].reshape(-1), update[rows:].reshape(-1)
    return float(torch.corrcoef(torch.stack([first, second]))[0, 1])


@pytest.mark.parametrize("case", ["first", "load_then_attach", "attach_then_load", "seeded"])
def test_ranks_shards_get_uncorrelated_noise(fsdp_updates, case):
    """Before the fix: correlation 1.0 after load_state_dict and _set_seed (the control "first" passes)."""
    update = fsdp_updates[case]
    assert abs(float(update.std()) / EXPECTED_STD - 1) < 0.1  # the noise is there, σC/B
    assert abs(_shard_correlation(update)) < CORRELATION_TOL


def test_resume_from_one_state_is_reproducible(fsdp_updates):
    assert torch.equal(fsdp_updates["attach_then_load"], fsdp_updates["resumed_again"])
    assert torch.equal(fsdp_updates["load_then_attach"], fsdp_updates["attach_then_load"])
    assert not torch.equal(fsdp_updates["first"], fsdp_updates["attach_then_load"])


def test_set_seed_is_reproducible(fsdp_updates):
    assert torch.equal(fsdp_updates["seeded"], fsdp_updates["seeded_again"])


def test_ddp_restores_rank0_stream_as_saved(tmp_path):
    """Under DDP only rank 0 noises (rank 1 has no stream): it restores the saved stream unchanged."""
    first, second = run_on_ranks(ddp_job, WORLD, str(tmp_path / "state.pt"), timeout=120)
    assert torch.equal(first["loaded"]["state"], first["saved"]["state"])
    assert "state" not in second["loaded"]
