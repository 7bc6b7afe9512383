"""Functions run on every rank of a spawned gloo job: a rank that leaves the common sequence of a
private step outside the optimizer (skips a batch, stops before its forward pass, exits).

Each scenario reports, per rank, what the rank saw: the error's type, message, the ranks it
names, how long the failing call took, and the parameters (gathered whole) where they matter.
"""

import time

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from opacus_dp.distributed import DifferentiallyPrivateDistributedDataParallel
from tests.distributed.workers_fsdp import FLAT_C, LR, _engine, dataset, make_model, private

STEP_TIMEOUT = 3.0


def _report(error, started):
    return {"type": type(error).__name__, "message": str(error), "elapsed": time.monotonic() - started,
            "missing": getattr(error, "missing_ranks", None), "refusals": getattr(error, "refusals", None),
            "classes": [c.__name__ for c in type(error).__mro__]}


def _fsdp(seed=0):
    engine, module, optimizer, criterion, loader = private(make_model(seed=seed), sigma=0.0)
    optimizer.reducer.step_timeout = STEP_TIMEOUT
    return module, optimizer, criterion, loader


def fsdp_skip(rank, world_size, where):
    """Rank 1 skips batch 1 outside the optimizer: ``where`` = "forward" (it raises before its
    forward pass and goes on with the next batch), "backward" (it catches a NaN loss: no backward,
    no step) or "step" (backward done, no step). Every rank must raise at the first mispaired
    collective; returns each rank's error."""
    module, optimizer, criterion, loader = _fsdp()
    started = time.monotonic()
    try:
        for step, (x, y) in enumerate(loader):
            started = time.monotonic()
            skipping = rank == 1 and step == 1
            if skipping and where == "forward":
                continue
            loss = criterion(module(x), y)
            if skipping and where == "backward":
                optimizer.zero_grad()
                continue
            loss.backward()
            if skipping and where == "step":
                optimizer.zero_grad()
                continue
            optimizer.step()
            optimizer.zero_grad()
            if step == 4:
                return {"type": None, "steps": step + 1}
    except Exception as error:  # what each rank sees is the result
        return {**_report(error, started), "step": step}
    return {"type": None}


def fsdp_rank_stays_away(rank, world_size, where="forward"):
    """Rank 1 raises at step 1 before its ``where`` pass ("forward" or "backward"), catches it and
    stays alive (here: sleeps well past the step timeout) without taking part: rank 0 must fail
    within the bound, naming it."""
    module, optimizer, criterion, loader = _fsdp()
    for step, (x, y) in enumerate(loader):
        away = rank == 1 and step == 1
        if away and where == "forward":
            time.sleep(STEP_TIMEOUT + 4)
            return {"type": None}
        started = time.monotonic()
        try:
            loss = criterion(module(x), y)
            if away:
                time.sleep(STEP_TIMEOUT + 4)
                return {"type": None}
            started = time.monotonic()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        except Exception as error:
            return _report(error, started)
    return {"type": None}


def fsdp_rank_exits(rank, world_size):
    """Rank 1 leaves (its process exits) after the setup: rank 0's next step must fail with
    ``StepCollectiveError`` naming rank 1, not with the transport's error."""
    module, optimizer, criterion, loader = _fsdp()
    if rank == 1:
        return {"type": None}
    time.sleep(1.0)  # let rank 1's process end
    started = time.monotonic()
    try:
        for x, y in loader:
            criterion(module(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    except Exception as error:
        return _report(error, started)
    return {"type": None}


def _ddp_private(wrapper):
    model = make_model(seed=0)
    wrap = DifferentiallyPrivateDistributedDataParallel if wrapper == "dpddp" else DistributedDataParallel
    model = wrap(model)
    engine = _engine(accountant="rdp")
    torch.manual_seed(5)
    module, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        data_loader=DataLoader(dataset(), batch_size=8), noise_multiplier=0.0, max_grad_norm=FLAT_C,
        step_timeout=STEP_TIMEOUT)
    return engine, module, optimizer, loader


def ddp_skip(rank, world_size, wrapper):
    """DDP/DPDDP: rank 1 catches a NaN loss at batch 1 and goes on (no backward, no step). The next
    step must be refused on every rank (nothing updated), and the ranks pair again afterwards."""
    engine, module, optimizer, loader = _ddp_private(wrapper)
    params = lambda: [p.detach().clone() for p in module.parameters()]  # noqa: E731
    errors, snapshots = [], []
    for step, (x, y) in enumerate(loader):
        loss = nn.CrossEntropyLoss()(module(x), y)
        if rank == 1 and step == 1:
            optimizer.zero_grad()
            continue
        loss.backward()
        before = params()
        try:
            optimizer.step()
        except Exception as error:
            errors.append(_report(error, time.monotonic()))
            snapshots.append((before, params()))
        optimizer.zero_grad()
        if len(engine.accountant) == 3:
            break
    return {"errors": errors, "snapshots": snapshots, "final": params(), "steps": len(engine.accountant)}


def ddp_pieces_differ(rank, world_size, steps=3):
    """DPDDP with BatchMemoryManager pieces of one sample: the ranks cut their batches into
    different numbers of pieces, which is no skip (no refusal)."""
    from opacus_dp.data import BatchMemoryManager

    engine, module, optimizer, loader = _ddp_private("dpddp")
    pieces = []
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=1, optimizer=optimizer) as physical:
        for x, y in physical:
            pieces.append(len(x))
            nn.CrossEntropyLoss()(module(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            if len(engine.accountant) == steps:
                break
    return {"pieces": len(pieces), "steps": len(engine.accountant),
            "final": [p.detach().clone() for p in module.parameters()]}


def ddp_skip_job(rank, world_size):
    results = {wrapper: ddp_skip(rank, world_size, wrapper) for wrapper in ("dpddp", "ddp")}
    results["pieces"] = ddp_pieces_differ(rank, world_size)
    return results


def fsdp_skip_job(rank, world_size):
    """The skips that leave the process group usable, then the rank that stays away (last: it
    leaves rank 0's collective unanswered)."""
    results = {where: fsdp_skip(rank, world_size, where) for where in ("forward", "backward", "step")}
    results["stays_away"] = fsdp_rank_stays_away(rank, world_size)
    return results
