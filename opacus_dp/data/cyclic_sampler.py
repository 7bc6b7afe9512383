"""Cyclic Poisson sampling: the sampling of amplified banded matrix factorisation.

Every example index is assigned to one of ``b`` groups, independently and uniformly, by a
generator seeded with the public ``partition_seed`` (the analysis holds for any assignment fixed
before seeing the data; every process and resumed run finds the same one, and the assignment
of the first ``N`` indices does not depend on how many follow); step ``t`` draws a Poisson
batch (each example independently with probability ``group_rate``) from group ``t mod b`` only. So an example can take part at
most once in any ``b`` consecutive steps ("b-min-separated" participation) and at most
``⌈T/b⌉`` times in ``T`` steps (Choquette-Choo et al. 2023, "(Amplified) Banded Matrix
Factorization", §4). With ``group_rate = 1`` the batches are the groups themselves, in a fixed
cyclic order (every example once every ``b`` steps). With ``num_replicas`` processes sharing
the generator's state, each draws the same global batch and keeps its share ``rank::R`` of it.

**One step index.** ``t`` is read from a :class:`StepSchedule`, the counter the accountant charges
rounds from (the optimizer's released steps, ``DPOptimizer.steps_taken``, saved in checkpoints).
A pass (one iterator) draws ``steps`` batches for the steps ``t₀, t₀+1, …``, ``t₀`` the schedule's
position at its first draw: after an early ``break``, in a new iterator, or resumed from a
checkpoint, the sampling continues exactly where the released steps are. Each batch must feed
the step after it, so a draw is refused (:class:`OutOfScheduleError`) when the steps and the
batches of a pass disagree: a batch that got no step (``continue``, batches taken ahead) or
steps fed by another iterator. Loaders with worker processes draw ahead (``draws_ahead``): the
check then happens when a batch is handed out (:meth:`CyclicPoissonSampler.check_hand_out`,
each pass with its own record of the steps it drew).
Without a connected schedule the sampler counts its own draws (every drawn batch a step).
"""

from collections import deque
from typing import Callable, Iterator, List, Optional

import torch
from torch.utils.data import Sampler

from opacus_dp.data.samplers import check_positive_int, check_sample_rate, poisson_mask


class OutOfScheduleError(RuntimeError):
    """A batch of a cyclic Poisson loader would feed a step other than the one it was drawn for
    (its group would break the participation pattern the accountant charges)."""


class StepSchedule:
    """The index of the coming private step, read from one ``counter`` (the optimizer's
    ``steps_taken``) by both the cyclic sampler and the noise mechanism."""

    def __init__(self, counter: Optional[Callable[[], int]] = None):
        self._counter = counter

    def follow(self, counter: Callable[[], int]) -> None:
        """Read the step index from ``counter`` from now on."""
        self._counter = counter

    @property
    def connected(self) -> bool:
        return self._counter is not None

    def next_step(self) -> int:
        """The index (0-based) of the next step to be released."""
        if self._counter is None:
            raise RuntimeError("this StepSchedule follows no step counter yet (StepSchedule.follow)")
        return int(self._counter())


def _out_of_schedule(drawn: int, position: int) -> OutOfScheduleError:
    if drawn > position:
        cause = (f"the batch of step {drawn} is requested while the optimizer's next step is {position}: "
                 "a batch of this pass got no optimizer.step() (a `continue`, or batches taken ahead, "
                 "e.g. list(loader) or a prefetching wrapper)")
    else:
        cause = (f"this pass drew the batch of step {drawn}, but the optimizer has already released "
                 f"step {position - 1}: its steps were fed by another iterator of this loader (two "
                 "passes open at once), or a batch was used for more than one step")
    return OutOfScheduleError(
        f"cyclic Poisson loader: {cause}. Correlated noise charges step t for group t mod groups, so "
        "every batch must be followed by its optimizer.step() before the next is requested. To skip "
        "batches, leave the loop (break) and iterate the loader again: a new pass continues at the "
        "optimizer's next step. Nothing was released for this batch")


class CyclicPoissonSampler(Sampler[List[int]]):
    """Batch sampler of the module doc over ``range(num_samples)``; ``generator`` draws the
    Poisson masks, ``schedule`` gives the step index (default: the sampler's own draw count)."""

    def __init__(self, num_samples: int, *, groups: int, group_rate: float, generator=None,
                 steps: Optional[int] = None, partition_seed: int = 0, rank: int = 0,
                 num_replicas: int = 1, schedule: Optional[StepSchedule] = None):
        self.num_samples = check_positive_int(num_samples, "num_samples")
        self.groups = check_positive_int(groups, "groups")
        if self.groups > self.num_samples:
            raise ValueError(f"cannot split {num_samples} examples into {groups} non-empty groups")
        self.sample_rate = check_sample_rate(group_rate)
        self.generator = generator
        steps = self.groups if steps is None else check_positive_int(steps, "steps")
        self.steps = -(-steps // self.groups) * self.groups
        self.rank, self.num_replicas = int(rank), check_positive_int(num_replicas, "num_replicas")
        self.assignment = torch.randint(0, self.groups, (self.num_samples,),
                                        generator=torch.Generator().manual_seed(int(partition_seed)))
        self.partition = [torch.nonzero(self.assignment == g).view(-1) for g in range(self.groups)]
        self.schedule = schedule if schedule is not None else StepSchedule()
        self.draws_ahead = False  # set by a loader with worker processes (module doc)
        # a deque the next pass appends the step of each drawn batch to (set by a loader
        # drawing ahead just before it starts a pass; each pass takes its own)
        self.label_sink: Optional[deque] = None
        self._draws = 0  # batches drawn: the position without a connected schedule

    def __len__(self) -> int:
        return self.steps

    def group_of(self, step: int) -> torch.Tensor:
        """Indices of the group sampled at ``step``."""
        return self.partition[step % self.groups]

    def position(self) -> int:
        """The index of the next step: the schedule's, or the number of batches drawn."""
        return self.schedule.next_step() if self.schedule.connected else self._draws

    def __iter__(self) -> Iterator[List[int]]:
        first, labels = self.position(), self.label_sink
        self.label_sink = None
        for offset in range(self.steps):
            step = first + offset
            self._check_draw(step)
            group = self.group_of(step)
            chosen = group[poisson_mask(len(group), self.sample_rate, self.generator)]
            self._draws += 1
            if labels is not None:
                labels.append(step)
            yield chosen[self.rank::self.num_replicas].tolist()

    def _check_draw(self, step: int) -> None:
        """Drawn at the request (no worker processes): the step must be the next one; drawn
        ahead: never a step already released."""
        if not self.schedule.connected:
            return
        position = self.schedule.next_step()
        if step < position or (step != position and not self.draws_ahead):
            raise _out_of_schedule(step, position)

    def check_hand_out(self, step: int) -> None:
        """For a loader drawing ahead, when it hands out the batch drawn for ``step``: that
        must be the next step."""
        if self.schedule.connected and step != self.schedule.next_step():
            raise _out_of_schedule(step, self.schedule.next_step())

    def expected_batch_size(self) -> float:
        """``q_g · N / (b · R)`` (averaged over the groups), per process."""
        return self.num_samples * self.sample_rate / (self.groups * self.num_replicas)
