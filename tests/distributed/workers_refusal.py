"""Rank functions for refusals decided on one rank alone and for ranks that never arrive.

Each run trains on the rank's OWN rows (σ = 0, clipping active), lets one rank meet a local
refusal at one step, catches the error on every rank (as a training loop that goes on would)
and reports per step whether it raised (and what), whether anything changed, plus what the
single-process oracle needs: the start, the batches of every step, the final parameters.
"""

import os
import time
import warnings

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler

from opacus_dp import PrivacyEngine
from opacus_dp.engine.budget_guard import BudgetGuard
from opacus_dp.distributed import StepCollectiveError, StepRefusedError
from opacus_dp.errors import PrivacyBudgetExceededError
from tests.distributed.workers import FLAT_C, LR, N_SAMPLES, dataset, make_model, params_of, wrap

STEPS = 5
BAD_STEP = 1  # the step refused on rank 1 (0-based)
LOADER_BATCH = 4  # per rank: 48 samples, 24 per shard, 6 batches, q = 1/6, B_global = 8


def rows(rank: int, step: int, size: int = LOADER_BATCH):
    """Disjoint rows for each (rank, step): every rank trains on its own data."""
    x, y = dataset().tensors
    offset = (step * 2 + rank) * size % (N_SAMPLES - size)
    return x[offset : offset + size], y[offset : offset + size]


def _private(rank, wrapper, poisson=True, **kwargs):
    model = wrap(make_model(seed=700 + rank), wrapper)
    data = dataset()
    loader = DataLoader(data, batch_size=LOADER_BATCH, sampler=DistributedSampler(data, shuffle=False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(accountant="rdp")
    gsm, optimizer, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), data_loader=loader,
        noise_multiplier=0.0, max_grad_norm=FLAT_C, poisson_sampling=poisson, **kwargs)
    optimizer.non_finite_samples = "refuse"  # one rank's refusal is what these tests follow
    return engine, gsm, optimizer


def _describe(error: Exception) -> dict:
    return {"type": type(error).__name__, "message": str(error),
            "peer": isinstance(error, StepRefusedError),
            "refusals": getattr(error, "refusals", None),
            "budget": isinstance(error, PrivacyBudgetExceededError)}


def _step(gsm, optimizer, pieces, report):
    """One logical step over ``pieces`` (the last one steps); the outcome goes into ``report``."""
    start, grads, error = params_of(gsm), None, None
    for index, (x, y) in enumerate(pieces):
        optimizer.zero_grad()
        nn.CrossEntropyLoss()(gsm(x), y).backward()
        grads = [p.grad for p in gsm.parameters()]
        try:
            optimizer.step() if index == len(pieces) - 1 else optimizer.virtual_step()
        except Exception as caught:  # the training loop catches the error and goes on
            error = caught if index == len(pieces) - 1 else error
            if index < len(pieces) - 1:
                report["piece_errors"].append(_describe(caught))
    unchanged = all(torch.equal(a, b) for a, b in zip(start, params_of(gsm)))
    report["errors"].append(None if error is None else _describe(error))
    report["unchanged"].append(unchanged)
    report["grads_kept"].append(all(p.grad is g for p, g in zip(gsm.parameters(), grads)))
    report["batches"].append([(x, y) for x, y in pieces])


def _run(rank, world_size, gsm, optimizer, engine, make_pieces, between=None):
    report = {"start": params_of(gsm), "errors": [], "piece_errors": [], "unchanged": [],
              "grads_kept": [], "batches": [], "global_batch": optimizer.expected_batch_size * world_size}
    for step in range(STEPS):
        _step(gsm, optimizer, make_pieces(rank, step), report)
        if between is not None:
            between(step)
    report.update(final=params_of(gsm), history=list(engine.accountant.history),
                  recorded=len(engine.accountant), steps_taken=optimizer.steps_taken)
    return report


def nan_run(rank, world_size, wrapper):
    """make_private (Poisson batches): rank 1 meets a NaN input at BAD_STEP."""
    engine, gsm, optimizer = _private(rank, wrapper)

    def pieces(rank, step):
        x, y = rows(rank, step)
        if rank == 1 and step == BAD_STEP:
            x = x.clone()
            x[0, 0] = float("nan")
        return [(x, y)]

    return _run(rank, world_size, gsm, optimizer, engine, pieces)


def budget_run(rank, world_size):
    """Only rank 1 has a budget guard, which allows BAD_STEP steps (ε counted as the number of
    steps); raised again after the refusal, so the steps after it must pair again."""
    engine, gsm, optimizer = _private(rank, "dpddp")
    if rank == 1:
        guard = BudgetGuard(engine.accountant, max_epsilon=BAD_STEP + 0.5, delta=1e-5, sample_rate=1 / 6,
                            epsilon_of=lambda accountant: float(len(accountant)))
        optimizer.attach_pre_step_hook(guard)

    def lift(step):
        if rank == 1 and step == BAD_STEP:
            guard.max_epsilon = 1e9

    return _run(rank, world_size, gsm, optimizer, engine, lambda r, s: [rows(r, s)], between=lift)


def batch_size_run(rank, world_size):
    """Fixed-size batches (poisson_sampling=False, DDP): rank 1 steps on 6 > 4 samples once."""
    engine, gsm, optimizer = _private(rank, "ddp", poisson=False)

    def pieces(rank, step):
        return [rows(rank, step, 6 if rank == 1 and step == BAD_STEP else LOADER_BATCH)]

    return _run(rank, world_size, gsm, optimizer, engine, pieces)


def piece_run(rank, world_size):
    """Fixed-size batches cut in two pieces (virtual_step): rank 1's first piece of BAD_STEP is NaN."""
    engine, gsm, optimizer = _private(rank, "dpddp", poisson=False)

    def pieces(rank, step):
        x, y = rows(rank, step)
        if rank == 1 and step == BAD_STEP:
            x = x.clone()
            x[0, 0] = float("nan")
        return [(x[:2], y[:2]), (x[2:], y[2:])]

    return _run(rank, world_size, gsm, optimizer, engine, pieces)


def refusal_job(rank, world_size):
    """Every one-rank refusal in one process group (the group stays usable after each)."""
    return {"nan_dpddp": nan_run(rank, world_size, "dpddp"), "nan_ddp": nan_run(rank, world_size, "ddp"),
            "budget": budget_run(rank, world_size), "batch_size": batch_size_run(rank, world_size),
            "piece": piece_run(rank, world_size)}


def absent_rank_job(rank, world_size, absent, marker, step_timeout):
    """Rank ``absent`` fails before its second step, catches the error and stays alive (until
    the others have reported, at most 20 s); the others must raise after about ``step_timeout``."""
    engine, gsm, optimizer = _private(rank, "dpddp", step_timeout=step_timeout)
    for step in range(2):
        if rank == absent and step == 1:
            try:
                raise RuntimeError("simulated failure before optimizer.step()")
            except RuntimeError:  # caught, and the rank goes on with something else
                deadline = time.monotonic() + 20
                while not os.path.exists(marker) and time.monotonic() < deadline:
                    time.sleep(0.1)
                return {"absent": True}
        x, y = rows(rank, step)
        optimizer.zero_grad()
        nn.CrossEntropyLoss()(gsm(x), y).backward()
        started = time.monotonic()
        try:
            optimizer.step()
        except StepCollectiveError as error:
            elapsed = time.monotonic() - started
            with open(marker, "w") as f:
                f.write("reported")
            return {"absent": False, "elapsed": elapsed, "message": str(error),
                    "missing": error.missing_ranks, "recorded": len(engine.accountant)}
    return {"absent": False, "elapsed": None, "message": None, "missing": None}
