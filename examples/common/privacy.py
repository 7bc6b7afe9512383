"""Wiring of a training run with either PrivacyEngine API, or without privacy.

* modern (Opacus 1.x): ``PrivacyEngine(accountant=...)``, then ``make_private`` (σ given) or
  ``make_private_with_epsilon`` (σ calibrated for ``--epochs``); physical batches through
  ``BatchMemoryManager``;
* classic (Opacus 0.x): ``PrivacyEngine(model, sample_rate=q, sample_size=N, ...)`` then
  ``attach(optimizer)``; physical batches by ``optimizer.virtual_step()``;
* ``--disable-dp``: plain shuffled batches and the plain optimizer.

Private runs always sample Poisson batches (``DPDataLoader``): each example joins each step
independently with probability q, which is what the accountant assumes.
"""

import argparse
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from common.cli import physical_batch_limit, sample_rate_of, sampling_notes
from common.distributed import Distributed
from common.notices import engine_notices, say_error


@dataclass
class TrainingRun:
    """Everything the training loop needs; ``engine`` is None without privacy."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    train_loader: DataLoader
    api: str  # "modern", "classic" or "none"
    delta: float
    engine: Optional[object] = None
    physical_limit: Optional[int] = None
    sample_rate: Optional[float] = None
    grad_sample_mode: Optional[str] = None  # the engine's, as it was built

    @property
    def private(self) -> bool:
        return self.engine is not None

    @property
    def noise_multiplier(self) -> Optional[float]:
        if self.api == "modern":
            return float(self.optimizer.noise_multiplier)
        return float(self.engine.noise_multiplier) if self.private else None

    def accounted_steps(self) -> int:
        """Private steps recorded by the accountant so far (a step split for memory is one)."""
        return len(self.engine.accountant) if self.private else 0

    def epsilon(self) -> float:
        """ε spent so far at δ (0 before the first step, NaN without privacy)."""
        if self.private and len(self.engine.accountant) == 0:
            return 0.0
        if self.api == "modern":
            return float(self.engine.get_epsilon(self.delta))
        if self.api == "classic":
            return float(self.engine.get_privacy_spent(self.delta)[0])
        return math.nan

    def privacy_summary(self) -> dict:
        """What an independent check needs to recompute ε: accountant, history, δ."""
        if not self.private:
            return {"private": False}
        summary = {
            "private": True, "api": self.api, "accountant": self.engine.accountant.mechanism(),
            "history": [list(record) for record in self.engine.accountant.history],
            "steps": len(self.engine.accountant), "delta": self.delta,
            "noise_multiplier": self.noise_multiplier, "sample_rate": self.sample_rate,
            "grad_sample_mode": self.grad_sample_mode,
        }
        if self.api == "classic":
            summary["alphas"] = list(self.engine.alphas)
        return summary


def _sampling_generator(args: argparse.Namespace) -> torch.Generator:
    """Seeded, or with ``--secure-rng`` its whole state drawn from the OS (``manual_seed`` keeps
    32 bits of a seed)."""
    if not args.secure_rng:
        return torch.Generator().manual_seed(args.seed)
    from opacus_dp.engine.optimizer import secure_generator

    return secure_generator()


def _noise_generator(args: argparse.Namespace, device: torch.device) -> Optional[torch.Generator]:
    """Seeded generator of the Gaussian noise, on the parameters' device (None: secure mode)."""
    return None if args.secure_rng else torch.Generator(device=device).manual_seed(args.seed + 1)


def fast_noise_of(args: argparse.Namespace):
    """``make_private``'s ``fast_noise`` for ``--fast-noise`` (off, threads, philox)."""
    from opacus_dp.engine.fast_noise import fast_noise_setting

    return fast_noise_setting(getattr(args, "fast_noise", "off"), "--fast-noise")


def _plain_loader(args, train_set: Dataset, setup: Distributed, collate_fn) -> DataLoader:
    generator = torch.Generator().manual_seed(args.seed)
    sampler = DistributedSampler(train_set, seed=args.seed) if setup.active else None
    return DataLoader(train_set, batch_size=args.batch_size * args.n_accumulation_steps,
                      shuffle=sampler is None, sampler=sampler, generator=generator,
                      num_workers=args.workers, collate_fn=collate_fn)


def clipping_bounds(args: argparse.Namespace, model: nn.Module):
    """``(clipping, max_grad_norm)``: ``("flat", C)``, or with ``--clip_per_layer``
    ``("per_layer", [C/√n] * n)`` for the n trainable tensors (the whole gradient stays ≤ C)."""
    if not getattr(args, "clip_per_layer", False):
        return "flat", args.max_grad_norm
    n = sum(1 for p in model.parameters() if p.requires_grad)
    return "per_layer", [args.max_grad_norm / math.sqrt(n)] * n


def unit_options(args: argparse.Namespace) -> dict:
    """Options of ``make_private`` for the privacy unit: ``augmentation_multiplicity=K`` when the
    example's ``--augmult`` K > 1 (an example's K augmentations clipped as one), else none."""
    k = getattr(args, "augmult", 1)
    return {"augmentation_multiplicity": k} if k > 1 else {}


def _modern(args, model, optimizer, loader, sigma: Optional[float], budget_delta, device):
    from opacus_dp import PrivacyEngine

    engine = PrivacyEngine(accountant=args.accountant, secure_mode=args.secure_rng,
                           max_epsilon=args.max_epsilon, max_epsilon_delta=budget_delta)
    clipping, bound = clipping_bounds(args, model)
    common = dict(module=model, optimizer=optimizer, data_loader=loader, clipping=clipping,
                  max_grad_norm=bound, noise_generator=_noise_generator(args, device),
                  grad_sample_mode=args.grad_sample_mode, fast_noise=fast_noise_of(args), **unit_options(args))
    if sigma is None and args.target_epsilon is not None:
        model, optimizer, loader = engine.make_private_with_epsilon(
            target_epsilon=args.target_epsilon, target_delta=args.delta, epochs=args.epochs, **common)
    else:
        model, optimizer, loader = engine.make_private(
            noise_multiplier=args.sigma if sigma is None else sigma, **common)
    return model, optimizer, loader, engine


def _classic(args, model, optimizer, loader, sigma: Optional[float], device):
    from opacus_dp import PrivacyEngine

    calibrate = sigma is None and args.target_epsilon is not None
    engine = PrivacyEngine(
        model, sample_rate=loader.sample_rate, sample_size=len(loader.dataset),
        noise_multiplier=None if calibrate else (args.sigma if sigma is None else sigma),
        target_epsilon=args.target_epsilon if calibrate else None,
        epochs=args.epochs if calibrate else None, max_grad_norm=clipping_bounds(args, model)[1],
        secure_rng=args.secure_rng, target_delta=args.delta, poisson=True,
        max_epsilon=args.max_epsilon, noise_generator=_noise_generator(args, device),
        grad_sample_mode=args.grad_sample_mode, fast_noise=fast_noise_of(args))
    engine.attach(optimizer)
    return model, optimizer, loader, engine


def prepare_training(args: argparse.Namespace, model: nn.Module, optimizer: torch.optim.Optimizer,
                     train_set: Dataset, setup: Distributed, *, collate_fn=None,
                     noise_multiplier: Optional[float] = None) -> TrainingRun:
    """Build the run; ``noise_multiplier`` (e.g. from a checkpoint) overrides calibration."""
    if args.disable_dp:
        loader = _plain_loader(args, train_set, setup, collate_fn)
        return TrainingRun(model, optimizer, loader, api="none", delta=args.delta)
    from opacus_dp.data import DPDataLoader

    q = sample_rate_of(args, len(train_set), setup.world_size)
    for note in sampling_notes(args, len(train_set), setup.world_size):
        say_error(note, setup.is_main)
    generator = _sampling_generator(args)
    if setup.active and args.secure_rng:  # one stream on every rank, rank 0's (as make_private's)
        from opacus_dp.distributed.checks import share_generator_state

        share_generator_state(generator)
    loader = DPDataLoader(train_set, sample_rate=q, distributed=setup.active, generator=generator,
                          num_workers=args.workers, collate_fn=collate_fn)
    with engine_notices(setup.is_main):
        if args.api == "modern":
            budget_delta = args.delta if args.max_epsilon is not None else None
            model, optimizer, loader, engine = _modern(args, model, optimizer, loader,
                                                       noise_multiplier, budget_delta, setup.device)
        else:
            model, optimizer, loader, engine = _classic(args, model, optimizer, loader, noise_multiplier,
                                                        setup.device)
    mode = engine.grad_sample_mode if args.api == "classic" else args.grad_sample_mode
    return TrainingRun(model, optimizer, loader, api=args.api, delta=args.delta, engine=engine,
                       physical_limit=physical_batch_limit(args), sample_rate=q, grad_sample_mode=mode)


def _split(batch, limit: int) -> list:
    """Cut a batch (tensor or tuple of tensors, batch on dim 0) into chunks of ≤ ``limit``."""
    tensors = batch if isinstance(batch, (list, tuple)) else (batch,)
    pieces = max(1, math.ceil(len(tensors[0]) / limit))
    chunks = list(zip(*(torch.tensor_split(t, pieces) for t in tensors)))
    return [c if isinstance(batch, (list, tuple)) else c[0] for c in chunks]


@contextmanager
def physical_batches(run: TrainingRun) -> Iterator[Iterator[Tuple[object, bool]]]:
    """Yield ``(batch, take_step)`` pairs: after the backward of each batch the loop calls
    ``optimizer.step()`` if ``take_step`` else ``optimizer.virtual_step()``.

    One private step is always one Poisson batch, however it is cut for memory.
    """
    if run.physical_limit is None or not run.private:
        yield ((batch, True) for batch in run.train_loader)
    elif run.api == "modern":
        from opacus_dp.data import BatchMemoryManager

        with BatchMemoryManager(data_loader=run.train_loader, max_physical_batch_size=run.physical_limit,
                                optimizer=run.optimizer) as loader:
            yield ((batch, True) for batch in loader)  # the manager signals the skipped steps
    else:
        yield ((chunk, i == len(chunks) - 1)
               for batch in run.train_loader
               for chunks in [_split(batch, run.physical_limit)]
               for i, chunk in enumerate(chunks))
