"""Run on every rank of a spawned gloo job by ``test_fsdp_compile.py``: a model sharded with FSDP2
trained privately (σ = 0, clipping active, a distributed Poisson sample), eagerly and compiled."""

import torch
import torch.nn as nn

from tests.distributed.workers_fsdp import full_params, make_model, private, shard_by_hand

WAYS = ("eager", "private.compile", "model.compile")


def train(rank: int, mode: str, way: str, backend: str):
    """The whole parameters after one epoch, the model compiled ``way`` (the same batches each way)."""
    model = shard_by_hand(make_model(seed=0))
    if way == "model.compile":
        model.compile(backend=backend)
    _, module, optimizer, _, loader = private(model, mode=mode, fsdp=False)
    if way == "private.compile":
        module.compile(backend=backend)
    torch.manual_seed(11 + rank)  # the Poisson draws
    for x, y in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(module(x), y).backward()
        optimizer.step()
    return full_params(model)


def fsdp_compile_job(rank: int, world_size: int, modes, backend: str):
    """``{(mode, way): parameters}`` on this rank."""
    return {(mode, way): train(rank, mode, way, backend) for mode in modes for way in WAYS}
