"""Opacus's ``average_gradients`` (``opacus.layers.dp_ddp`` in 0.x, ``opacus.distributed`` in 1.x)."""

import torch.distributed as dist
import torch.nn as nn


def average_gradients(model: nn.Module) -> None:
    """Replace each ``p.grad`` of ``model`` by its mean over the processes of the default group
    (an all-reduce per parameter). The DP wrappers already reduce the private gradients: this is
    for gradients formed outside them."""
    world_size = dist.get_world_size()
    for p in model.parameters():
        if p.requires_grad and p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad /= world_size
