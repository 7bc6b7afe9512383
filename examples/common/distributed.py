"""Process-group setup for the examples: one process, or several started by ``torchrun``.

``torchrun --nproc_per_node=N examples/<script>.py ...`` sets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; with ``WORLD_SIZE > 1`` the examples
join the process group (``nccl`` on CUDA, ``gloo`` on CPU) and wrap the private model in
:class:`opacus_dp.distributed.DifferentiallyPrivateDistributedDataParallel` (imported only
then), the non-private one in ``torch.nn.parallel.DistributedDataParallel``.
"""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn


@dataclass(frozen=True)
class Distributed:
    """Where this process stands: its rank, the number of processes, its device."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _device_for(requested: str, local_rank: int, world_size: int) -> torch.device:
    device = torch.device(requested)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"--device {requested}: CUDA is not available on this machine; use --device cpu")
        if world_size > 1:
            device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    return device


def init_distributed(requested_device: str, *, local_rank: int = -1, backend=None) -> Distributed:
    """Join the process group if launched by ``torchrun`` with several processes.

    ``local_rank`` (``--local_rank``, from launchers that pass it as a flag) is used when the
    environment has no ``LOCAL_RANK``; ``backend`` (``--dist_backend``) defaults to nccl on
    CUDA and gloo on CPU."""
    world_size = _env_int("WORLD_SIZE", 1)
    rank, local_rank = _env_int("RANK", 0), _env_int("LOCAL_RANK", max(local_rank, 0))
    device = _device_for(requested_device, local_rank, world_size)
    if world_size > 1 and not dist.is_initialized():
        backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        dist.init_process_group(backend=backend, init_method="env://")
    return Distributed(rank=rank, local_rank=local_rank, world_size=world_size, device=device)


def init_from_args(args) -> Distributed:
    """:func:`init_distributed` with the flags ``--device``, ``--local_rank``, ``--dist_backend``."""
    return init_distributed(args.device, local_rank=getattr(args, "local_rank", -1),
                            backend=getattr(args, "dist_backend", None))


def wrap_model(model: nn.Module, setup: Distributed, *, private: bool) -> nn.Module:
    """The model as the optimizer should see it in this process group."""
    if not setup.active:
        return model
    if private:
        from opacus_dp.distributed import DifferentiallyPrivateDistributedDataParallel

        return DifferentiallyPrivateDistributedDataParallel(model)
    device_ids = [setup.device.index] if setup.device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)


def barrier(setup: Distributed) -> None:
    if setup.active:
        dist.barrier()


def shutdown(setup: Distributed) -> None:
    if setup.active and dist.is_initialized():
        dist.destroy_process_group()
