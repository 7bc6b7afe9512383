"""A compiled private model under DDP, run on every rank of a spawned gloo job.

Each case trains ``make_private``'s model, compiled in place (``model.compile(backend=...)``), with
σ = 0, Poisson batches and ``BatchMemoryManager`` virtual steps, and reports what the parent
compares with the single-process oracle (``oracle.replay_on_one_process``) and with the same run
uncompiled: the batches of each logical step, the final parameters, ε, and how many hooked calls
each compiled forward tapped (``traced_taps``: the layers ran inside the compiled graph).
"""

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler

from opacus_dp.data import BatchMemoryManager
from tests.compile.helpers import watch_tapped_calls
from tests.distributed.workers import (FLAT_C, LAYER_C, LR, _quiet_engine, dataset, params_of, record_logical_steps,
                                      wrap)

CASES = [  # (wrapper, grad_sample_mode, clipping, backend)
    ("ddp", "bk", "flat", "aot_eager"),
    ("ddp", "bk", "per_layer", "aot_eager"),
    ("ddp", "hooks", "flat", "aot_eager"),
    ("ddp", "ghost", "flat", "aot_eager"),
    ("dpddp", "bk", "flat", "aot_eager"),
    ("ddp_static_graph", "hooks", "flat", "aot_eager"),
    ("ddp_find_unused", "bk", "flat", "aot_eager"),
    ("ddp", "bk", "flat", "inductor"),
]


def model_of(seed: int) -> nn.Module:
    """Two hooked layers in an ``nn.Sequential`` (a loop dynamo compiles as one graph when tapped)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).double()


def train(rank, world_size, wrapper, mode, clipping, backend, steps=3):
    """One case (module doc); ``backend=None``: the same run uncompiled."""
    model = wrap(model_of(seed=100 + rank), wrapper)
    start = params_of(model)
    data = dataset()
    loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, shuffle=False))
    engine = _quiet_engine(accountant="rdp")
    torch.manual_seed(7 + rank)
    out = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                              data_loader=loader, noise_multiplier=0.0, grad_sample_mode=mode, clipping=clipping,
                              max_grad_norm=FLAT_C if clipping == "flat" else [LAYER_C] * 4)
    gsm, optimizer, dp_loader = out[0], out[1], out[-1]
    criterion = out[2] if mode == "ghost" else nn.CrossEntropyLoss()
    if backend is not None:
        gsm.compile(backend=backend)
    with BatchMemoryManager(data_loader=dp_loader, max_physical_batch_size=2, optimizer=optimizer) as pieces:
        logical = record_logical_steps(engine, gsm, optimizer, criterion, pieces, steps)
    return {"start": start, "batches": logical, "final": params_of(gsm), "epsilon": engine.get_epsilon(1e-5),
            "global_batch": optimizer.expected_batch_size * world_size}


def compile_job(rank, world_size):
    """Every case compiled and uncompiled, with the tapped calls of the compiled runs."""
    torch._dynamo.config.cache_size_limit = 64  # one frame per case and batch size
    counts = []
    watch_tapped_calls(setattr, lambda records: counts.append(len(records)))
    results = {}
    for case in CASES:
        del counts[:]
        results[case] = train(rank, world_size, *case)
        results[case]["tapped"] = list(counts)
        results[case + ("eager",)] = train(rank, world_size, *case[:3], backend=None)
    return results
