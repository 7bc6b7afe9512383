"""Rank functions of the second spawned job: noise, accounting, sampling, checkpoints, errors."""

import os
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from opacus_dp import PrivacyEngine
from opacus_dp.data import DPDataLoader
from tests.distributed.workers import dataset, equivalence_job, make_model, params_of, train_modern, wrap

DELTA = 1e-5
NOISE_FEATURES, NOISE_CLASSES, NOISE_SAMPLES = 150, 100, 64


def _engine(**kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PrivacyEngine(**kwargs)


def _gathered(tensor: torch.Tensor):
    rows = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, tensor.contiguous())
    return rows


def noise_run(rank, world_size, wrapper, accountant, sigma=1.0, steps=3):
    """σ > 0: one recorded step (for the noise std), then more steps (for ε)."""
    torch.manual_seed(300 + rank)
    model = wrap(nn.Linear(NOISE_FEATURES, NOISE_CLASSES, bias=False).double(), wrapper)
    start = params_of(model)
    data = dataset(NOISE_SAMPLES, NOISE_FEATURES, seed=99)
    data = TensorDataset(data.tensors[0], data.tensors[1] * 33)  # labels in 0..99
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, shuffle=False))
    engine = _engine(accountant=accountant)
    gsm, optimizer, dp_loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), data_loader=loader,
        noise_multiplier=sigma, max_grad_norm=1.0)
    result = {"start": start, "global_batch": optimizer.expected_batch_size * world_size,
              "sample_rate": dp_loader.sample_rate, "sigma": sigma}
    for step, (x, y) in enumerate(dp_loader):
        optimizer.zero_grad()
        nn.CrossEntropyLoss()(gsm(x), y).backward()
        grad = next(gsm.parameters()).grad
        if step == 0 and grad is not None:  # DPDDP: autograd computed no weight gradient at all
            grads = _gathered(grad)
            result["ddp_grads_stayed_local"] = not torch.equal(grads[0], grads[1])
        optimizer.step()
        if step == 0:
            result.update(batch=(x, y), after_first=params_of(gsm))
        if step + 1 == steps:
            break
    result.update(final=params_of(gsm), epsilon=engine.get_epsilon(DELTA),
                  history=list(engine.accountant.history), steps=len(engine.accountant))
    return result


def secure_run(rank, world_size, fast_noise=False):
    """secure_mode: OS-seeded noise on rank 0 only; ranks must stay bit-identical."""
    model = wrap(make_model(seed=400 + rank), "dpddp")
    data = dataset()
    loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data))
    engine = _engine(secure_mode=True)
    gsm, optimizer, dp_loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
        noise_multiplier=1.0, max_grad_norm=1.0, fast_noise=fast_noise)
    for step, (x, y) in enumerate(dp_loader):
        optimizer.zero_grad()
        nn.CrossEntropyLoss()(gsm(x), y).backward()
        optimizer.step()
        if step == 1:
            break
    return params_of(gsm)


def empty_poisson_run(rank, world_size):
    """Tiny per-rank shards and q = 1/8: local batches are often empty; ranks stay in step."""
    model = wrap(make_model(seed=500 + rank), "ddp")
    data = dataset(16)
    loader = DataLoader(data, batch_size=1, sampler=DistributedSampler(data))
    engine = _engine(accountant="rdp")
    torch.manual_seed(rank)
    gsm, optimizer, dp_loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), data_loader=loader,
        noise_multiplier=0.5, max_grad_norm=1.0)
    sizes = []
    for x, y in dp_loader:
        sizes.append(len(x))
        optimizer.zero_grad()
        nn.CrossEntropyLoss(reduction="sum")(gsm(x), y).backward()
        optimizer.step()
    return {"sizes": sizes, "final": params_of(gsm), "steps": len(engine.accountant)}


def sampler_run(rank, world_size, total=200, rate=0.1):
    """DPDataLoader(distributed=True) over indices: shards, disjointness, set_epoch."""
    indices = TensorDataset(torch.arange(total))
    loader = DPDataLoader(indices, sample_rate=rate, distributed=True,
                          generator=torch.Generator().manual_seed(5))
    sampler = loader.batch_sampler
    epochs = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        shard = sampler.shard_indices().tolist()
        epochs.append({"shard": shard, "batches": [b[0].tolist() for b in loader]})
    return epochs


def checkpoint_run(rank, world_size, path):
    """Rank 0 saves after two steps; every rank resumes from the file and takes a third; the
    same run uninterrupted for comparison (the ranks are seeded differently)."""
    def build(seed):
        model = wrap(make_model(seed=seed), "ddp")
        data = dataset()
        loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data))
        engine = _engine(accountant="rdp")
        gsm, optimizer, dp_loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9),
            data_loader=loader, noise_multiplier=0.7, max_grad_norm=1.0)
        return engine, gsm, optimizer, dp_loader

    def train(gsm, optimizer, dp_loader, steps):
        for step, (x, y) in enumerate(dp_loader):
            optimizer.zero_grad()
            nn.CrossEntropyLoss()(gsm(x), y).backward()
            optimizer.step()
            if step + 1 == steps:
                return

    engine, gsm, optimizer, dp_loader = build(seed=600 + rank)
    train(gsm, optimizer, dp_loader, 3)
    uninterrupted = params_of(gsm)
    engine, gsm, optimizer, dp_loader = build(seed=600 + rank)
    train(gsm, optimizer, dp_loader, 2)
    saved = params_of(gsm)
    if rank == 0:
        engine.save_checkpoint(path=path, module=gsm, optimizer=optimizer)
    dist.barrier()
    engine2, gsm2, optimizer2, dp_loader2 = build(seed=700 + rank)
    engine2.load_checkpoint(path=path, module=gsm2, optimizer=optimizer2)
    loaded = params_of(gsm2)
    train(gsm2, optimizer2, dp_loader2, 1)
    result = {"saved": saved, "loaded": loaded, "resumed": params_of(gsm2), "uninterrupted": uninterrupted,
              "history": list(engine2.accountant.history), "epsilon": engine2.get_epsilon(DELTA)}
    result["saved_by_rank_1"] = _resume_from_rank_1(rank, path + ".rank1", build, train)
    result["loaded_on_rank_0_only"] = _resume_on_rank_0_only(rank, path, build, train)
    return result


def _resume_from_rank_1(rank, path, build, train):
    """Rank 1 (which draws no noise under DDP) saves after two steps; every rank loads: the
    error of each rank's load (None: loaded)."""
    engine, gsm, optimizer, dp_loader = build(seed=600 + rank)
    train(gsm, optimizer, dp_loader, 2)
    if rank == 1:
        engine.save_checkpoint(path=path, module=gsm, optimizer=optimizer)
    dist.barrier()
    engine, gsm, optimizer, _ = build(seed=700 + rank)
    return _error_of(lambda: engine.load_checkpoint(path=path, module=gsm, optimizer=optimizer))


def _resume_on_rank_0_only(rank, path, build, train):
    """Rank 0 resumes from the checkpoint, rank 1 starts afresh; both take a step: its error on
    each rank, and the steps each accountant holds."""
    engine, gsm, optimizer, dp_loader = build(seed=700 + rank)
    if rank == 0:
        engine.load_checkpoint(path=path, module=gsm, optimizer=optimizer)
    error = _error_of(lambda: train(gsm, optimizer, dp_loader, 1))
    return {"error": error, "steps": len(engine.accountant)}


def classic_epsilon_run(rank, world_size, steps=3, per_process_batch=4):
    """Opacus 0.x API with σ > 0: q = batch_size · world_size / sample_size, RDP over alphas."""
    model = wrap(make_model(seed=800 + rank), "dpddp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(model, batch_size=per_process_batch, sample_size=48,
                               noise_multiplier=0.9, max_grad_norm=1.0)
        engine.attach(optimizer)
    x, y = dataset().tensors
    for step in range(steps):
        rows = slice((2 * step + rank) * per_process_batch, (2 * step + rank + 1) * per_process_batch)
        optimizer.zero_grad()
        nn.CrossEntropyLoss()(model(x[rows]), y[rows]).backward()
        optimizer.step()
    return {"epsilon": engine.get_privacy_spent(DELTA), "sample_rate": engine.sample_rate,
            "alphas": list(engine.alphas), "history": list(engine.accountant.history),
            "final": params_of(model)}


def classic_noise_run(rank, world_size, fast_noise, per_process_batch=8):
    """Opacus 0.x API under DDP with σ = 1 and a fast noise: one step on disjoint rows per rank
    (for the noise std of the global step)."""
    torch.manual_seed(900 + rank)
    model = wrap(nn.Linear(NOISE_FEATURES, NOISE_CLASSES, bias=False).double(), "ddp")
    start = params_of(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(model, batch_size=per_process_batch, sample_size=NOISE_SAMPLES,
                               noise_multiplier=1.0, max_grad_norm=1.0, fast_noise=fast_noise)
        engine.attach(optimizer)
    data = dataset(NOISE_SAMPLES, NOISE_FEATURES, seed=98)
    rows = slice(rank * per_process_batch, (rank + 1) * per_process_batch)
    x, y = data.tensors[0][rows], data.tensors[1][rows] * 33
    optimizer.zero_grad()
    nn.CrossEntropyLoss()(model(x), y).backward()
    optimizer.step()
    return {"start": start, "batch": (x, y), "after_first": params_of(model), "sigma": 1.0,
            "global_batch": per_process_batch * world_size}


def _error_of(fn):
    try:
        fn()
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def error_runs(rank, world_size):
    """Misconfigurations that must be refused on every rank (and never hang)."""
    data = dataset()

    def classic_sample_size_differs():
        model = wrap(make_model(seed=1), "dpddp")
        engine = PrivacyEngine(model, batch_size=4, sample_size=48 + rank, noise_multiplier=1.0,
                               max_grad_norm=1.0)
        engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))

    def modern(model, sigma=1.0, loader=None, poisson=True, **clipping):
        loader = loader or DataLoader(data, batch_size=4, sampler=DistributedSampler(data))
        _engine(accountant="rdp").make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader, noise_multiplier=sigma, max_grad_norm=1.0, poisson_sampling=poisson,
            **clipping)

    def changed_in_training(change, passes=(1, 1)):
        """Set up alike on every rank, then ``change(optimizer)`` on rank 0 only, or run
        ``passes[rank]`` backward passes before the step; train two steps."""
        model = wrap(make_model(1), "dpddp")
        engine = _engine(accountant="rdp")
        _, optimizer, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=4, sampler=DistributedSampler(data)),
            noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False)
        batches = iter(loader)
        for _ in range(2):
            for _ in range(passes[rank]):
                x, y = next(batches)
                nn.CrossEntropyLoss()(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            if rank == 0:
                change(optimizer)

    def set_attribute(name, value):
        return lambda optimizer: setattr(optimizer, name, value)

    wrong_world = DataLoader(data, batch_size=4,
                             sampler=DistributedSampler(data, num_replicas=world_size + 1, rank=rank))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {
            "sample_rate": _error_of(classic_sample_size_differs),
            "noise_multiplier": _error_of(lambda: modern(wrap(make_model(1), "ddp"), sigma=1.0 + rank)),
            "unwrapped": _error_of(lambda: modern(make_model(1))),
            "loader_world_size": _error_of(
                lambda: modern(wrap(make_model(1), "dpddp"), loader=wrong_world, poisson=False)),
            "poisson_on_one_rank": _error_of(
                lambda: modern(wrap(make_model(1), "dpddp"), poisson=rank == 0)),
            "adaptive_quantile_differs": _error_of(
                lambda: modern(wrap(make_model(1), "ddp"), sigma=0.5, clipping="adaptive",
                               target_unclipped_quantile=0.5 + 0.1 * rank)),
            "adaptive_on_one_rank": _error_of(
                lambda: modern(wrap(make_model(1), "ddp"), sigma=0.5, clipping="adaptive" if rank else "flat")),
            "sigma_changed_on_one_rank": _error_of(
                lambda: changed_in_training(set_attribute("noise_multiplier", 0.5))),
            "bound_changed_on_one_rank": _error_of(
                lambda: changed_in_training(set_attribute("max_grad_norm", 0.1))),
            "uneven_accumulation": _error_of(
                lambda: changed_in_training(lambda optimizer: None, passes=(2, 1))),
        }


def privacy_job(rank, world_size, checkpoint_dir):
    """Job B: everything with σ > 0 or misconfiguration, one spawn for all."""
    return {
        "noise_ddp": noise_run(rank, world_size, "ddp", accountant="prv"),
        "noise_dpddp": noise_run(rank, world_size, "dpddp", accountant="rdp"),
        "classic": classic_epsilon_run(rank, world_size),
        "secure": secure_run(rank, world_size),
        "secure_philox": secure_run(rank, world_size, fast_noise="philox"),
        "classic_philox": classic_noise_run(rank, world_size, fast_noise="philox"),
        "classic_threads": classic_noise_run(rank, world_size, fast_noise=True),
        "empty_poisson": empty_poisson_run(rank, world_size),
        "sampler": sampler_run(rank, world_size),
        "checkpoint": checkpoint_run(rank, world_size, os.path.join(checkpoint_dir, "ckpt.pt")),
        "adaptive_noise": train_modern(rank, world_size, "ddp", "adaptive", steps=3, sigma=1.0,
                                       unclipped_num_std=2.0),
        "errors": error_runs(rank, world_size),
    }


def distributed_job(rank, world_size, checkpoint_dir):
    """The only spawned job of the test suite: job A (σ = 0 equivalence) and job B."""
    return {"equivalence": equivalence_job(rank, world_size),
            "privacy": privacy_job(rank, world_size, checkpoint_dir)}
