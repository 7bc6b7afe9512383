"""Jobs run on 2 gloo processes for the FSDP2 checkpoint tests (``test_sharded_checkpoint_agreement.py``).

``run_job`` spawns the ranks like :mod:`tests.distributed.spawn`, but tolerates a rank that dies on
purpose (a crash mid-save) and uses a process-group timeout of ``GROUP_TIMEOUT_S``, longer than
the test's own timeout: a hang fails the test with ``TimeoutError`` before gloo would turn it
into an error.

* :func:`crash_job` saves a signed checkpoint, trains one more step, then rank 1 dies while it
  writes its file of the next save; rank 0 reports what it raised.
* :func:`refusal_job` saves a signed checkpoint, then: a save whose file write fails on rank 1,
  one with an entry the safe loader cannot read on rank 1;
  loads of damaged copies (a rank file deleted, rank 0's signed file altered, the rank files
  swapped, rank 1's file from a later save), each caught on every rank, after which both ranks
  train on; and a load of the directory :func:`crash_job` left behind.
"""

import argparse
import datetime
import os
import shutil
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from opacus_dp.checkpoints import file_format
from tests.conftest import free_port
from tests.distributed.workers_fsdp import DELTA, _train_steps, full_params, make_model, private

GROUP_TIMEOUT_S = 150
KEY = b"0123456789abcdef-fsdp-checkpoint"


# ----------------------------------------------------------------------------- spawning
def _entry(rank, fn, world_size, port, out_dir, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no teardown: a peer may be dead on purpose (see tests/distributed/spawn.py)


def run_job(fn, world_size: int, *args, timeout: float, may_die=()):
    """Each rank's return value of ``fn(rank, world_size, *args)`` (None for a rank in
    ``may_die`` that left no result); ``TimeoutError`` after ``timeout`` s."""
    assert timeout < GROUP_TIMEOUT_S
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(_entry, args=(fn, world_size, free_port(), out_dir, args),
                                     nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        while any(p.is_alive() for p in context.processes):
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                raise TimeoutError(f"{fn.__name__} did not finish within {timeout} s (hang?)")
            time.sleep(0.2)
        results = []
        for rank in range(world_size):
            file = os.path.join(out_dir, f"rank{rank}.pt")
            if not os.path.isfile(file):
                assert rank in may_die, f"rank {rank} left no result (exit code {context.processes[rank].exitcode})"
                results.append(None)
            else:
                results.append(torch.load(file, weights_only=False))
        return results


# ----------------------------------------------------------------------------- pieces
def _run(seed):
    """A private FSDP2 run (Adam, σ > 0): ``(engine, module, optimizer, criterion, loader)``."""
    return private(make_model(seed=seed), sigma=0.8, seed=5 + seed, optimizer_class=torch.optim.Adam)


def _snapshot(built) -> dict:
    engine, module, optimizer = built[:3]
    return {"params": full_params(module), "steps": optimizer.steps_taken,
            "history": len(engine.accountant), "epsilon": engine.get_epsilon(DELTA)}


def _save(built, path, key=KEY, extra=None):
    engine, module, optimizer = built[:3]
    engine.save_checkpoint(path=path, module=module, optimizer=optimizer, signing_key=key, checkpoint_dict=extra)


def _saved_and_next(built, path) -> dict:
    """Save ``built`` to ``path``; its state then, and its parameters after one more step."""
    _save(built, path)
    report = {"saved": _snapshot(built)}
    _train_steps(*built, 1)
    report["next"] = full_params(built[1])
    return report


def _loaded_and_next(path, key=KEY) -> dict:
    """A fresh run loads ``path``: its state then, and its parameters after one step."""
    built = _run(seed=99)
    engine, module, optimizer = built[:3]
    engine.load_checkpoint(path=path, module=module, optimizer=optimizer, signing_key=key)
    report = {"saved": _snapshot(built)}
    _train_steps(*built, 1)
    report["next"] = full_params(module)
    return report


def _error(error: BaseException) -> dict:
    refusals = getattr(error, "refusals", None)
    return {"type": type(error).__name__, "message": str(error),
            "refusals": None if refusals is None else {r: reason.name for r, reason in refusals.items()}}


def _try(action) -> dict:
    try:
        action()
    except Exception as error:  # the test checks which, on every rank
        return _error(error)
    return {"type": None, "message": "", "refusals": None}


class _FailingWrite:
    """``file_format.write`` that fails on one rank (a full disk) or kills it part-way."""

    def __init__(self, rank: int, failing_rank: int, die: bool = False):
        self.rank, self.failing_rank, self.die, self.original = rank, failing_rank, die, file_format.write

    def __call__(self, state, path, **kwargs):
        if self.rank != self.failing_rank:
            return self.original(state, path, **kwargs)
        with open(path, "wb") as half:
            half.write(b"PK\x03\x04 half a file")
        if self.die:
            os._exit(3)
        raise OSError(28, "No space left on device", path)

    def __enter__(self):
        file_format.write = self
        return self

    def __exit__(self, *exc):
        file_format.write = self.original
        return False


# ----------------------------------------------------------------------------- damage
def _delete_rank1(target):
    os.remove(os.path.join(target, "private_rank1.pt"))


def _alter_rank0(target):
    """Flip one bit in the middle of rank 0's signed file (inside what the signature covers)."""
    file = os.path.join(target, "private_rank0.pt")
    with open(file, "rb") as handle:
        content = bytearray(handle.read())
    content[len(content) // 2] ^= 1
    with open(file, "wb") as handle:
        handle.write(bytes(content))


def _swap(target):
    files = [os.path.join(target, f"private_rank{r}.pt") for r in (0, 1)]
    os.rename(files[0], files[0] + ".tmp")
    os.rename(files[1], files[0])
    os.rename(files[0] + ".tmp", files[1])


def _mixed(target):
    """Rank 1's file from a later save (one more step) beside rank 0's of this one."""
    later = os.path.join(os.path.dirname(target), "later", "private_rank1.pt")
    shutil.copyfile(later, os.path.join(target, "private_rank1.pt"))


DAMAGE = {"deleted": _delete_rank1, "altered": _alter_rank0, "swapped": _swap, "mixed": _mixed}


# ----------------------------------------------------------------------------- jobs
def crash_job(rank, world_size, directory):
    """Save, one step, then rank 1 dies while writing its file of the next save."""
    built = _run(seed=0)
    _train_steps(*built, 2)
    report = _saved_and_next(built, os.path.join(directory, "crashed"))
    with _FailingWrite(rank, failing_rank=1, die=True):
        report["crash"] = _try(lambda: _save(built, os.path.join(directory, "crashed")))
    return report


def refusal_job(rank, world_size, directory, crashed):
    """See the module doc; ``crashed``: the directory :func:`crash_job` left."""
    base = os.path.join(directory, "base")
    built = _run(seed=0)
    _train_steps(*built, 2)
    report = {"base": _saved_and_next(built, base)}
    with _FailingWrite(rank, failing_rank=1):
        report["write_failure"] = _try(lambda: _save(built, base))
    unsafe = {"args": argparse.Namespace(lr=0.1)} if rank == 1 else None  # the safe loader cannot read it
    report["unsafe_entry"] = _try(lambda: _save(built, base, extra=unsafe))
    report["after_write_failure"] = _loaded_and_next(base)
    report["leftovers"] = sorted(os.listdir(directory))
    _save(built, os.path.join(directory, "later"))
    fresh = _run(seed=42)
    for case, damage in DAMAGE.items():
        target = os.path.join(directory, case)
        if rank == 0:
            shutil.copytree(base, target)
            damage(target)
        dist.barrier()
        report[case] = _try(lambda: fresh[0].load_checkpoint(path=target, module=fresh[1], optimizer=fresh[2],
                                                             signing_key=KEY))
    _train_steps(*fresh, 2)  # every rank caught the refusal and starts fresh
    report["fresh"] = _snapshot(fresh)
    report["crashed"] = _loaded_and_next(crashed)
    _save(built, crashed)  # a save over the crashed one clears what the crash left
    report["after_resave"] = sorted(os.listdir(os.path.dirname(crashed)))
    return report
