"""Functions run on every rank of a spawned gloo job (see ``spawn.run_on_ranks``).

Each rank trains on its OWN data with clipping active and reports what the parent test
needs to compare against a single-process oracle: the starting parameters (rank 0's, after
the wrapper's broadcast), every physical batch it used, grouped by logical step, the
final parameters and the global divisor ``B_global``.
"""

import warnings

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from opacus_dp import PrivacyEngine
from opacus_dp.data import BatchMemoryManager
from opacus_dp.distributed import DifferentiallyPrivateDistributedDataParallel

N_FEATURES, N_CLASSES, N_SAMPLES = 6, 3, 48
LR = 0.5
FLAT_C = 0.5
LAYER_C = 0.3
ADAPTIVE = {"target_unclipped_quantile": 0.5, "clipbound_learning_rate": 0.7, "min_clipbound": 0.05,
            "max_clipbound": 5.0}


def dataset(n: int = N_SAMPLES, features: int = N_FEATURES, seed: int = 1234) -> TensorDataset:
    """The global dataset, identical on every rank and in the parent."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g, dtype=torch.float64) * 3
    y = torch.randint(0, N_CLASSES, (n,), generator=g)
    return TensorDataset(x, y)


def make_model(seed: int, features: int = N_FEATURES) -> nn.Module:
    """A small MLP in float64; ``seed`` differs per rank so the initial broadcast matters."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(features, 8), nn.ReLU(), nn.Linear(8, N_CLASSES)).double()


class WithBuffer(nn.Module):
    """``model`` behind a constant buffer (DDP broadcasts buffers in every forward by default)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.register_buffer("scale", torch.ones(1, dtype=torch.float64))

    def forward(self, x):
        return self.model(x * self.scale)


def wrap(model: nn.Module, wrapper: str) -> nn.Module:
    if wrapper == "ddp":
        return DistributedDataParallel(model)
    if wrapper == "ddp_static_graph":
        return DistributedDataParallel(model, static_graph=True)
    if wrapper == "ddp_find_unused":
        return DistributedDataParallel(model, find_unused_parameters=True)
    return DifferentiallyPrivateDistributedDataParallel(model)


def params_of(module: nn.Module):
    return [p.detach().clone() for p in module.parameters()]


def _quiet_engine(**kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PrivacyEngine(**kwargs)


def _clipping_args(clipping: str, num_tensors: int):
    if clipping in ("flat", "adaptive"):
        return FLAT_C
    return [LAYER_C] * num_tensors


def _adaptive_args(clipping: str, unclipped_num_std: float):
    return dict(ADAPTIVE, unclipped_num_std=unclipped_num_std) if clipping == "adaptive" else {}


def record_logical_steps(engine, module, optimizer, criterion, batches, steps: int, grad_types=None):
    """Train on ``batches`` until ``steps`` released steps; the physical batches of each, in order
    (``grad_types``: a set given the type names of ``p.grad`` after each released step)."""
    logical, current = [], []
    for x, y in batches:
        current.append((x, y))
        criterion(module(x), y).backward()
        before = len(engine.accountant)
        optimizer.step()
        if grad_types is not None and len(engine.accountant) > before:  # a released step set p.grad
            grad_types.update(type(p.grad).__name__ for p in module.parameters())
        optimizer.zero_grad()
        if len(engine.accountant) > before:
            logical.append(current)
            current = []
        if len(logical) == steps:
            break
    return logical


# --------------------------------------------------------------------------- σ = 0 runs
def train_modern(rank, world_size, wrapper, clipping, steps=3, sigma=0.0, physical=2, buffered=False,
                 unclipped_num_std=0.0):
    """make_private + distributed Poisson loader + BatchMemoryManager (virtual steps);
    ``bounds``: the clipping bound after each logical step (it moves with adaptive clipping)."""
    model = make_model(seed=100 + rank)
    model = wrap(WithBuffer(model) if buffered else model, wrapper)
    start = params_of(model)
    data = dataset()
    loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, shuffle=False))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine = _quiet_engine(accountant="rdp")
    torch.manual_seed(7 + rank)  # different Poisson draws on each rank
    gsm, optimizer, dp_loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=sigma,
        max_grad_norm=_clipping_args(clipping, 4), clipping=clipping,
        **_adaptive_args(clipping, unclipped_num_std))
    criterion = nn.CrossEntropyLoss()
    logical, current, bounds = [], [], []
    with BatchMemoryManager(data_loader=dp_loader, max_physical_batch_size=physical,
                            optimizer=optimizer) as physical_loader:
        for x, y in physical_loader:
            current.append((x, y))
            optimizer.zero_grad()
            criterion(gsm(x), y).backward()
            before = len(engine.accountant)
            optimizer.step()
            if len(engine.accountant) > before:
                logical.append(current)
                bounds.append(optimizer.max_grad_norm)
                current = []
            if len(logical) == steps:
                break
    return {"start": start, "batches": logical, "final": params_of(gsm), "bounds": bounds,
            "global_batch": optimizer.expected_batch_size * world_size,
            "epsilon": engine.get_epsilon(1e-5), "sigma": sigma, "sample_rate": dp_loader.sample_rate,
            "reducer_bytes": optimizer.reducer.bytes_reduced,
            "all_reduces": optimizer.reducer.num_all_reduces}


def _rank_batch(rank, step, part, size):
    """Physical batch ``part`` of logical ``step`` on ``rank``: disjoint rows per rank."""
    x, y = dataset().tensors
    offset = ((step * 2 + part) * 2 + rank) * size % (N_SAMPLES - size)
    return x[offset : offset + size], y[offset : offset + size]


def train_classic(rank, world_size, wrapper, clipping, steps=3, per_process_batch=4, sizes=None):
    """Opacus 0.x API: attach, then two physical batches per step (virtual_step + step).

    ``sizes[step][part]`` overrides the physical batch size on this rank (0 = empty batch).
    """
    model = wrap(make_model(seed=200 + rank), wrapper)
    start = params_of(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(model, batch_size=per_process_batch, sample_size=N_SAMPLES,
                               noise_multiplier=0.0, max_grad_norm=_clipping_args(clipping, 4),
                               clip_per_layer=clipping == "per_layer")
        engine.attach(optimizer)
    criterion = nn.CrossEntropyLoss()
    logical = []
    for step in range(steps):
        current = []
        for part in range(2):
            size = per_process_batch // 2 if sizes is None else sizes[step][part]
            x, y = _rank_batch(rank, step, part, size)
            current.append((x, y))
            optimizer.zero_grad()
            criterion(model(x), y).backward()
            optimizer.virtual_step() if part == 0 else optimizer.step()
        logical.append(current)
    return {"start": start, "batches": logical, "final": params_of(model),
            "global_batch": per_process_batch * world_size,
            "epsilon": engine.get_privacy_spent(1e-5)[0], "sample_rate": engine.sample_rate}


def equivalence_job(rank, world_size):
    """Job A: σ = 0, every wrapper × API × clipping, virtual steps everywhere."""
    results = {}
    for wrapper in ("ddp", "dpddp"):
        for clipping in ("flat", "per_layer"):
            results[("modern", wrapper, clipping)] = train_modern(rank, world_size, wrapper, clipping)
            results[("classic", wrapper, clipping)] = train_classic(rank, world_size, wrapper, clipping)
    for wrapper in ("ddp", "dpddp"):  # one-sample pieces: the ranks' piece counts differ
        results[("buffered", wrapper)] = train_modern(rank, world_size, wrapper, "flat", steps=4,
                                                      physical=1, buffered=True)
    results[("classic", "ddp_static_graph", "flat")] = train_classic(rank, world_size, "ddp_static_graph", "flat")
    for wrapper in ("ddp", "dpddp"):  # the bound moves with the count summed over both ranks
        results[("modern", wrapper, "adaptive")] = train_modern(rank, world_size, wrapper, "adaptive", steps=4)
    empty = [[2, 1], [0, 0], [3, 0]] if rank == 1 else [[1, 2], [2, 2], [0, 0]]
    for wrapper in ("ddp", "dpddp"):
        results[("empty", wrapper)] = train_classic(rank, world_size, wrapper, "flat", sizes=empty)
    return results
