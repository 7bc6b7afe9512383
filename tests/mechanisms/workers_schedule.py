"""Rank function of the distributed schedule test (2 gloo processes)."""

import os
import warnings

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler

from opacus_dp import PrivacyEngine
from tests.distributed.workers import dataset, make_model, params_of, wrap

BANDS, BREAK_AT, PASSES = 2, 2, 2


def banded_ddp_breaks(rank, world_size, wrapper, strategy_cache):
    """Banded noise; every pass is left after ``BREAK_AT + 1`` steps; report the rows each step used."""
    os.environ["OPACUS_DP_CACHE_DIR"] = strategy_cache
    model = wrap(make_model(seed=10 + rank), wrapper)
    data = dataset(80)
    loader = DataLoader(data, batch_size=5, sampler=DistributedSampler(data, shuffle=False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine()
        gsm, optimizer, dp_loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), data_loader=loader,
            noise_multiplier=0.8, max_grad_norm=1.0, noise_mechanism="banded", bands=BANDS, epochs=2,
            noise_generator=torch.Generator().manual_seed(5))
    rows = []
    for _ in range(PASSES):
        for i, (x, y) in enumerate(dp_loader):
            optimizer.zero_grad()
            nn.CrossEntropyLoss()(gsm(x), y).backward()
            optimizer.step()
            rows.append(x)
            if i == BREAK_AT:
                break
    return {"rows": rows, "after": params_of(gsm), "steps": len(engine.accountant),
            "history": list(engine.accountant.history), "assignment": dp_loader.batch_sampler.assignment}
