"""Rank function of the distributed schedule test (2 gloo processes)."""

import torch.nn as nn

from tests.distributed.workers import params_of
from tests.mechanisms.workers import BANDS, banded_ddp_private  # noqa: F401  (BANDS: the tests' import)

BREAK_AT, PASSES = 2, 2


def banded_ddp_breaks(rank, world_size, wrapper, strategy_cache):
    """Banded noise; every pass is left after ``BREAK_AT + 1`` steps; report the rows each step used."""
    engine, gsm, optimizer, dp_loader = banded_ddp_private(rank, wrapper, strategy_cache, epochs=2)
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
