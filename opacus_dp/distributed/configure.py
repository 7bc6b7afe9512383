"""How the PrivacyEngine wires distributed training: detection, reducer, comm hook, checks.

The engine calls these functions and nothing else from this package:

* :func:`validate_parallel_module` when it receives the model (refuses an unwrapped model
  while a multi-process group is active),
* :func:`world_size_of` to turn a per-process batch size into the global sample rate
  (classic API: ``q = batch_size · world_size / sample_size``),
* :func:`check_data_loader_world_size` for a loader the modern API receives,
* :func:`make_reducer` before the DP optimizer is built (its reducer: local, all-reduce with its
  step timeout, or FSDP2 reduce-scatter), and :func:`connect_reducer` once it exists (checks that
  all ranks agree on the settings, installs the no-op DDP comm hook or the FSDP2 rendezvous).
"""

from typing import Optional, Union

import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

from opacus_dp.distributed.checks import check_mean_divisor, check_same_on_all_ranks, process_group_active
from opacus_dp.distributed.ddp_hooks import detach_ddp_synchronisation, install_local_gradients_hook
from opacus_dp.distributed.dpddp import DifferentiallyPrivateDistributedDataParallel
from opacus_dp.distributed.fsdp import is_fully_sharded
from opacus_dp.distributed.fsdp_setup import connect_fsdp, fsdp_reducer, fsdp_world_size
from opacus_dp.distributed.reducers import AllReduceReducer
from opacus_dp.distributed.step_wait import StepTimeout, timeout_seconds
from opacus_dp.optim.reduction import LocalReducer, Reducer

DistributedWrapper = Union[DistributedDataParallel, DifferentiallyPrivateDistributedDataParallel]
_MAX_UNWRAP_DEPTH = 8


def find_parallel_wrapper(module: nn.Module) -> Optional[nn.Module]:
    """The DDP, DPDDP or DataParallel wrapper at the top of ``module``, else None.

    Looks through the wrappers of this package (a GradSampleModule keeps the user's
    model in ``_module``).
    """
    current = module
    for _ in range(_MAX_UNWRAP_DEPTH):
        if isinstance(current, (DistributedDataParallel, DataParallel,
                                DifferentiallyPrivateDistributedDataParallel)):
            return current
        inner = current.__dict__.get("_modules", {}).get("_module")
        if inner is None:
            return None
        current = inner
    return None


def find_distributed_wrapper(module: nn.Module) -> Optional[DistributedWrapper]:
    """The DDP or DPDDP wrapper of ``module``, else None."""
    wrapper = find_parallel_wrapper(module)
    return None if isinstance(wrapper, DataParallel) else wrapper


def validate_parallel_module(module: nn.Module) -> None:
    """Refuse a model that would silently train without cross-process reduction.

    With an active process group of more than one process, the model must be wrapped in
    ``DistributedDataParallel`` or ``DifferentiallyPrivateDistributedDataParallel``:
    otherwise every rank would step on its own data and the privacy accounting (global
    sample rate) would be wrong.
    """
    if process_group_active() and find_distributed_wrapper(module) is None and not is_fully_sharded(module):
        raise ValueError(
            f"torch.distributed is initialised with world_size={dist.get_world_size()} but the "
            f"model ({type(module).__name__}) is not wrapped for distributed training: wrap it "
            "in torch.nn.parallel.DistributedDataParallel or "
            "opacus_dp.distributed.DifferentiallyPrivateDistributedDataParallel, or shard it with "
            "torch.distributed.fsdp.fully_shard (or make_private(..., fsdp=True)) before "
            "make_private/attach"
        )


def world_size_of(module: nn.Module) -> int:
    """Number of processes whose batches form one global step of ``module`` (1 if local)."""
    wrapper = find_distributed_wrapper(module)
    if wrapper is None:
        return fsdp_world_size(module) if is_fully_sharded(module) else 1
    return dist.get_world_size(_process_group(wrapper))


def _loader_replicas(data_loader) -> Optional[int]:
    """``num_replicas`` of the loader's (batch) sampler, if it shards the data."""
    for sampler in (getattr(data_loader, "batch_sampler", None), getattr(data_loader, "sampler", None),
                    getattr(getattr(data_loader, "batch_sampler", None), "sampler", None)):
        replicas = getattr(sampler, "num_replicas", None)
        if replicas is not None:
            return int(replicas)
    return None


def check_data_loader_world_size(data_loader, world_size: int, *, poisson_sampling: bool) -> None:
    """Refuse a loader whose sharding disagrees with the number of processes.

    * a sampler with ``num_replicas`` must have ``num_replicas == world_size``;
    * without Poisson sampling the loader is used as it is, and ``q = 1/len(loader)`` is
      the global sample rate only if each process iterates its own shard: a loader that
      does not shard (no ``num_replicas``) is refused, since every process would step on
      batches drawn from the whole dataset and ε would be under-reported.
    """
    if world_size <= 1:
        return
    replicas = _loader_replicas(data_loader)
    if replicas is not None and replicas != world_size:
        raise ValueError(
            f"the data loader's sampler shards the data for num_replicas={replicas} processes but "
            f"the process group has world_size={world_size}: build the DistributedSampler with the "
            "default num_replicas (or num_replicas=torch.distributed.get_world_size())"
        )
    if replicas is None and not poisson_sampling:
        raise ValueError(
            f"poisson_sampling=False with world_size={world_size} needs a loader that gives each "
            "process its own shard (e.g. DataLoader(..., sampler=DistributedSampler(dataset))); "
            "otherwise the sample rate 1/len(data_loader) would not be the global one"
        )


def _process_group(wrapper: DistributedWrapper):
    return getattr(wrapper, "process_group", None)


def make_reducer(module: nn.Module, *, params, names, clipper, noise, step_timeout: StepTimeout = None) -> Reducer:
    """The reducer of ``module``'s private steps (no collective yet): local for a model on one
    process; the all-reduce of DDP/DPDDP (its step bounded by ``step_timeout``, seconds or
    timedelta; default: the DPDDP wrapper's, else the process group's timeout,
    :mod:`~opacus_dp.distributed.step_wait`); the FSDP2 reduce-scatter
    (:func:`~opacus_dp.distributed.fsdp_setup.fsdp_reducer`, which also checks ``params``,
    ``clipper`` and ``noise``)."""
    step_timeout = timeout_seconds(step_timeout)
    wrapper = find_distributed_wrapper(module)
    if wrapper is None:
        if is_fully_sharded(module):
            return fsdp_reducer(module, params=params, names=names, clipper=clipper, noise=noise,
                                step_timeout=step_timeout)
        return LocalReducer()
    if step_timeout is None:
        step_timeout = getattr(wrapper, "step_timeout", None)
    return AllReduceReducer(process_group=_process_group(wrapper), step_timeout=step_timeout)


def connect_reducer(module: nn.Module, optimizer, *, sample_rate: Optional[float]) -> None:
    """Once the DP ``optimizer`` of ``module`` exists (its reducer from :func:`make_reducer`): all
    ranks check, collectively, that they agree on world size, sample rate and the optimizer's
    ``settings_ranks_share()`` (σ, clipping bounds, expected batch size, loss reduction, ...; a
    mismatch raises on every rank); then DDP gets the comm hook that stops its own all-reduce of
    unclipped gradients, an FSDP2 model its bounded rendezvous. No-op for a local model."""
    wrapper = find_distributed_wrapper(module)
    if wrapper is None:
        if is_fully_sharded(module):
            connect_fsdp(module, optimizer, sample_rate=sample_rate)
        return
    group = _process_group(wrapper)
    check_same_on_all_ranks({"world_size": dist.get_world_size(group), "sample_rate": sample_rate,
                             **optimizer.settings_ranks_share()}, group)
    check_mean_divisor(optimizer)
    if isinstance(wrapper, DistributedDataParallel):
        install_local_gradients_hook(wrapper)
        detach_ddp_synchronisation(wrapper)
