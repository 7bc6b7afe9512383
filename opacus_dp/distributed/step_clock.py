"""Keeping the ranks of a distributed private step in step (the step clock).

A rank can leave the common sequence of a private step outside the optimizer without any
collective failing: it skips a batch (catches a NaN loss or another exception and goes on with
the next batch), or, under FSDP2, where every forward and backward pass is a collective, it is
in another phase than the others (forward, backward, ``optimizer.step()``). Collectives of equal
size then pair different batches, or different phases, silently.

Every collective of a private step therefore carries three numbers of each rank beside the
settings (:mod:`~opacus_dp.distributed.agreement`): its row ends with ``[phase, b, s]``, where
``phase`` is 1 (forward), 2 (backward) or 3 (step), ``b`` the logical batches the rank's
DP data loaders handed out since its last step (:func:`~opacus_dp.data.samplers.count_logical_batch`;
1 per step in step, 2 on a rank that skipped one) and ``s`` the shard assignment of their pass
(:func:`~opacus_dp.data.samplers.note_shard_assignment`: ranks of different ``set_epoch`` own
overlapping shards, so one example or user would be clipped on two ranks). A column that is not
constant raises :class:`RanksOutOfStepError` on every rank, at the first mispaired collective.
The numbers ride in collectives that run anyway (more columns), so detection costs nothing extra.

Not detected: batches of loaders other than ``DPDataLoader``/``BatchMemoryManager`` over the
distributed Poisson sampler (``b`` is then 0 on every rank), and, under DDP/DPDDP, a skip that
leaves each rank with as many batches as steps (e.g. a rank drawing from a loader it does not
train on).
"""

from typing import Dict, List, Tuple

import torch

from opacus_dp.data.samplers import logical_batches_handed_out, shard_assignment_in_use
from opacus_dp.optim.step_refusal import OUT_OF_STEP, StepRefusedError

FORWARD, BACKWARD, STEP = 1, 2, 3
PHASES = {FORWARD: "a forward pass", BACKWARD: "a backward pass", STEP: "optimizer.step()"}
CLOCK_COLUMNS = 3  # [phase, logical batches since the last step, shard assignment]


class RanksOutOfStepError(StepRefusedError):
    """Raised on every rank when the ranks met in a collective of a private step from different
    phases or after different numbers of batches (module doc). ``clock`` maps each rank to its
    ``(phase, batches since its last step)``; ``refusals`` names the ranks that differ from the
    most common reading (reason ``OUT_OF_STEP``)."""

    def __init__(self, message: str, refusals: Dict[int, int], clock: Dict[int, Tuple[int, int]]):
        super().__init__(message, refusals)
        self.clock = dict(clock)


class StepClock:
    """This rank's clock: the logical batches handed out since its last step (module doc)."""

    def __init__(self):
        self._mark = logical_batches_handed_out()

    def row(self, phase: int) -> List[float]:
        """``[phase, b, s]``: the columns this rank appends to a collective of the step."""
        return [float(phase), float(logical_batches_handed_out() - self._mark), shard_assignment_in_use()]

    def step_over(self) -> None:
        """A step's collective completed (the step taken or refused): count from here."""
        self._mark = logical_batches_handed_out()


def check_clock(columns: torch.Tensor) -> None:
    """Raise :class:`RanksOutOfStepError` on every rank unless every rank's ``[phase, b, s]`` row
    of ``columns`` (shape ``(W, 3)``) is the same."""
    if bool((columns == columns[0]).all()):
        return
    readings = {rank: (int(phase), int(batches)) for rank, (phase, batches, _) in enumerate(columns.tolist())}
    _check_shards(columns, readings)
    values = list(readings.values())
    # the most common reading; on a tie the one with fewer batches (a skipping rank has more)
    common = max(set(values), key=lambda r: (values.count(r), -r[1], r == readings[0]))
    odd = {rank: OUT_OF_STEP for rank, reading in readings.items() if reading != common}
    raise RanksOutOfStepError(_message(readings), odd, readings)


def _message(readings: Dict[int, Tuple[int, int]]) -> str:
    where = "; ".join(f"rank {rank} in {PHASES.get(phase, f'phase {phase}')} after {batches} "
                      f"batch{'es' if batches != 1 else ''} since its last step"
                      for rank, (phase, batches) in sorted(readings.items()))
    return (
        f"the ranks are out of step ({where}): a rank skipped a batch or a step outside the "
        "optimizer (e.g. caught an exception, such as a NaN loss, and went on with the next "
        "batch). Nothing of this step was applied on any rank. Every rank must run the same "
        "sequence for every batch: forward, backward, optimizer.step(), even with a NaN loss "
        "(a non-finite sample is dropped by the step) or an empty batch. Under DDP/DPDDP the "
        "ranks pair again from the next batch; under FSDP2 a forward or backward pass was cut "
        "short: restart every rank from the last checkpoint. (Under FSDP2 with BatchMemoryManager, ranks "
        "whose distributed DP loaders were seeded differently also cut their batches into different "
        "numbers of pieces: build the loader with make_private, which shares rank 0's sampling state, "
        "or seed the DPDataLoader's generator alike on every rank)")


def _check_shards(columns: torch.Tensor, readings: Dict[int, Tuple[int, int]]) -> None:
    """Raise :class:`RanksOutOfStepError` if the ranks agree on phase and batches (``readings``) but
    drew their batches from different shard assignments (``set_epoch`` called on some ranks only)."""
    if len(set(readings.values())) != 1:
        return
    seeds = columns[:, 2].tolist()
    common = max(set(seeds), key=lambda seed: (seeds.count(seed), seed == seeds[0]))
    odd = {rank: OUT_OF_STEP for rank, seed in enumerate(seeds) if seed != common}
    raise RanksOutOfStepError(
        f"the ranks drew this batch from different shard assignments ((shuffle_seed + epoch) mod 256 per rank: "
        f"{ {rank: int(seed) for rank, seed in enumerate(seeds)} }): set_epoch was called on some ranks only, "
        "or with other values, so an example or user could be in two ranks' batches and clipped on each. "
        "Nothing of this step was applied on any rank. Call loader.batch_sampler.set_epoch(epoch) with the "
        "same epoch on every rank (or on none) before each pass", odd, readings)
