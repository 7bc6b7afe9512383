"""How the PrivacyEngine wires distributed training: detection, reducer, comm hook, checks.

The engine calls three functions and nothing else from this package:

* :func:`validate_parallel_module` when it receives the model (refuses an unwrapped model
  while a multi-process group is active),
* :func:`world_size_of` to turn a per-process batch size into the global sample rate
  (classic API: ``q = batch_size · world_size / sample_size``),
* :func:`configure_optimizer` once the DP optimizer exists (installs the all-reduce
  reducer, the no-op DDP comm hook, and checks that all ranks agree on the parameters).
"""

from typing import Optional, Union

import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

from opacus_dp.distributed.checks import check_same_on_all_ranks, process_group_active
from opacus_dp.distributed.ddp_hooks import install_local_gradients_hook
from opacus_dp.distributed.dpddp import DifferentiallyPrivateDistributedDataParallel
from opacus_dp.distributed.reducers import AllReduceReducer

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
    if process_group_active() and find_distributed_wrapper(module) is None:
        raise ValueError(
            f"torch.distributed is initialised with world_size={dist.get_world_size()} but the "
            f"model ({type(module).__name__}) is not wrapped for distributed training: wrap it "
            "in torch.nn.parallel.DistributedDataParallel or "
            "opacus_dp.distributed.DifferentiallyPrivateDistributedDataParallel before "
            "make_private/attach"
        )


def world_size_of(module: nn.Module) -> int:
    """Number of processes whose batches form one global step of ``module`` (1 if local)."""
    wrapper = find_distributed_wrapper(module)
    if wrapper is None:
        return 1
    return dist.get_world_size(_process_group(wrapper))


def _process_group(wrapper: DistributedWrapper):
    return getattr(wrapper, "process_group", None)


def configure_optimizer(module: nn.Module, optimizer, *, sample_rate: Optional[float]) -> None:
    """Make ``optimizer`` (a DPOptimizer) reduce over the processes of ``module``'s wrapper.

    No-op for a local model. For DDP it also registers the comm hook that stops DDP's
    own all-reduce of unclipped gradients. Before anything is installed, all ranks check
    (collectively) that they agree on world size, sample rate, noise multiplier, clipping
    bound, expected batch size and loss reduction; a mismatch raises on every rank.
    """
    wrapper = find_distributed_wrapper(module)
    if wrapper is None:
        return
    group = _process_group(wrapper)
    check_same_on_all_ranks(
        {
            "world_size": dist.get_world_size(group),
            "sample_rate": sample_rate,
            "noise_multiplier": getattr(optimizer, "noise_multiplier", None),
            "max_grad_norm": _max_grad_norm_key(optimizer),
            "expected_batch_size": getattr(optimizer, "expected_batch_size", None),
            "loss_reduction(mean=1)": float(getattr(optimizer, "loss_reduction", "mean") == "mean"),
        },
        group,
    )
    if isinstance(wrapper, DistributedDataParallel):
        install_local_gradients_hook(wrapper)
    optimizer.reducer = AllReduceReducer(process_group=group)


def _max_grad_norm_key(optimizer) -> Optional[float]:
    """A scalar summary of the clipping bound(s): the flat bound or the sum of per-layer ones."""
    bound = getattr(optimizer, "max_grad_norm", None)
    if isinstance(bound, (list, tuple)):
        return float(sum(float(b) for b in bound))
    return None if bound is None else float(bound)
