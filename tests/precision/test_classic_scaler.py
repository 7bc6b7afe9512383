"""The classic ``attach`` API with ``torch.amp.GradScaler`` (float16 autocast) behaves as
``make_private`` does: the same private step (the patched optimizer hands the scaler to it).

Compared, for every mode, both loss reductions and a batch with an overflowing sample: the
updates (σ = 0: against the float32 per-sample oracle without that sample; σ > 0: against the
modern API with the same noise seed), the scale after each step, and the accountant — every
``scaler.step`` is a noised, recorded step (none is skipped: an overflowing sample is dropped),
checked against Opacus's RDP accountant for that many steps.
"""

import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import opacus_dp
from tests.precision.helpers import clipped_sum, mlp, per_sample_grads, relative_error, squared_error

pytestmark = [pytest.mark.filterwarnings("ignore:GradScaler is going to stop"),
              pytest.mark.filterwarnings("ignore:secure_mode"), pytest.mark.filterwarnings("ignore::UserWarning")]

FP16_TOLERANCE = 4e-3  # 8 float16 units (2⁻¹¹), relative to each tensor's largest entry
SCALE, LR, N, SAMPLE_SIZE, BAD = 2.0 ** 8, 0.1, 6, 60, 2


def _data(step: int, bad: bool):
    g = torch.Generator().manual_seed(10 + step)
    x, y = torch.randn(N, 8, generator=g), torch.randn(N, 4, generator=g)
    if bad and step == 0:
        y[BAD] = 3e4  # output gradient ≥ 2 · 3e4 / 24 · 2⁸ (mean): beyond float16's 65504
    return x, y


def _classic(model, mode, reduction, sigma, c):
    engine = opacus_dp.PrivacyEngine(
        model, batch_size=N, sample_size=SAMPLE_SIZE, noise_multiplier=sigma, max_grad_norm=c,
        loss_reduction=reduction, grad_sample_mode=mode, noise_generator=torch.Generator().manual_seed(5))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine.attach(optimizer)
    return model, optimizer, None, lambda: (len(engine.accountant), list(engine.accountant.history))


def _modern(model, mode, reduction, sigma, c):
    engine = opacus_dp.PrivacyEngine(accountant="rdp")
    data = TensorDataset(torch.zeros(SAMPLE_SIZE, 8), torch.zeros(SAMPLE_SIZE, 4))  # q = N / SAMPLE_SIZE
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
            data_loader=DataLoader(data, batch_size=N), noise_multiplier=sigma, max_grad_norm=c,
            grad_sample_mode=mode, poisson_sampling=False, loss_reduction=reduction,
            noise_generator=torch.Generator().manual_seed(5),
            **({"criterion": nn.MSELoss(reduction=reduction)} if mode == "ghost" else {}))
    return (out[0], out[1], (out[2] if len(out) == 4 else None),
            lambda: (len(engine.accountant), list(engine.accountant.history)))


def _loss(out, y, reduction, criterion):
    """``MSELoss(reduction)`` in float32 (ghost's criterion: its tensor, one book-keeping pass)."""
    if criterion is not None:
        return criterion(out.float(), y).value
    return nn.MSELoss(reduction=reduction)(out.float(), y)


def _run(api, mode, reduction, *, bad=False, sigma=0.0, c=0.5, steps=2, growth_interval=2000):
    """``(updates per step, scale after each step, (accounted steps, history))`` of a float16 loop."""
    model = mlp()
    module, optimizer, criterion, accounted = api(model, mode, reduction, sigma, c)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=growth_interval)
    updates, scales = [], []
    for step in range(steps):
        x, y = _data(step, bad)
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = module(x)
        scaler.scale(_loss(out, y, reduction, criterion)).backward()
        scaler.step(optimizer)
        scaler.update()
        updates.append([(b - p.detach()) / LR for b, p in zip(before, model.parameters())])
        scales.append(scaler.get_scale())
    return updates, scales, accounted()


@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost", "bk"])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("bad", [False, True])
def test_classic_scaled_steps_match_the_oracle_and_make_private(mode, reduction, bad):
    classic = _run(_classic, mode, reduction, bad=bad)
    modern = _run(_modern, mode, reduction, bad=bad)
    x, y = _data(0, bad)
    keep = [i for i in range(N) if not (bad and i == BAD)]
    # a mean over the batch of l_i = ‖out_i − y_i‖² / 4 (MSELoss averages the 4 outputs too)
    loss = squared_error if reduction == "sum" else (lambda o, t: squared_error(o, t) / 4)
    expected = clipped_sum([g[keep] for g in per_sample_grads(mlp(), x, y, loss)], "flat", 0.5)
    if reduction == "mean":  # divided by the expected batch size, dropped samples included
        expected = [e / N for e in expected]
    assert relative_error(classic[0][0], expected) < FP16_TOLERANCE
    for got, want in zip(classic[0], modern[0]):
        assert relative_error(got, want) < 1e-6
    assert classic[1] == modern[1] == [SCALE, SCALE]  # no data-dependent backoff
    assert classic[2] == modern[2] == (2, [(0.0, N / SAMPLE_SIZE, 2)])  # every step recorded, none skipped


def test_a_growing_scale_noise_and_accounting_are_those_of_make_private():
    """``growth_interval=1``: the scale doubles, the next step reports it above the first scale
    and the scaler backs off; every step is still noised, applied and recorded."""
    steps, sigma = 4, 1.0
    classic = _run(_classic, "hooks", "mean", bad=True, sigma=sigma, steps=steps, growth_interval=1)
    modern = _run(_modern, "hooks", "mean", bad=True, sigma=sigma, steps=steps, growth_interval=1)
    assert classic[1] == modern[1] == [2 * SCALE, SCALE, 2 * SCALE, SCALE]
    for got, want in zip(classic[0], modern[0]):
        assert relative_error(got, want) < 1e-6
        assert all(u.abs().sum() > 0 for u in got)
    assert classic[2] == modern[2] == (steps, [(sigma, N / SAMPLE_SIZE, steps)])


def test_the_classic_epsilon_counts_every_scaled_step():
    """Independent oracle: Opacus's RDP accountant charged for every ``scaler.step``."""
    opacus_rdp = pytest.importorskip("opacus.accountants").RDPAccountant
    model = mlp()
    _, optimizer, _, _ = _classic(model, "hooks", "sum", 1.0, 0.5)
    engine = optimizer.privacy_engine
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=1)
    for step in range(3):
        x, y = _data(step, bad=True)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        scaler.scale(squared_error(out, y)).backward()
        scaler.step(optimizer)
        scaler.update()
    reference = opacus_rdp()
    for _ in range(3):
        reference.step(noise_multiplier=1.0, sample_rate=N / SAMPLE_SIZE)
    want = reference.get_epsilon(delta=1e-5, alphas=list(engine.alphas))
    assert engine.get_privacy_spent(1e-5)[0] == pytest.approx(want, rel=1e-9)


def test_pieces_cut_with_signal_skip_step_are_one_recorded_step():
    """A logical batch of ``N`` in two pieces, each passed to ``scaler.step``: one accounted
    step whose update is the per-sample oracle of the whole batch."""
    model = mlp()
    _, optimizer, _, accounted = _classic(model, "hooks", "sum", 0.0, 0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    x, y = _data(1, bad=False)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.zero_grad()
    for piece in (slice(0, N // 2), slice(N // 2, N)):
        if piece.start == 0:
            optimizer.signal_skip_step()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x[piece])
        scaler.scale(_loss(out, y[piece], "sum", None)).backward()
        scaler.step(optimizer)
        scaler.update()
    update = [(b - p.detach()) / LR for b, p in zip(before, model.parameters())]
    assert relative_error(update, clipped_sum(per_sample_grads(mlp(), x, y), "flat", 0.5)) < FP16_TOLERANCE
    assert accounted() == (1, [(0.0, N / SAMPLE_SIZE, 1)])


@pytest.mark.parametrize("api", [_classic, _modern])
def test_unscale_before_the_step_changes_nothing(api):
    """``scaler.unscale_(optimizer)`` (its found_inf read from the overflow of the ordinary
    ``p.grad``, data-dependent) is replaced by the step's: no backoff, the oracle's update."""
    model = mlp()
    module, optimizer, criterion, accounted = api(model, "hooks", "sum", 0.0, 0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    x, y = _data(0, bad=True)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        out = module(x)
    scaler.scale(_loss(out, y, "sum", criterion)).backward()
    scaler.unscale_(optimizer)
    assert not all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())  # p.grad overflowed
    scaler.step(optimizer)
    scaler.update()
    update = [(b - p.detach()) / LR for b, p in zip(before, model.parameters())]
    keep = [i for i in range(N) if i != BAD]
    assert relative_error(update, clipped_sum([g[keep] for g in per_sample_grads(mlp(), x, y)], "flat", 0.5)) \
        < FP16_TOLERANCE
    assert scaler.get_scale() == SCALE and accounted()[0] == 1
