"""``scripts/benchmark.py --ddp``: every model wrapped in ``DistributedDataParallel`` in a process
group of one process (gloo; NCCL on CUDA), as a DDP training script has it on each rank. With one
process DDP sends nothing, so the ratios show what the wrapper and (with ``--compile``) dynamo's
handling of DDP add, not the network."""

import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from benchmark_fsdp import free_port


def join_single_process_group(device: str = "cpu") -> None:
    """A process group of this process alone (rank 0 of 1), unless one exists."""
    if dist.is_initialized():
        return
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                            rank=0, world_size=1)


def ddp(model: nn.Module) -> nn.Module:
    """``model`` in ``DistributedDataParallel`` on its device."""
    device = next(model.parameters()).device
    return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)


def ddp_kwargs(args) -> dict:
    """``build_step``'s keyword for ``--ddp`` (none without it)."""
    if not getattr(args, "ddp", False):
        return {}
    join_single_process_group(getattr(args, "device", "cpu"))
    return {"wrap": ddp}
