"""Rank function of the spawned gloo job of ``test_distributed_audit`` (must be importable)."""

import torch.nn as nn

from opacus_dp.audit import AuditConfig, run_audit
from opacus_dp.distributed import DifferentiallyPrivateDistributedDataParallel


def _wrapper(name: str):
    if name == "ddp":
        return nn.parallel.DistributedDataParallel
    return DifferentiallyPrivateDistributedDataParallel


def audit_on_rank(rank, world_size, jobs):
    """Run each ``(wrapper name, AuditConfig keyword arguments)`` job; every rank returns its reports."""
    return [run_audit(AuditConfig(**arguments), model_wrapper=_wrapper(name)) for name, arguments in jobs]
