"""Functions run on every rank of a spawned gloo job: FSDP2 steps where one rank's local batch is empty.

With ``batch_size=2`` on 64 samples and 2 ranks the global Poisson rate is q = 2/64: each
rank's expected local batch holds one sample, so steps where one rank holds none and the
other some are common. Every mode trains σ = 0 in the plain loop and in the
``BatchMemoryManager`` loop (pieces of at most one sample) and reports its batches, so the
test compares the result with one process replaying the concatenated batches.
"""


from opacus_dp.data import BatchMemoryManager
from tests.distributed.workers import record_logical_steps
from tests.distributed.workers_fsdp import full_params, make_model, private

MODES = ("bk", "ghost", "hooks", "functorch")
LOOPS = ("plain", "bmm")


def train_small_rate(rank, world_size, mode, loop, steps=6):
    """σ = 0 at q = 2/64; returns the starting and final parameters and every logical batch."""
    model = make_model(seed=0)
    start = full_params(model)
    engine, module, optimizer, criterion, loader = private(model, mode=mode, batch_size=2, seed=3)
    if loop == "bmm":
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=1, optimizer=optimizer) as pieces:
            logical = record_logical_steps(engine, module, optimizer, criterion, pieces, steps)
    else:
        logical = record_logical_steps(engine, module, optimizer, criterion, loader, steps)
    return {"start": start, "batches": logical, "final": full_params(module),
            "global_batch": optimizer.expected_batch_size * world_size, "steps": len(engine.accountant)}


def empty_batches_job(rank, world_size):
    """Every mode in both loops, in one spawned job."""
    return {(mode, loop): train_small_rate(rank, world_size, mode, loop) for mode in MODES for loop in LOOPS}
