"""One accountant record per logical batch, with the sample rate of the data it really used.

* Several backward passes before one step (fixed-size batches): the step uses ``k`` batches,
  so Opacus 1.6 records ``k·q`` and divides the mean by ``k·E|B|``; the reference library is
  run inside the test on the same loop.
* Merging several fixed-size batches with ``virtual_step`` (beyond the declared logical batch)
  must be refused, as Opacus 0.x refused a step larger than ``batch_size``.
* Poisson batches cannot be merged at all (refused), an empty batch with another one neither.
* A step that fails must not leave the clipped sums of its logical batch behind to be merged
  into the next step.
"""

import pytest
import torch
from torch.utils.data import DataLoader

from opacus_dp import PrivacyEngine
from opacus_dp.errors import PrivacyBudgetExceededError
from opacus_dp.grad_sample import GradSampleModule
from opacus_dp.optim import DPOptimizer

from tests.review.helpers import loss_of, make_private, quiet, tiny_dataset, tiny_model


def _two_passes_then_step(engine_cls, sigma=1.0):
    model = tiny_model(seed=3)
    engine = quiet(engine_cls, accountant="rdp")
    gsm, optimizer, loader = quiet(
        engine.make_private, module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(tiny_dataset(40), batch_size=10), noise_multiplier=sigma,
        max_grad_norm=1e6, poisson_sampling=False)
    batches = iter(loader)
    for _ in range(2):
        x, y = next(batches)
        quiet(lambda: loss_of(gsm, x, y).backward())  # the reference's hooks warn on inputs
    optimizer.step()
    optimizer.zero_grad()
    return engine.accountant.history, [p.detach().clone() for p in model.parameters()]


def test_two_backward_passes_before_a_step_are_accounted_like_opacus():
    import opacus

    ours, _ = _two_passes_then_step(PrivacyEngine)
    reference, _ = _two_passes_then_step(opacus.PrivacyEngine)
    assert [tuple(map(float, h[:2])) + (h[2],) for h in reference] == [(1.0, 0.5, 1)]
    assert [tuple(h) for h in ours] == [(1.0, 0.5, 1)]


def test_two_backward_passes_before_a_step_average_like_opacus():
    import opacus

    _, ours = _two_passes_then_step(PrivacyEngine, sigma=0.0)
    _, reference = _two_passes_then_step(opacus.PrivacyEngine, sigma=0.0)
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_budget_guard_sees_the_sample_rate_that_is_recorded():
    """ε(one step at q=0.5) > max ≥ ε(one step at q=0.25): the merged step must be refused."""
    max_epsilon = 3.5
    engine, gsm, optimizer, loader = make_private(
        tiny_model(), poisson_sampling=False,
        engine_kwargs=dict(accountant="rdp", max_epsilon=max_epsilon, max_epsilon_delta=1e-5))
    before = [p.detach().clone() for p in gsm.parameters()]
    batches = iter(loader)
    for _ in range(2):
        x, y = next(batches)
        loss_of(gsm, x, y).backward()
    try:
        optimizer.step()
    except PrivacyBudgetExceededError:
        for a, b in zip(gsm.parameters(), before):
            assert torch.equal(a.detach(), b)
    assert engine.get_epsilon(1e-5) <= max_epsilon


def test_poisson_batches_cannot_be_merged_by_two_backward_passes():
    engine, gsm, optimizer, loader = make_private(tiny_model(), poisson_sampling=True)
    x, y = tiny_dataset(40).tensors
    loss_of(gsm, x[:5], y[:5]).backward()
    with pytest.raises(ValueError, match="second batch"):
        loss_of(gsm, x[5:9], y[5:9]).backward()


@pytest.mark.parametrize("sizes", [(0, 4), (3, 0), (0, 0)])
@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost", "bk", "auto"])
def test_an_empty_poisson_batch_cannot_be_merged_with_another(mode, sizes):
    """An empty batch is a batch: merged with another into one step it would be recorded as
    one batch of rate q (inclusion ≈ 2q per recorded step)."""
    model = tiny_model(seed=4)
    engine = quiet(PrivacyEngine, accountant="rdp")
    result = quiet(engine.make_private, module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                   data_loader=DataLoader(tiny_dataset(40), batch_size=10), noise_multiplier=1.0,
                   max_grad_norm=1.0, poisson_sampling=True, grad_sample_mode=mode)
    gsm, optimizer = result[0], result[1]
    before = [p.detach().clone() for p in model.parameters()]
    x, y = tiny_dataset(40).tensors
    with pytest.raises(ValueError, match="second batch"):
        for start, size in zip((0, 10), sizes):
            loss_of(gsm, x[start:start + size], y[start:start + size], reduction="sum").backward()
        optimizer.step()
    assert len(engine.accountant) == 0
    for a, b in zip(model.parameters(), before):
        assert torch.equal(a.detach(), b)


def test_virtual_step_merging_fixed_size_batches_of_the_loader_is_refused():
    engine, gsm, optimizer, loader = make_private(tiny_model(), poisson_sampling=False)
    before = [p.detach().clone() for p in gsm.parameters()]
    batches = iter(loader)
    for part in range(2):
        x, y = next(batches)
        loss_of(gsm, x, y).backward()
        if part == 0:
            optimizer.virtual_step()
            optimizer.zero_grad()
    with pytest.raises(ValueError, match="batch"):
        optimizer.step()
    assert len(engine.accountant) == 0
    for a, b in zip(gsm.parameters(), before):
        assert torch.equal(a.detach(), b)


def test_classic_virtual_steps_beyond_declared_batch_size_are_refused():
    """Opacus 0.x: batch_size is the logical batch; a step on more samples is an error."""
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = quiet(PrivacyEngine, model, batch_size=4, sample_size=40, noise_multiplier=1.0,
                   max_grad_norm=1.0)
    quiet(engine.attach, optimizer)
    x, y = tiny_dataset(40).tensors
    with pytest.raises(ValueError, match="batch_size"):
        for i in range(3):
            loss_of(model, x[4 * i:4 * i + 4], y[4 * i:4 * i + 4]).backward()
            optimizer.step() if i == 2 else optimizer.virtual_step()
    assert engine.steps == 0


def test_classic_two_backward_passes_beyond_declared_batch_size_are_refused():
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = quiet(PrivacyEngine, model, batch_size=4, sample_size=40, noise_multiplier=1.0,
                   max_grad_norm=1.0)
    quiet(engine.attach, optimizer)
    x, y = tiny_dataset(40).tensors
    loss_of(model, x[:4], y[:4]).backward()
    loss_of(model, x[4:8], y[4:8]).backward()
    with pytest.raises(ValueError, match="batch_size"):
        optimizer.step()
    assert engine.steps == 0


def test_classic_poisson_batches_cannot_be_merged_by_two_backward_passes():
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = quiet(PrivacyEngine, model, batch_size=4, sample_size=40, noise_multiplier=1.0,
                   max_grad_norm=1.0, poisson=True)
    quiet(engine.attach, optimizer)
    x, y = tiny_dataset(40).tensors
    loss_of(model, x[:4], y[:4]).backward()
    with pytest.raises(ValueError, match="second batch"):
        loss_of(model, x[4:9], y[4:9]).backward()


def test_classic_virtual_steps_within_the_declared_logical_batch_are_one_step():
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = quiet(PrivacyEngine, model, batch_size=12, sample_size=48, noise_multiplier=1.0,
                   max_grad_norm=1.0)
    quiet(engine.attach, optimizer)
    x, y = tiny_dataset(48).tensors
    for i in range(3):
        loss_of(model, x[4 * i:4 * i + 4], y[4 * i:4 * i + 4]).backward()
        optimizer.step() if i == 2 else optimizer.virtual_step()
        optimizer.zero_grad()
    assert engine.accountant.history == [(1.0, 0.25, 1)]


def test_failed_last_chunk_does_not_leak_into_the_next_logical_batch():
    """Chunk A (skipped step), chunk B (non-finite, its step raises), then batch C: the update of
    C's step is C's gradient alone (σ = 0, no clipping, sum reduction)."""
    model = tiny_model(seed=4)
    gsm = GradSampleModule(model, loss_reduction="sum")
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0,
                            max_grad_norm=1e6, expected_batch_size=1, loss_reduction="sum")
    optimizer.non_finite_samples = "refuse"  # the debugging switch: a non-finite sample raises
    x, y = tiny_dataset(12).tensors
    optimizer.signal_skip_step(do_skip=True)
    loss_of(gsm, x[:4], y[:4], "sum").backward()
    optimizer.step()
    optimizer.zero_grad()
    bad = x[4:8].clone()
    bad[0, 0] = float("nan")
    optimizer.signal_skip_step(do_skip=False)
    loss_of(gsm, bad, y[4:8], "sum").backward()
    with pytest.raises(ValueError, match="non-finite"):
        optimizer.step()
    optimizer.zero_grad()
    start = [p.detach().clone() for p in model.parameters()]
    gsm.disable_hooks()
    expected_grads = torch.autograd.grad(loss_of(model, x[8:], y[8:], "sum"), list(model.parameters()))
    gsm.enable_hooks()
    optimizer.signal_skip_step(do_skip=False)
    loss_of(gsm, x[8:], y[8:], "sum").backward()
    optimizer.step()
    for p, p0, g in zip(model.parameters(), start, expected_grads):
        torch.testing.assert_close(p.detach(), p0 - g, rtol=1e-9, atol=1e-12)
    gsm.close()


def test_the_step_refuses_poisson_batches_merged_past_the_wrapper():
    """The optimizer checks too: with the wrapper told to allow accumulation, two Poisson
    batches still cannot become one step."""
    engine, gsm, optimizer, loader = make_private(tiny_model(), poisson_sampling=True)
    gsm.allow_grad_accumulation()
    before = [p.detach().clone() for p in gsm.parameters()]
    x, y = tiny_dataset(40).tensors
    loss_of(gsm, x[:5], y[:5]).backward()
    loss_of(gsm, x[5:9], y[5:9]).backward()
    with pytest.raises(ValueError, match="one step over 2 backward passes with Poisson sampling"):
        optimizer.step()
    assert len(engine.accountant) == 0
    for a, b in zip(gsm.parameters(), before):
        assert torch.equal(a.detach(), b)


class _AuxOnNoRows(torch.nn.Module):
    """A batch whose forward also calls a layer on no rows (an empty selection)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.aux = torch.nn.Linear(4, 3), torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h) + self.aux(h[:0]).sum(0)


@pytest.mark.parametrize("poisson_sampling", [False, True])
@pytest.mark.parametrize("mode", ["bk", "auto"])
def test_a_layer_called_on_no_rows_within_a_batch_adds_no_batch(mode, poisson_sampling):
    """One batch, one step: the empty call's backward is part of the batch's pass (it had been
    counted as a second batch: the update halved, or the Poisson step refused)."""
    torch.manual_seed(0)
    model = _AuxOnNoRows().double()
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randint(0, 2, (8,))
    plain = [p.detach().clone() for p in model.parameters()]
    engine = quiet(PrivacyEngine, accountant="rdp")
    gsm, optimizer, _ = quiet(
        engine.make_private, module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8), noise_multiplier=0.0,
        max_grad_norm=1e6, poisson_sampling=poisson_sampling, grad_sample_mode=mode)
    loss_of(gsm, x, y).backward()
    optimizer.step()
    assert len(engine.accountant) == 1
    ref = _AuxOnNoRows().double()  # σ = 0, no clipping: the plain gradient step
    with torch.no_grad():
        for p, q in zip(ref.parameters(), plain):
            p.copy_(q)
    loss_of(ref, x, y).backward()
    for p, q, r in zip(model.parameters(), plain, ref.parameters()):
        expected = q - r.grad * (8 / optimizer.expected_batch_size)
        torch.testing.assert_close(p.detach(), expected, rtol=1e-9, atol=1e-12)
