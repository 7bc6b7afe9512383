"""Train with canaries through the real engine and record what a white-box adversary sees.

One run: draw the canaries' membership, build the canary dataset and model
(:mod:`~opacus_dp.audit.canaries`; canary users: :mod:`~opacus_dp.audit.user_canaries`), make
them private with :class:`opacus_dp.PrivacyEngine` (modern ``make_private`` or classic
``attach``; Poisson ``DPDataLoader``; optional ``BatchMemoryManager``, ``nn.DataParallel``/DDP
wrapper), train ``steps`` logical steps with SGD and, after every step the accountant records,
read the canary coordinates of the weights.

The observation of canary i at step t is ``x_{t,i} = Δw_{d_b+i} · D / (η·C)``; for a correct
engine it equals ``b_{t,i} + N(0, σ²)`` with ``b_{t,i}`` = 1 if the canary (user) was in the batch.
Nothing of the mechanism is re-implemented here: clipping, noise, sampling, reduction and
accounting are the engine's.
"""

import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn as nn

from opacus_dp.audit.canaries import CanaryLoss, canary_model, draw_membership
from opacus_dp.audit.config import AuditConfig
from opacus_dp.audit.correlated import MechanismRecord, canary_groups
from opacus_dp.audit.user_canaries import canary_data, unit_options
from opacus_dp.data.cyclic_sampler import CyclicPoissonSampler
from opacus_dp.data import BatchMemoryManager, DPDataLoader
from opacus_dp.distributed import world_size_of
from opacus_dp.engine.modern import PrivacyEngine

ModelWrapper = Callable[[nn.Module], nn.Module]
_SEED_STRIDE = 1_000_003


@dataclass
class RunRecord:
    """One training run: membership ``(m,)``, observations ``(T, m)``, the accountant's record.

    ``accountant_epsilon`` is None when the run was asked not to compute it.
    """

    membership: torch.Tensor
    observations: torch.Tensor
    privacy_history: List[Tuple[float, float, int]]
    accountant_epsilon: Optional[float]
    mechanism: Optional[MechanismRecord] = None  # a correlated noise mechanism's, and
    canary_groups: Optional[torch.Tensor] = None  # each canary's group


@dataclass
class _PrivateTraining:
    network: nn.Module
    optimizer: torch.optim.Optimizer
    loader: torch.utils.data.DataLoader
    criterion: Callable
    divisor: float
    epsilon: Callable[[], float]
    accountant: object
    release: Callable[[], None]


@contextmanager
def _secure_mode_warning_silenced():
    """The audit seeds its generators on purpose (reproducible runs): no secure-mode advice."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="secure_mode is off")
        yield


def _modern(config: AuditConfig, network, optimizer, dataset, generators) -> _PrivateTraining:
    with _secure_mode_warning_silenced():
        engine = PrivacyEngine(accountant=config.accountant)
    criterion = CanaryLoss(config.loss_reduction)
    loader = DPDataLoader(dataset, sample_rate=config.sample_rate, generator=generators["sampling"])
    made = engine.make_private(
        module=network, optimizer=optimizer, data_loader=loader,
        noise_multiplier=config.noise_multiplier, max_grad_norm=config.max_grad_norm,
        loss_reduction=config.loss_reduction, noise_generator=generators["noise"],
        grad_sample_mode=config.grad_sample_mode, criterion=criterion, **_mechanism_options(config, loader),
        **unit_options(config))
    private_net, dp_optimizer, dp_loader = made[0], made[1], made[-1]
    criterion = made[2] if len(made) == 4 else criterion
    divisor = _divisor(config, dp_optimizer.expected_batch_size, world_size_of(network))
    return _PrivateTraining(private_net, dp_optimizer, dp_loader, criterion, divisor,
                            epsilon=lambda: engine.get_epsilon(config.delta),
                            accountant=engine.accountant, release=private_net.close)


def _mechanism_options(config: AuditConfig, loader) -> dict:
    if config.noise_mechanism == "independent":
        return {}
    return {"noise_mechanism": config.noise_mechanism, "bands": config.bands, "epochs": config.steps / len(loader)}


def _mechanism_of(training: _PrivateTraining, membership: torch.Tensor):
    """The run's :class:`MechanismRecord` and canary groups (None, None for DP-SGD)."""
    sampler = training.loader.batch_sampler
    if not isinstance(sampler, CyclicPoissonSampler):
        return None, None
    record = MechanismRecord(training.optimizer.noise.strategy, sampler.groups, sampler.sample_rate)
    return record, canary_groups(membership, sampler.assignment)


def _classic(config: AuditConfig, network, optimizer, dataset, generators) -> _PrivateTraining:
    world_size = world_size_of(network)
    with _secure_mode_warning_silenced():
        engine = PrivacyEngine(network, sample_rate=config.sample_rate, sample_size=len(dataset),
                               noise_multiplier=config.noise_multiplier,
                               max_grad_norm=config.max_grad_norm, poisson=True,
                               loss_reduction=config.loss_reduction, target_delta=config.delta,
                               noise_generator=generators["noise"])
    engine.attach(optimizer)
    loader = DPDataLoader(dataset, sample_rate=config.sample_rate, generator=generators["sampling"],
                          distributed=world_size > 1)
    divisor = _divisor(config, engine.expected_batch_size, world_size)
    return _PrivateTraining(network, optimizer, loader, CanaryLoss(config.loss_reduction), divisor,
                            epsilon=lambda: engine.get_privacy_spent(config.delta)[0],
                            accountant=engine.accountant, release=engine.detach)


def _divisor(config: AuditConfig, expected_batch_size, world_size: int) -> float:
    """``D``: what the engine divides the noisy sum by (mean: expected global batch size)."""
    if config.loss_reduction == "sum":
        return 1.0
    if expected_batch_size is None:
        raise ValueError("the engine reports no expected batch size: the audit needs Poisson "
                         "sampling with a known expected batch size (loss_reduction='mean')")
    return float(expected_batch_size) * world_size


def _physical_batches(training: _PrivateTraining, max_physical_batch_size: Optional[int]):
    """A context manager yielding the loader (split by BatchMemoryManager if asked)."""
    if max_physical_batch_size is None:
        return nullcontext(training.loader)
    return BatchMemoryManager(data_loader=training.loader, optimizer=training.optimizer,
                              max_physical_batch_size=max_physical_batch_size)


def _train(training: _PrivateTraining, weight: torch.Tensor, coordinates: slice,
           config: AuditConfig) -> torch.Tensor:
    """``(T, m)`` observations, one row per step recorded by the accountant."""
    scale = training.divisor / (config.learning_rate * config.max_grad_norm)
    previous = weight.detach()[0, coordinates].clone()
    rows, idle_passes = [], 0
    while len(rows) < config.steps:
        recorded_before = len(rows)
        with _physical_batches(training, config.max_physical_batch_size) as batches:
            for inputs, targets in batches:
                training.optimizer.zero_grad()
                training.criterion(training.network(inputs), targets).backward()
                training.optimizer.step()
                if len(training.accountant) > len(rows):
                    current = weight.detach()[0, coordinates].clone()
                    rows.append((current - previous) * scale)
                    previous = current
                    if len(rows) == config.steps:
                        break
        idle_passes = idle_passes + 1 if len(rows) == recorded_before else 0
        if idle_passes >= 3:
            raise RuntimeError("three passes over the data without a step recorded by the accountant: "
                               "the engine does not account its steps")
    return torch.stack(rows)


def _generators(config: AuditConfig, run_index: int):
    base = config.seed * _SEED_STRIDE + run_index * 4
    return {name: torch.Generator().manual_seed(base + offset)
            for offset, name in enumerate(("membership", "data", "sampling", "noise"))}


def run_with_canaries(config: AuditConfig, run_index: int = 0,
                      model_wrapper: Optional[ModelWrapper] = None,
                      report_epsilon: bool = True) -> RunRecord:
    """Run ``run_index`` of the audit (seeded by ``config.seed`` and ``run_index``).

    ``model_wrapper`` wraps the canary model before it is made private, e.g.
    ``nn.DataParallel`` or ``DifferentiallyPrivateDistributedDataParallel`` (inside a
    process group every rank must call this with the same arguments).
    """
    layout = config.layout()
    generators = _generators(config, run_index)
    membership = draw_membership(layout.num_canaries, generators["membership"])
    dataset = canary_data(config, layout, membership, generators["data"])
    model = canary_model(layout)
    network = model_wrapper(model) if model_wrapper is not None else model
    optimizer = torch.optim.SGD(network.parameters(), lr=config.learning_rate)
    setup = _classic if config.api == "classic" else _modern
    training = setup(config, network, optimizer, dataset, generators)
    try:
        observations = _train(training, model.weight, layout.canary_coordinates, config)
        epsilon = float(training.epsilon()) if report_epsilon else None
        return RunRecord(membership, observations, list(training.accountant.history), epsilon,
                         *_mechanism_of(training, membership))
    finally:
        training.release()
