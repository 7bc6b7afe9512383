"""The wiring both privacy engines compose (the modern ``PrivacyEngine`` and the classic
``attach`` engine): the secure-mode notice, the distributed checks, and the hooks that make an
optimizer's step private — distributed reduction, budget guard (before the step) and accountant
(after it).
"""

import warnings
from typing import Callable, Dict, Optional

import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from opacus_dp.data.sampling_checks import check_no_padding_across_ranks
from opacus_dp.engine.budget_guard import BudgetGuard
from opacus_dp.distributed import (
    check_data_loader_world_size,
    connect_reducer,
    validate_parallel_module,
    world_size_of,
)
from opacus_dp.mechanisms.engine import MechanismPlan, connect_mechanism
from opacus_dp.distributed.fsdp import FsdpOption, fsdp_options, rebind_optimizer, shard_model

SECURE_MODE_NOTICE = ("secure_mode is off: fine for experiments; train the final model with "
                      "secure_mode=True for noise robust to floating-point attacks")


class SecureModeNotice(UserWarning):
    """The reminder that ``secure_mode`` is off (a type, so that it can be filtered as such)."""


def warn_if_not_secure(secure_mode: bool, stacklevel: int = 3) -> None:
    """The reminder that ``secure_mode`` is off (``stacklevel``: the user's call), from one process
    only when ``torch.distributed`` is initialised (rank 0)."""
    if secure_mode or (torch.distributed.is_available() and torch.distributed.is_initialized()
                       and torch.distributed.get_rank() != 0):
        return
    warnings.warn(SECURE_MODE_NOTICE, SecureModeNotice, stacklevel=stacklevel)


def shard_if_asked(module: nn.Module, fsdp: FsdpOption) -> Optional[Dict[torch.Tensor, str]]:
    """With ``fsdp`` (True or a dict of :func:`~opacus_dp.distributed.fsdp.shard_model` options),
    shard ``module`` with FSDP2 in place and return the names of its former parameters, with
    which :func:`~opacus_dp.distributed.fsdp.rebind_optimizer` points an optimizer at the shards;
    else None."""
    options = fsdp_options(fsdp)
    if options is None:
        return None
    names = {p: n for n, p in module.named_parameters()}
    shard_model(module, **options)
    return names


def rebind_if_sharded(optimizer, names: Optional[Dict[torch.Tensor, str]], module: nn.Module):
    """``optimizer`` pointed at the shards of a model :func:`shard_if_asked` sharded (in place)."""
    return optimizer if names is None else rebind_optimizer(optimizer, names, module)


def check_distributed(module: nn.Module) -> int:
    """Refuse an unwrapped model under an active process group; return the world size."""
    validate_parallel_module(module)
    return world_size_of(module)


def check_distributed_loader(data_loader: DataLoader, world_size: int, poisson_sampling: bool) -> None:
    """Refuse a loader whose sharding disagrees with the process group or, kept as it is
    (``poisson_sampling=False``), repeats an example across the ranks of one step."""
    check_data_loader_world_size(data_loader, world_size, poisson_sampling=poisson_sampling)
    if world_size > 1 and not poisson_sampling:
        check_no_padding_across_ranks(data_loader, "make_private(poisson_sampling=False)")


def connect_private_step(module: nn.Module, dp_optimizer, *, accountant, sample_rate: float,
                         max_epsilon: Optional[float] = None, max_epsilon_delta: Optional[float] = None,
                         epsilon_of: Optional[Callable] = None, mechanism: Optional[MechanismPlan] = None) -> None:
    """Connect the private step of ``dp_optimizer`` (built by
    :func:`~opacus_dp.engine.optimizer.make_dp_optimizer`): its reducer to the other processes (all
    ranks agree from here on), a correlated ``mechanism``'s schedule, the budget guard (a pre-step
    hook, if ``max_epsilon``: ε at ``max_epsilon_delta``, measured by ``epsilon_of(accountant)`` if
    given) and the accountant (a step hook recording each step's event, σ and ``min(1, k·q)``). A
    mechanism's hooks (:class:`~opacus_dp.mechanisms.accounting.MechanismHooks`) replace the
    recorded event and the rate the guard charges."""
    hooks = connect_mechanism(mechanism, dp_optimizer, accountant)
    connect_reducer(module, dp_optimizer, sample_rate=sample_rate)
    if max_epsilon is not None:
        dp_optimizer.attach_pre_step_hook(BudgetGuard(
            accountant, max_epsilon=max_epsilon, delta=max_epsilon_delta,
            sample_rate=sample_rate if hooks is None else hooks.next_rate,
            epsilon_of=epsilon_of))
    dp_optimizer.attach_step_hook(accountant.get_optimizer_hook_fn(sample_rate) if hooks is None
                                  else hooks.record_step)
