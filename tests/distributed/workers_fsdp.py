"""Functions run on every rank of a spawned gloo job for the FSDP2 tests (``test_fsdp.py``).

Each rank trains a model sharded with ``fully_shard`` (blocks, then the root) on its OWN share of
a distributed Poisson batch, clipping active, and reports what the parent compares with a
single-process oracle: the starting and final parameters (gathered whole), every physical batch
grouped by logical step, the global divisor, ε, the reducer's counters and noise samples.
"""

import os
import warnings

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp import PrivacyEngine
from opacus_dp.data import BatchMemoryManager
from tests.distributed.workers import record_logical_steps

N_IN, WIDTH, N_CLASSES, N_SAMPLES = 6, 7, 3, 64
LR = 0.5
FLAT_C = 0.4
LAYER_C = 0.25
DELTA = 1e-5


class Block(nn.Module):
    """LayerNorm → Linear → tanh with a residual connection."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.linear(self.norm(x)))


class BlockModel(nn.Module):
    """Linear embedding, a ModuleList of blocks (FSDP2's unit), a linear head."""

    def __init__(self, n_in: int = N_IN, width: int = WIDTH, n_blocks: int = 2, n_out: int = N_CLASSES):
        super().__init__()
        self.embed = nn.Linear(n_in, width)
        self.blocks = nn.ModuleList([Block(width) for _ in range(n_blocks)])
        self.head = nn.Linear(width, n_out)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def make_model(seed: int = 0, **sizes) -> BlockModel:
    torch.manual_seed(seed)
    return BlockModel(**sizes)


def num_tensors(model: nn.Module) -> int:
    return sum(1 for _ in model.parameters())


def dataset(n: int = N_SAMPLES, seed: int = 1234) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, N_IN, generator=g) * 3, torch.randint(0, N_CLASSES, (n,), generator=g))


def full_params(module: nn.Module):
    """Every parameter whole (gathered from the shards), in ``parameters()`` order."""
    return [p.full_tensor().detach().clone() if hasattr(p, "full_tensor") else p.detach().clone()
            for p in module.parameters()]


def shard_by_hand(model: nn.Module, leaves: bool = False, **kwargs) -> nn.Module:
    """The recipe of torch's FSDP2 documentation, applied by the user; with ``leaves``, every
    ``Linear`` and ``LayerNorm`` is passed to ``fully_shard`` itself first (FSDP2's ``FSDPLinear``...)."""
    for leaf in (m for m in model.modules() if leaves and isinstance(m, (nn.Linear, nn.LayerNorm))):
        fully_shard(leaf, **kwargs)
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _engine(**kwargs) -> PrivacyEngine:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PrivacyEngine(**kwargs)


def private(model, *, mode="bk", clipping="flat", sigma=0.0, fsdp=True, seed=7, batch_size=8,
            generator=None, secure=False, accountant="rdp", optimizer_class=torch.optim.SGD, fast_noise=False,
            skip_weight_grads=None):
    """``make_private`` on ``model``; returns ``(engine, module, optimizer, criterion, loader)``."""
    optimizer = optimizer_class(model.parameters(), lr=LR)
    engine = _engine(accountant=accountant, secure_mode=secure)
    bound = FLAT_C if clipping == "flat" else [LAYER_C] * num_tensors(model)
    torch.manual_seed(seed)
    out = engine.make_private(module=model, optimizer=optimizer, data_loader=DataLoader(dataset(), batch_size=batch_size),
                              noise_multiplier=sigma, max_grad_norm=bound, clipping=clipping,
                              grad_sample_mode=mode, fsdp=fsdp, noise_generator=generator, fast_noise=fast_noise,
                              skip_weight_grads=skip_weight_grads)
    criterion = out[2] if mode == "ghost" else nn.CrossEntropyLoss()
    return engine, out[0], out[1], criterion, out[-1]


def train_sigma_zero(rank, world_size, mode, clipping, steps=3, physical=2, sharding="flag", skip_weight_grads=None):
    """σ = 0 with BatchMemoryManager virtual steps; ``sharding``: "flag" (fsdp=True), "hand" or "leaves"
    (:func:`shard_by_hand`);
    ``skip_weight_grads``: ``make_private``'s."""
    model = make_model(seed=0)
    start = full_params(model)
    if sharding in ("hand", "leaves"):
        shard_by_hand(model, leaves=sharding == "leaves")
    engine, module, optimizer, criterion, loader = private(model, mode=mode, clipping=clipping, fsdp=sharding == "flag",
                                                           seed=11 + rank, skip_weight_grads=skip_weight_grads)
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=physical, optimizer=optimizer) as pieces:
        grad_types = set()
        logical = record_logical_steps(engine, module, optimizer, criterion, pieces, steps, grad_types)
    return {"start": start, "batches": logical, "final": full_params(module),
            "global_batch": optimizer.expected_batch_size * world_size,
            "epsilon": engine.get_epsilon(DELTA), "sample_rate": loader.sample_rate, "steps": len(logical),
            "reduce_scatters": optimizer.reducer.num_reduce_scatters,
            "bytes": optimizer.reducer.bytes_reduced, "grad_types": sorted(grad_types)}


def per_sample_state(rank, world_size, mode):
    """After one backward pass in ``mode``: the wrapper's class and the shapes of the per-sample
    gradients it kept (``p.grad_sample``) per parameter, None where it kept none."""
    engine, module, optimizer, criterion, loader = private(make_model(seed=0), mode=mode)
    x, y = next(iter(loader))
    criterion(module(x), y).backward()
    kept = [getattr(p, "grad_sample", None) for p in module.parameters()]
    return {"wrapper": type(module).__name__, "rows": len(x),
            "kept": [None if g is None else tuple(g.shape) for g in kept]}


def noise_samples(rank, world_size, steps=3, sigma=1.3, seed_everywhere=True, secure=False, fast_noise=False):
    """σ > 0 on a zero loss (``0 · output``): each step's gradient is the noise alone, divided by
    the global expected batch. Every rank seeds alike (and passes an identically seeded
    generator) unless ``seed_everywhere`` is False. Returns this rank's local shards per step."""
    torch.manual_seed(0)
    model = BlockModel(width=256, n_blocks=1, n_out=64)
    generator = None if secure else torch.Generator().manual_seed(1 if seed_everywhere else 1 + rank)
    engine, module, optimizer, _, loader = private(model, sigma=sigma, generator=generator, secure=secure,
                                                   seed=3 if seed_everywhere else 3 + rank, fast_noise=fast_noise)
    draws = []
    for step, (x, _) in enumerate(loader):
        (module(x) * 0).sum().backward()
        optimizer.step()
        draws.append([p.grad.to_local().detach().clone().reshape(-1) for p in module.parameters()])
        optimizer.zero_grad()
        if step + 1 == steps:
            break
    return {"draws": draws, "global_batch": optimizer.expected_batch_size * world_size,
            "std": sigma * FLAT_C, "epsilon": engine.get_epsilon(DELTA), "sample_rate": loader.sample_rate,
            "steps": len(engine.accountant), "sigma": sigma}


def _train_steps(engine, module, optimizer, criterion, loader, steps):
    done = 0
    for x, y in loader:
        criterion(module(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        done += 1
        if done == steps:
            return


def resume_run(rank, world_size, directory, mode, part):
    """``part``: "whole" (4 steps), "first" (2 steps, then a checkpoint) or "second" (a fresh
    model and engine load the checkpoint, then 2 steps). Adam, σ > 0: the noise streams, the
    sampler and the optimizer state must all resume."""
    model = make_model(seed=0 if part != "second" else 99)
    built = private(model, mode=mode, sigma=0.8, seed=5 if part != "second" else 55,
                    optimizer_class=torch.optim.Adam)
    engine, module, optimizer, criterion, loader = built
    if part == "second":
        engine.load_checkpoint(path=directory, module=module, optimizer=optimizer)
    _train_steps(engine, module, optimizer, criterion, loader, 4 if part == "whole" else 2)
    if part == "first":
        engine.save_checkpoint(path=directory, module=module, optimizer=optimizer)
    return {"final": full_params(module), "epsilon": engine.get_epsilon(DELTA), "steps": len(engine.accountant),
            "files": sorted(os.listdir(directory)) if part == "first" else None}


def bf16_sigma_zero(rank, world_size, mode="bk", steps=2):
    """σ = 0 with bf16 parameters in forward/backward (MixedPrecisionPolicy), float32 shards."""
    model = make_model(seed=0)
    start = full_params(model)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine = _engine(accountant="rdp")
    torch.manual_seed(21 + rank)
    module, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=DataLoader(dataset(), batch_size=8), noise_multiplier=0.0,
        max_grad_norm=FLAT_C, grad_sample_mode=mode, fsdp={"mp_policy": policy})
    batches = []
    for x, y in loader:
        batches.append([(x, y)])
        nn.CrossEntropyLoss()(module(x).float(), y).backward()
        optimizer.step()
        grad_dtypes = sorted({str(p.grad.dtype) for p in module.parameters()})
        optimizer.zero_grad()
        if len(batches) == steps:
            break
    return {"start": start, "batches": batches, "final": full_params(module), "grad_dtypes": grad_dtypes,
            "global_batch": optimizer.expected_batch_size * world_size}


def empty_local_batch(rank, world_size, steps=3):
    """Rank 1's local batch is empty at step 1 (as Poisson sampling may draw): every rank still
    takes part in the step, which stays in step with the others (σ = 0)."""
    model = make_model(seed=0)
    start = full_params(model)
    engine, module, optimizer, criterion, _ = private(model, seed=0)
    x, y = dataset().tensors
    batches = []
    for step in range(steps):
        size = 0 if (rank == 1 and step == 1) else 3
        offset = (step * world_size + rank) * 3
        xb, yb = x[offset: offset + size], y[offset: offset + size]
        batches.append([(xb, yb)])
        criterion(module(xb), yb).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {"start": start, "batches": batches, "final": full_params(module),
            "global_batch": optimizer.expected_batch_size * world_size, "steps": len(engine.accountant)}


def classic_attach(rank, world_size, steps=2, per_process_batch=4, flag=False):
    """Opacus 0.x API: attach, virtual_step + step (σ = 0), on a model the user sharded, or
    (``flag``) on an unsharded one with ``fsdp=True`` and the optimizer built before the engine."""
    model = make_model(seed=0) if flag else shard_by_hand(make_model(seed=0))
    start = full_params(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(model, batch_size=per_process_batch, sample_size=N_SAMPLES,
                               noise_multiplier=0.0, max_grad_norm=FLAT_C, fsdp=flag)
        engine.attach(optimizer)
    x, y = dataset().tensors
    batches = []
    for step in range(steps):
        current = []
        for part in range(2):
            offset = ((step * 2 + part) * world_size + rank) * 2
            current.append((x[offset: offset + 2], y[offset: offset + 2]))
            nn.CrossEntropyLoss()(model(current[-1][0]), current[-1][1]).backward()
            optimizer.virtual_step() if part == 0 else optimizer.step()
        batches.append(current)
    return {"start": start, "batches": batches, "final": full_params(model),
            "global_batch": per_process_batch * world_size, "sample_rate": engine.sample_rate,
            "epsilon": engine.get_privacy_spent(DELTA)[0]}


def _refused(build) -> str:
    try:
        build()
    except (ValueError, TypeError) as error:
        return str(error)
    return ""


def refusals(rank, world_size):
    """What make_private refuses under FSDP2, and the message each rank gets."""
    def adaptive():
        model = make_model()
        engine = _engine()
        engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                            data_loader=DataLoader(dataset(), batch_size=8), noise_multiplier=1.0,
                            max_grad_norm=1.0, clipping="adaptive", fsdp=True)

    def twice():
        private(shard_by_hand(make_model()), fsdp=True)

    def root_not_sharded():
        model = make_model()
        for block in model.blocks:
            fully_shard(block)
        private(model, fsdp=False)

    def stepped_optimizer():
        model = make_model()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
        model(torch.randn(2, N_IN)).sum().backward()
        optimizer.step()
        _engine().make_private(module=model, optimizer=optimizer, data_loader=DataLoader(dataset(), batch_size=8),
                               noise_multiplier=1.0, max_grad_norm=1.0, fsdp=True)

    def unknown_option():
        private(make_model(), fsdp={"sharding": "full"})

    return {name: _refused(fn) for name, fn in (("adaptive", adaptive), ("twice", twice),
                                                 ("root_not_sharded", root_not_sharded),
                                                 ("stepped_optimizer", stepped_optimizer),
                                                 ("unknown_option", unknown_option))}


def disagreement(rank, world_size):
    """Rank 1 changes σ after the first step: the next step raises on every rank before any
    gradient moves, and the ranks go on in step once they agree again."""
    engine, module, optimizer, criterion, loader = private(make_model(), sigma=1.0)
    errors, params = [], []
    for step, (x, y) in enumerate(loader):
        if step == 1 and rank == 1:
            optimizer.noise_multiplier = 2.0
        criterion(module(x), y).backward()
        try:
            optimizer.step()
        except ValueError as error:
            errors.append(str(error))
            optimizer.noise_multiplier = 1.0
            params.append(full_params(module))
        optimizer.zero_grad()
        if step == 2:
            break
    return {"errors": errors, "steps": len(engine.accountant), "after_refusal": params}


def fsdp_job(rank, world_size, directory):
    """Every FSDP2 check in one spawned job (a spawn costs seconds)."""
    results = {}
    for mode in ("bk", "ghost", "hooks", "functorch"):
        for clipping in ("flat", "per_layer"):
            results[("sigma0", mode, clipping)] = train_sigma_zero(rank, world_size, mode, clipping)
    for mode in ("hooks", "functorch"):
        results[("per_sample_state", mode)] = per_sample_state(rank, world_size, mode)
    results[("sigma0", "hooks", "flat", "weight_grads")] = train_sigma_zero(rank, world_size, "hooks", "flat",
                                                                            skip_weight_grads=False)
    results[("sigma0", "bk", "flat", "hand")] = train_sigma_zero(rank, world_size, "bk", "flat", sharding="hand")
    for mode in ("bk", "hooks"):
        results[("sigma0", mode, "flat", "leaves")] = train_sigma_zero(rank, world_size, mode, "flat", sharding="leaves")
    results["noise"] = noise_samples(rank, world_size)
    results["noise_secure"] = noise_samples(rank, world_size, secure=True)
    results["noise_philox"] = noise_samples(rank, world_size, fast_noise="philox")
    results["noise_philox_secure"] = noise_samples(rank, world_size, secure=True, fast_noise="philox")
    results["noise_threads"] = noise_samples(rank, world_size, fast_noise=True)
    for mode in ("bk", "hooks"):
        for part in ("whole", "first", "second"):
            results[("resume", mode, part)] = resume_run(rank, world_size, os.path.join(directory, mode), mode, part)
    results["bf16"] = bf16_sigma_zero(rank, world_size)
    results["empty"] = empty_local_batch(rank, world_size)
    results["classic"] = classic_attach(rank, world_size)
    results["classic_flag"] = classic_attach(rank, world_size, flag=True)
    results["refusals"] = refusals(rank, world_size)
    results["disagreement"] = disagreement(rank, world_size)
    return results
