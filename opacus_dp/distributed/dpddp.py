"""DifferentiallyPrivateDistributedDataParallel (DPDDP): the model wrapper for multi-process DP-SGD.

Unlike ``torch.nn.parallel.DistributedDataParallel`` it communicates nothing during the
backward pass: every rank computes and clips the per-sample gradients of its own samples,
and the optimizer's :class:`~opacus_dp.distributed.reducers.AllReduceReducer` sums the
*clipped* gradients of all ranks once per step. Its only collective is at construction:
rank 0's parameters and buffers are broadcast so that all replicas start identical.
"""

import copy
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from opacus_dp.distributed.checks import require_process_group
from opacus_dp.distributed.step_wait import StepTimeout, timeout_seconds
from opacus_dp.model_wrappers import register_wrapper_type


def _grouped_by_dtype_and_device(tensors: List[torch.Tensor]) -> Dict[Tuple, List[torch.Tensor]]:
    groups: Dict[Tuple, List[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return groups


@torch.no_grad()
def broadcast_tensors_(tensors: List[torch.Tensor], *, src: int = 0, group=None) -> None:
    """Overwrite ``tensors`` on every rank with the values of group rank ``src``.

    One broadcast per (dtype, device): the tensors are flattened into one buffer.
    """
    src_global = src if group is None else dist.get_global_rank(group, src)
    for same_kind in _grouped_by_dtype_and_device(list(tensors)).values():
        flat = torch.cat([t.detach().reshape(-1) for t in same_kind])
        dist.broadcast(flat, src=src_global, group=group)
        offset = 0
        for t in same_kind:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


@register_wrapper_type
class DifferentiallyPrivateDistributedDataParallel(nn.Module):
    """Data-parallel wrapper for DP-SGD across ``torch.distributed`` processes.

    Args:
        module: the model; it must already live on this rank's device.
        process_group: the group to synchronise over (default: the global group).
        step_timeout: seconds (or a timedelta) a private step waits for the other ranks
            before it raises an error naming those missing (default: the group's timeout;
            ``make_private(step_timeout=...)`` overrides it).

    At construction rank 0's parameters and buffers are broadcast to all ranks. ``forward``
    calls ``module`` unchanged. Gradients are summed across ranks by the DP optimizer
    after per-sample clipping, never here.
    """

    def __init__(self, module: nn.Module, *, process_group: Optional[object] = None,
                 step_timeout: StepTimeout = None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"DifferentiallyPrivateDistributedDataParallel wraps an nn.Module, got "
                f"{type(module).__name__}"
            )
        require_process_group("DifferentiallyPrivateDistributedDataParallel")
        self.module = module
        self.process_group = process_group
        self.step_timeout = timeout_seconds(step_timeout)
        tensors = [p.data for p in module.parameters()] + list(module.buffers())
        if tensors:
            broadcast_tensors_(tensors, src=0, group=process_group)

    _shared_by_copies = ("process_group",)  # a communicator, not state: copies use the same

    def __deepcopy__(self, memo):
        """A copy of the wrapper and its model that synchronises over the same process group."""
        if self.process_group is not None:
            memo.setdefault(id(self.process_group), self.process_group)
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return copied

    @property
    def world_size(self) -> int:
        """Number of processes in the wrapper's group."""
        return dist.get_world_size(self.process_group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)
