"""Run a function on N gloo processes (CPU) and collect each rank's return value.

A hang (e.g. ranks falling out of step in a collective) fails the test after ``timeout``
seconds instead of blocking: the child processes are killed and ``TimeoutError`` raised.
"""

import datetime
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.conftest import free_port

COLLECTIVE_TIMEOUT_S = 30


def _entry(rank, fn, world_size, port, out_dir, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    # torch 2.14's FSDP2 under gloo sometimes aborts at interpreter exit ("terminate called without
    # an active exception") after all work is done: leave without the interpreter's teardown
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_on_ranks(fn, world_size: int, *args, timeout: float = 120.0):
    """``[fn(rank, world_size, *args) for each rank]``, each rank in its own gloo process.

    ``fn`` must be a module-level function (it is pickled into spawned processes); its
    return value must be ``torch.save``-able.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(
            _entry,
            args=(fn, world_size, free_port(), out_dir, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                raise TimeoutError(f"{fn.__name__} did not finish within {timeout} s (hang?)")
        return [
            torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
            for r in range(world_size)
        ]
