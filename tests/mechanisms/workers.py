"""Rank function of the distributed correlated-noise test (2 gloo processes)."""

import os
import warnings

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler

from opacus_dp import PrivacyEngine
from tests.distributed.workers import dataset, make_model, params_of, wrap

SIGMA, CLIP, LR, BANDS, NOISE_SEED, STEPS = 0.8, 1.0, 0.5, 2, 5, 6


def banded_ddp_private(rank, wrapper, strategy_cache, epochs, fast_noise=False):
    """``(engine, module, optimizer, loader)`` of banded noise on DDP (``wrapper``), 80 samples,
    its fresh draws by ``fast_noise``'s generator."""
    os.environ["OPACUS_DP_CACHE_DIR"] = strategy_cache
    model = wrap(make_model(seed=10 + rank), wrapper)
    data = dataset(80)
    loader = DataLoader(data, batch_size=5, sampler=DistributedSampler(data, shuffle=False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine()
        gsm, optimizer, dp_loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), data_loader=loader,
            noise_multiplier=SIGMA, max_grad_norm=CLIP, noise_mechanism="banded", bands=BANDS, epochs=epochs,
            noise_generator=torch.Generator().manual_seed(NOISE_SEED), fast_noise=fast_noise)
    return engine, gsm, optimizer, dp_loader


def banded_ddp_run(rank, world_size, wrapper, strategy_cache, fast_noise=False):
    """Train ``STEPS`` steps of banded noise; report params, batches and gradients per step."""
    engine, gsm, optimizer, dp_loader = banded_ddp_private(rank, wrapper, strategy_cache, epochs=1,
                                                           fast_noise=fast_noise)
    steps = []
    for x, y in dp_loader:
        before = params_of(gsm)
        optimizer.zero_grad()
        nn.CrossEntropyLoss()(gsm(x), y).backward()
        optimizer.step()
        steps.append({"before": before, "x": x, "y": y, "grads": [p.grad.clone() for p in gsm.parameters()]})
        if len(steps) == STEPS:
            break
    return {"steps": steps, "after": params_of(gsm), "global_batch": optimizer.expected_batch_size * world_size,
            "group_rate": dp_loader.sample_rate, "history": list(engine.accountant.history),
            "assignment": dp_loader.batch_sampler.assignment, "groups": dp_loader.batch_sampler.groups}
