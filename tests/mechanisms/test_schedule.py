"""The group schedule of correlated noise and the accountant's rounds come from one step index.

Every test records the example indices each *released* step actually used (a dataset that
returns its own index) and checks them by hand against what the accountant charged:

* each example takes part at most once between two charged steps, a charge covers at most
  ``b`` steps, and two participations of an example are at least ``b`` (banded) or exactly a
  multiple of the period (tree, BLT: every example once per pass, in a fixed slot) steps apart;
* ε equals a fresh accountant fed only the rounds the released steps needed (``⌈T/b⌉``).
"""

import math
import warnings
from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp import PrivacyEngine
from opacus_dp.data import BatchMemoryManager
from opacus_dp.data.cyclic_sampler import CyclicPoissonSampler, OutOfScheduleError

DELTA = 1e-5
SIGMA = 1.0
# engines without secure_mode (a reminder tested in tests/engine/test_secure_mode_notice.py)
pytestmark = pytest.mark.filterwarnings("ignore::opacus_dp.engine.private_step.SecureModeNotice")


def indexed_data(n: int = 64) -> TensorDataset:
    generator = torch.Generator().manual_seed(5)
    return TensorDataset(torch.randn(n, 8, generator=generator), torch.randint(0, 2, (n,), generator=generator),
                         torch.arange(n))


class Run:
    """A private run whose released steps are recorded with the examples they used."""

    def __init__(self, mechanism="banded", bands=4, batch_size=8, epochs=3, num_workers=0, seed=0):
        torch.manual_seed(seed)
        model = nn.Linear(8, 2)
        self.engine = PrivacyEngine(accountant="rdp")
        bands = bands if mechanism == "banded" else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.model, self.opt, self.dl = self.engine.make_private(
                module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                data_loader=DataLoader(indexed_data(), batch_size=batch_size, num_workers=num_workers),
                noise_multiplier=SIGMA, max_grad_norm=1.0, noise_mechanism=mechanism, bands=bands,
                epochs=epochs, noise_generator=torch.Generator().manual_seed(seed + 1))
        self.released = []  # the examples of each released step, in order
        self._pieces = []

    def step(self, batch) -> None:
        """Forward, backward and optimizer.step() on ``batch`` (a BatchMemoryManager piece: the
        pieces join the release that follows them)."""
        x, y, index = batch
        self._pieces += index.tolist()
        F.cross_entropy(self.model(x), y).backward()
        before = len(self.engine.accountant)  # steps recorded
        self.opt.step()
        self.opt.zero_grad()
        if len(self.engine.accountant) > before:
            self.released.append(self._pieces)
            self._pieces = []

    def groups(self) -> list:
        """The group of each example (public partition)."""
        return self.dl.batch_sampler.assignment.tolist()

    @property
    def period(self) -> int:
        return self.dl.batch_sampler.groups


def charged_rates(run: Run) -> list:
    """The rate the accountant charged each recorded step (its history merges equal events)."""
    return [q for _, q, steps in run.engine.accountant.history for _ in range(steps)]


def check_participation(run: Run, bands: int) -> None:
    """The by-hand count of the module doc over the released steps."""
    rates = charged_rates(run)
    assert len(rates) == len(run.released)
    charged = [t for t, rate in enumerate(rates) if rate > 0]
    assert charged and charged[0] == 0
    bounds = charged + [len(run.released)]
    for start, end in zip(bounds, bounds[1:]):
        assert end - start <= bands, f"one charge covers steps {start}..{end - 1}"
        seen = Counter(i for step in run.released[start:end] for i in step)
        assert max(seen.values(), default=0) <= 1, f"an example took part twice in the round at step {start}"
    last = {}
    for t, step in enumerate(run.released):
        for i in step:
            assert t - last.get(i, -math.inf) >= bands, f"example {i} at steps {last[i]} and {t}"
            last[i] = t


def check_epsilon(run: Run, bands: int) -> None:
    """ε of the run equals a fresh replay of the ⌈T/b⌉ rounds the released steps needed."""
    rounds = math.ceil(len(run.released) / bands)
    replay = PrivacyEngine(accountant="rdp")
    replay.accountant.history = [(SIGMA, run.dl.batch_sampler.sample_rate, rounds)]
    assert run.engine.get_epsilon(DELTA) == pytest.approx(replay.get_epsilon(DELTA), rel=1e-9)


@pytest.mark.parametrize("batch_size", [8, 16])  # group rate 1/2 and 1 (each group taken whole)
def test_early_break_then_new_pass_continues_the_schedule(batch_size):
    """The issue's loop: bands=4, break at i == 2 for 2 passes."""
    run = Run(batch_size=batch_size)
    for _ in range(2):
        for i, batch in enumerate(run.dl):
            run.step(batch)
            if i == 2:
                break
    assert len(run.released) == 6
    check_participation(run, bands=4)
    check_epsilon(run, bands=4)
    groups = run.groups()
    assert all(groups[i] == t % 4 for t, step in enumerate(run.released) for i in step)


def test_a_batch_drawn_but_never_stepped_is_drawn_again_for_its_step():
    run = Run(batch_size=16)
    for i, batch in enumerate(run.dl):
        if i == 2:
            dropped = batch[2].tolist()  # drawn, never stepped: nothing released
            break
        run.step(batch)
    run.step(next(iter(run.dl)))
    groups = run.groups()
    assert {groups[i] for i in dropped} == {2} and sorted(run.released[2]) == sorted(dropped)
    check_participation(run, bands=4)
    check_epsilon(run, bands=4)


def test_a_batch_without_its_step_is_refused_then_a_new_pass_continues():
    run = Run()
    batches = iter(run.dl)
    run.step(next(batches))
    next(batches)  # a `continue`: no step for this batch
    with pytest.raises(OutOfScheduleError, match="got no optimizer.step"):
        next(batches)
    with pytest.raises(OutOfScheduleError, match="got no optimizer.step"):
        list(run.dl)  # batches taken ahead of their steps
    for i, batch in enumerate(run.dl):
        run.step(batch)
        if i == 4:
            break
    check_participation(run, bands=4)
    check_epsilon(run, bands=4)


def test_an_older_iterator_is_refused_once_another_fed_the_steps():
    run = Run(batch_size=16)
    first = iter(run.dl)
    run.step(next(first))
    second = iter(run.dl)  # a second pass opened while the first is alive continues the schedule
    run.step(next(second))
    run.step(next(second))
    with pytest.raises(OutOfScheduleError, match="another iterator"):
        next(first)
    run.step(next(second))
    check_participation(run, bands=4)
    assert [run.groups()[step[0]] for step in run.released] == [0, 1, 2, 3]


def test_batch_memory_manager_breaks_mid_batch_and_continues():
    """Pieces of one logical batch form one release; a loop left inside a logical batch drops it
    (nothing released) and the next pass draws that step's group again."""
    run = Run(batch_size=16)
    breaks = [2, 5]  # leave the loop after the first piece of the 3rd and of the 6th logical batch
    while len(run.released) < 7:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the dropped pieces are reported
            with BatchMemoryManager(data_loader=run.dl, max_physical_batch_size=5, optimizer=run.opt) as physical:
                for piece in physical:
                    run.step(piece)
                    if breaks and len(run.released) == breaks[0] and run._pieces:
                        breaks.pop(0)
                        run._pieces = []  # never released
                        break
                    if len(run.released) == 7:
                        break
    assert not breaks and max(len(step) for step in run.released) > 5  # several pieces per step
    check_participation(run, bands=4)
    check_epsilon(run, bands=4)
    groups = run.groups()
    assert all(groups[i] == t % 4 for t, step in enumerate(run.released) for i in step)


@pytest.mark.parametrize("mechanism", ["tree", "blt"])
def test_tree_and_blt_keep_each_example_in_its_slot(mechanism):
    """Their sensitivity assumes each example once per period, in a fixed slot."""
    run = Run(mechanism, batch_size=16)  # period 4 = the steps of a pass, groups taken whole
    for _ in range(3):
        for i, batch in enumerate(run.dl):
            run.step(batch)
            if i == 2:
                break
    period = run.period
    steps_of = {}
    for t, step in enumerate(run.released):
        for i in step:
            steps_of.setdefault(i, []).append(t)
    assert len(steps_of) == 64  # every group was taken whole
    for steps in steps_of.values():
        assert all(b - a == period for a, b in zip(steps, steps[1:]))
    assert charged_rates(run) == [1.0] + [0.0] * 8


def test_resume_mid_pass_equals_the_uninterrupted_run(tmp_path):
    whole = Run(epochs=2)
    while len(whole.released) < 11:
        for batch in whole.dl:
            whole.step(batch)
            if len(whole.released) == 11:
                break
    first = Run(epochs=2)
    for batch in first.dl:
        first.step(batch)
        if len(first.released) == 5:
            break  # mid-pass (8 steps per pass)
    first.engine.save_checkpoint(path=tmp_path / "mid.pt", module=first.model, optimizer=first.opt)
    resumed = Run(epochs=2)
    resumed.engine.load_checkpoint(path=tmp_path / "mid.pt", module=resumed.model, optimizer=resumed.opt)
    resumed.released = list(first.released)
    while len(resumed.released) < 11:
        for batch in resumed.dl:
            resumed.step(batch)
            if len(resumed.released) == 11:
                break
    assert resumed.released == whole.released
    assert resumed.engine.get_epsilon(DELTA) == whole.engine.get_epsilon(DELTA)
    assert all(torch.equal(a, b) for a, b in zip(resumed.model.parameters(), whole.model.parameters()))
    check_participation(resumed, bands=4)
    check_epsilon(resumed, bands=4)


def test_a_checkpoint_of_another_schedule_is_refused(tmp_path):
    run = Run(bands=4)
    for i, batch in enumerate(run.dl):
        run.step(batch)
        if i == 2:
            break
    run.engine.save_checkpoint(path=tmp_path / "b4.pt", module=run.model, optimizer=run.opt)
    other = Run(bands=2)
    with pytest.raises(ValueError, match="schedule"):
        other.engine.load_checkpoint(path=tmp_path / "b4.pt", module=other.model, optimizer=other.opt)
    assert other.opt.steps_taken == 0 and len(other.engine.accountant) == 0


def test_noise_state_and_step_count_that_disagree_are_refused_before_release():
    run = Run()
    run.step(next(iter(run.dl)))
    early = run.opt.noise_state_dict()
    batches = iter(run.dl)
    run.step(next(batches))
    run.opt.load_noise_state_dict(early)  # the noise of step 1 again, but the optimizer is at 2
    x, y, _ = next(batches)
    F.cross_entropy(run.model(x), y).backward()
    weights = [p.detach().clone() for p in run.model.parameters()]
    with pytest.raises(RuntimeError, match="noise has taken 1 steps but the optimizer has released 2"):
        run.opt.step()
    assert len(run.engine.accountant) == 2
    assert all(torch.equal(a, p) for a, p in zip(weights, run.model.parameters()))


def test_worker_processes_draw_ahead_and_are_checked_when_handed_out():
    run = Run(batch_size=16, num_workers=1)
    for _ in range(2):
        for i, batch in enumerate(run.dl):
            run.step(batch)
            if i == 2:
                break
    check_participation(run, bands=4)
    check_epsilon(run, bands=4)
    batches = iter(run.dl)
    next(batches)  # no step
    with pytest.raises(OutOfScheduleError, match="got no optimizer.step"):
        next(batches)


def test_a_sampler_without_an_optimizer_counts_its_own_draws():
    sampler = CyclicPoissonSampler(40, groups=4, group_rate=1.0, steps=8)
    groups = sampler.assignment.tolist()
    drawn = []
    for _ in range(2):
        for i, batch in enumerate(sampler):
            drawn.append({groups[j] for j in batch})
            if i == 2:
                break
    assert drawn == [{t % 4} for t in range(6)]


def test_two_passes_drawing_ahead_are_checked_each_against_its_own_draws():
    run = Run(batch_size=16, num_workers=1)
    first = iter(run.dl)
    run.step(next(first))  # step 0
    second = iter(run.dl)  # draws ahead from step 1
    run.step(next(first))  # the first pass's batch of step 1
    with pytest.raises(OutOfScheduleError, match="another iterator"):
        next(second)  # its batch of step 1 would feed step 2
    del first, second
    check_participation(run, bands=4)
    assert [run.groups()[step[0]] for step in run.released] == [0, 1]
