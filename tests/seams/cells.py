"""The cells of the seams matrix and the training loop each cell runs, on every rank.

A cell is ``(grad_sample_mode, reduction, noise_mechanism, seam)``. Every cell trains the same small
MLP with σ = 0 and clipping active, and reports what the parent compares with an independent
oracle: the starting parameters, every physical batch of every logical step (so the oracle sees
exactly the data the run saw), the final parameters, the divisor of the mean, the accountant's
history, and the facts that prove the seam was exercised (a piece count, an empty local batch, a
resume, a scaler's scale). A cell refused by ``make_private`` reports the refusal's type and message.
"""

import itertools
import os
import tempfile
import traceback
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from opacus_dp import PrivacyEngine
from opacus_dp.data import BatchMemoryManager
from opacus_dp.distributed import DifferentiallyPrivateDistributedDataParallel

MODES = ("hooks", "functorch", "ghost", "bk")
REDUCTIONS = ("local", "ddp", "fsdp2")
MECHANISMS = ("independent", "banded", "tree", "blt")
SEAMS = ("bmm", "empty", "resume", "fp16")
N_SAMPLES, N_IN, N_CLASSES = 48, 5, 3
LR, CLIP, BANDS, STEPS, RESUME_AT = 0.5, 0.3, 2, 5, 3
EMPTY_STEPS = 12  # enough that an empty local batch is drawn (q = 1/48: each step's is empty w.p. ≈ 0.37)
STEP_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class Cell:
    mode: str
    reduction: str
    mechanism: str
    seam: str

    @property
    def name(self) -> str:
        return f"{self.mode}-{self.reduction}-{self.mechanism}-{self.seam}"

    @property
    def world_size(self) -> int:
        return 1 if self.reduction == "local" else 2


def cells(reduction: str):
    return [Cell(m, reduction, k, s) for m, k, s in itertools.product(MODES, MECHANISMS, SEAMS)]


def dataset() -> TensorDataset:
    """Distinct rows (so the oracle can name each drawn example by its features)."""
    g = torch.Generator().manual_seed(4321)
    return TensorDataset(torch.randn(N_SAMPLES, N_IN, generator=g) * 2,
                         torch.randint(0, N_CLASSES, (N_SAMPLES,), generator=g))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(N_IN, 8), nn.Tanh(), nn.Linear(8, N_CLASSES))


def batch_size_of(cell: Cell) -> int:
    """The user's batch size: small for ``empty`` (local batches often empty), else 8 globally."""
    per_world = 1 if cell.seam == "empty" else 8
    return per_world if cell.reduction != "ddp" else max(per_world // cell.world_size, 1)


def _loader(cell: Cell, data) -> DataLoader:
    if cell.reduction == "ddp":
        return DataLoader(data, batch_size=batch_size_of(cell), sampler=DistributedSampler(data, shuffle=False))
    return DataLoader(data, batch_size=batch_size_of(cell))


def _full(module: nn.Module):
    return [p.full_tensor().detach().clone() if hasattr(p, "full_tensor") else p.detach().clone()
            for p in module.parameters()]


def build(cell: Cell, rank: int, seed: int):
    """``(engine, module, optimizer, criterion, loader)`` of ``make_private`` for ``cell``."""
    model = make_model()
    if cell.reduction == "ddp":
        model = DifferentiallyPrivateDistributedDataParallel(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(accountant="rdp")
        torch.manual_seed(seed)  # every rank alike: the distributed samplers share their draws
        extra = {"bands": BANDS} if cell.mechanism == "banded" else {}
        if cell.mechanism != "independent":
            extra["epochs"] = 2
        if cell.reduction != "local":
            extra["step_timeout"] = STEP_TIMEOUT_S
        criterion = nn.CrossEntropyLoss()
        out = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
            data_loader=_loader(cell, dataset()), noise_multiplier=0.0, max_grad_norm=CLIP,
            grad_sample_mode=cell.mode, noise_mechanism=cell.mechanism, fsdp=cell.reduction == "fsdp2",
            **({"criterion": criterion} if cell.mode == "ghost" else {}), **extra)
    return engine, out[0], out[1], (out[2] if cell.mode == "ghost" else criterion), out[-1]


class Recorder:
    """The physical batches of each logical step and the seams' evidence."""

    def __init__(self):
        self.steps, self.current, self.empty_local, self.pieces = [], [], 0, 0

    def piece(self, x, y):
        self.current.append((x.detach().clone(), y.clone()))
        self.pieces += 1
        self.empty_local += int(len(x) == 0)

    def stepped(self):
        self.steps.append(self.current)
        self.current = []


def _backward(cell: Cell, module, criterion, x, y, scaler):
    if scaler is None:
        criterion(module(x), y).backward()
        return
    with torch.autocast("cpu", dtype=torch.float16):
        out = module(x)
    loss = criterion(out.float(), y)
    scaler.scale(getattr(loss, "value", loss)).backward()


def _train(cell, engine, module, optimizer, criterion, loader, record: Recorder, steps: int, scaler=None):
    """``steps`` logical steps; BatchMemoryManager cuts batches into pieces of 2 for ``bmm``."""
    def one(x, y):
        record.piece(x, y)
        _backward(cell, module, criterion, x, y, scaler)
        before = len(engine.accountant)
        scaler.step(optimizer) if scaler is not None else optimizer.step()
        if scaler is not None:
            scaler.update()
        optimizer.zero_grad()
        if len(engine.accountant) > before:
            record.stepped()
        return len(record.steps) >= steps

    if cell.seam == "bmm":
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=2, optimizer=optimizer) as pieces:
            for x, y in pieces:
                if one(x, y):
                    return
    while True:
        for x, y in loader:
            if one(x, y):
                return


def steps_of(cell: Cell) -> int:
    return EMPTY_STEPS if cell.seam == "empty" else STEPS


def _checkpoint_path(cell: Cell, rank: int, directory: str) -> str:
    return os.path.join(directory, cell.name + (".d" if cell.reduction == "fsdp2" else ".pt"))


def run_cell(cell: Cell, rank: int, directory: str) -> dict:
    """Train ``cell``; a refusal of ``make_private`` is reported, anything later raises."""
    try:
        engine, module, optimizer, criterion, loader = build(cell, rank, seed=17)
    except (ValueError, TypeError, NotImplementedError) as error:
        return {"refused": type(error).__name__, "message": str(error)}
    start, record = _full(module), Recorder()
    scaler = torch.amp.GradScaler("cpu") if cell.seam == "fp16" else None
    if cell.seam != "resume":
        _train(cell, engine, module, optimizer, criterion, loader, record, steps_of(cell), scaler)
    else:  # stop mid-pass and mid-round (RESUME_AT is odd), resume in a fresh engine
        _train(cell, engine, module, optimizer, criterion, loader, record, RESUME_AT)
        path = _checkpoint_path(cell, rank, directory)
        if cell.reduction != "ddp" or rank == 0:
            engine.save_checkpoint(path=path, module=module, optimizer=optimizer)
        if cell.reduction == "ddp":
            dist.barrier()
        engine, module, optimizer, criterion, loader = build(cell, rank, seed=99)  # a fresh process's state
        engine.load_checkpoint(path=path, module=module, optimizer=optimizer)
        _train(cell, engine, module, optimizer, criterion, loader, record, STEPS)
    return {"start": start, "final": _full(module), "batches": record.steps, "pieces": record.pieces,
            "empty_local": record.empty_local, "history": list(engine.accountant.history),
            "divisor": optimizer.expected_batch_size * cell.world_size,
            "scale": None if scaler is None else scaler.get_scale()}


def run_cells(rank: int, world_size: int, reduction: str, progress: str, only=None) -> dict:
    """The cells of ``reduction`` named in ``only`` (default all), in turn, until one raises: the
    ranks may then be out of step, so the job ends there and the parent starts another for the
    cells left. Each rank appends the cell it starts to ``progress`` so that a hang names its cell."""
    warnings.filterwarnings("ignore", message="GradScaler is going to stop", category=FutureWarning)
    results = {}
    with tempfile.TemporaryDirectory() as local:
        directory = local if reduction == "local" else os.path.dirname(progress)
        for cell in cells(reduction):
            if only is not None and cell.name not in only:
                continue
            with open(f"{progress}.rank{rank}", "a") as handle:
                handle.write(cell.name + "\n")
            try:
                results[cell.name] = run_cell(cell, rank, directory)
            except Exception as error:  # reported per cell; the parent fails that cell
                where = traceback.extract_tb(error.__traceback__)[-3:]
                results[cell.name] = {"error": f"{type(error).__name__}: {error} (at "
                                      + "; ".join(f"{f.filename}:{f.lineno}" for f in where) + ")"}
                break
    return results
