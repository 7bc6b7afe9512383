"""``torch.amp.GradScaler`` with float16 autocast (opacus_dp.optim.amp_scaling): the per-sample
norms and factors are unscaled, so the bound ``C`` holds in the gradient's units and the update
matches a float32 oracle to float16 rounding; an overflowing sample is dropped; the scaler gets
a ``found_inf`` that does not depend on the data, whatever ``p.grad`` held before the step."""

import pytest
import torch

import opacus_dp

from opacus_dp.optim.amp_scaling import ATTRIBUTE_CONTRACT, record_found_inf
from tests.precision.helpers import clipped_sum, mlp, per_sample_grads, private, relative_error, squared_error

pytestmark = [pytest.mark.filterwarnings("ignore:GradScaler is going to stop"),
              pytest.mark.filterwarnings("ignore:secure_mode")]

FP16_TOLERANCE = 4e-3  # 8 float16 units (2⁻¹¹), relative to each tensor's largest entry
SCALE = 2.0 ** 8
BAD = 2


def _data(n=6, bad=False):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)
    if bad:
        y[BAD] = 3e3  # output gradient ≈ 6e3 · 2⁸: beyond float16's 65504
    return x, y


def _scaled_step(module, optimizer, criterion, scaler, x, y, before_step=None):
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        out = module(x)
    loss = criterion(out.float(), y) if criterion is not None else squared_error(out, y)
    scaler.scale(getattr(loss, "value", loss)).backward()  # ghost: its plain loss tensor
    if before_step is not None:
        before_step()
    scaler.step(optimizer)
    scaler.update()


@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost", "bk"])
@pytest.mark.parametrize("bad", [False, True])
@pytest.mark.parametrize("c", [0.5, 50.0])
def test_matches_the_float32_oracle_and_drops_an_overflowing_sample(mode, bad, c):
    """``C = 50`` clips no kept sample (the scale would show unclipped), ``C = 0.5`` every one."""
    x, y = _data(bad=bad)
    _, module, optimizer, criterion = private(mlp(), x, y, mode=mode, c=c)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    _scaled_step(module, optimizer, criterion, scaler, x, y)
    grads = per_sample_grads(mlp(), x, y)
    keep = [i for i in range(len(x)) if not (bad and i == BAD)]
    got = [p.grad for p in optimizer.params]
    assert relative_error(got, clipped_sum([g[keep] for g in grads], "flat", c)) < FP16_TOLERANCE
    if bad:  # float32 clips the sample and keeps it: far from what float16 with the scale gave
        assert relative_error(got, clipped_sum(grads, "flat", c)) > 10 * FP16_TOLERANCE
    assert scaler.get_scale() == SCALE


@pytest.mark.parametrize("mode,clipping", [("hooks", "flat"), ("hooks", "per_layer"),
                                           ("functorch", "per_layer"), ("ghost", "flat"), ("bk", "flat")])
def test_no_sample_contributes_more_than_the_bound(mode, clipping):
    """One sample per batch, σ = 0, a sum loss: ``p.grad`` is its clipped contribution."""
    worst = 0.0
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        x, y = 3 * torch.randn(1, 8, generator=g), 5 * torch.randn(1, 4, generator=g)
        _, module, optimizer, criterion = private(mlp(seed), x, y, mode=mode, clipping=clipping, c=1e-2)
        _scaled_step(module, optimizer, criterion, torch.amp.GradScaler("cpu", init_scale=2.0 ** 10), x, y)
        worst = max(worst, float(torch.sqrt(sum(p.grad.double().pow(2).sum() for p in optimizer.params))))
    assert 0.9e-2 < worst <= 1e-2 * (1 + 1e-6)


def _scale_history(bad: bool, steps: int = 5):
    x, y = _data(bad=bad)
    engine, module, optimizer, criterion = private(mlp(), x, y, mode="bk")
    optimizer.original_optimizer.param_groups[0]["lr"] = 1e-3
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=2)
    history, params = [], [[p.detach().clone() for p in optimizer.params]]
    for _ in range(steps):
        _scaled_step(module, optimizer, criterion, scaler, x, y)
        history.append(scaler.get_scale())
        params.append([p.detach().clone() for p in optimizer.params])
    assert len(engine.accountant) == steps and optimizer.steps_taken == steps
    assert all(not torch.equal(a[0], b[0]) for a, b in zip(params, params[1:]))  # every step updates
    return history


def test_the_scale_follows_a_public_schedule_capped_at_growth_times_the_first():
    """Growth every 2 steps, never backed off by the data: the overflowing sample leaves the
    history unchanged; above the first scale the step gives back found_inf = 1."""
    expected = [SCALE, 2 * SCALE, SCALE, SCALE, 2 * SCALE]
    assert _scale_history(bad=True) == _scale_history(bad=False) == expected


def test_unscale_and_clip_grad_norm_before_the_step_change_nothing():
    """``hooks`` leaves the ordinary gradient in p.grad; torch's ``unscale_`` finds the
    overflowing sample there (found_inf = 1), ``clip_grad_norm_`` rescales it: the private step
    neither reads p.grad nor lets that found_inf reach ``update()``."""
    results = []
    for touch in (False, True):
        x, y = _data(bad=True)
        _, module, optimizer, criterion = private(mlp(), x, y, mode="hooks", sigma=1.0, seed=3)
        scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)

        def before_step():
            scaler.unscale_(optimizer)
            assert any(not torch.isfinite(p.grad).all() for p in optimizer.params)
            torch.nn.utils.clip_grad_norm_(optimizer.params, 1e-3)

        _scaled_step(module, optimizer, criterion, scaler, x, y, before_step if touch else None)
        results.append(([p.grad.clone() for p in optimizer.params], scaler.get_scale()))
    for a, b in zip(results[0][0], results[1][0]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert results[0][1] == results[1][1] == SCALE


def test_pieces_of_a_logical_batch_are_each_unscaled_by_their_scale():
    """Two pieces through scaler.step (skip signal), the scale doubling in between (growth
    interval 1): the step equals the float32 oracle on the whole batch."""
    x, y = _data(n=8)
    _, module, optimizer, criterion = private(mlp(), x, y, mode="bk", c=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=1)
    optimizer.signal_skip_step(True)
    _scaled_step(module, optimizer, criterion, scaler, x[:4], y[:4])
    assert scaler.get_scale() == 2 * SCALE
    _scaled_step(module, optimizer, criterion, scaler, x[4:], y[4:])
    want = clipped_sum(per_sample_grads(mlp(), x, y), "flat", 0.5)
    assert relative_error([p.grad for p in optimizer.params], want) < FP16_TOLERANCE


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_clipped_sums_formed_during_backward_are_refused(mode):
    """Per-layer clipping in the norms-only modes forms sums in the backward pass, before the
    scale is known: refused before anything is released."""
    x, y = _data()
    engine, module, optimizer, criterion = private(mlp(), x, y, mode=mode, clipping="per_layer")
    before = [p.detach().clone() for p in optimizer.params]
    with pytest.raises(RuntimeError, match="clipped sums formed during the backward pass"):
        _scaled_step(module, optimizer, criterion, torch.amp.GradScaler("cpu"), x, y)
    assert len(engine.accountant) == 0 and all(torch.equal(a, p) for a, p in zip(before, optimizer.params))


def test_the_ghost_two_pass_backward_of_a_scaled_loss_is_refused():
    """The criterion's loss times the scale runs the two-pass backward, whose sums pass used
    factors of scaled norms: refused at the step (``scaler.scale(loss.value)`` is the way)."""
    x, y = _data()
    engine, module, optimizer, criterion = private(mlp(), x, y, mode="ghost")
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    with torch.autocast("cpu", dtype=torch.float16):
        out = module(x)
    (criterion(out.float(), y) * scaler.scale(torch.ones(()))).backward()
    with pytest.raises(RuntimeError, match=r"two-pass loss\.backward\(\).*scaler\.scale\(loss\.value\)"):
        scaler.step(optimizer)
    assert len(engine.accountant) == 0 and optimizer.steps_taken == 0


def test_the_attribute_contract_is_refused():
    """A GradScaler that sets ``grad_scale``/``found_inf`` instead of passing itself could not
    be given a private found_inf: refused."""
    x, y = _data()
    _, module, optimizer, _ = private(mlp(), x, y)
    squared_error(module(x), y).backward()
    optimizer.grad_scale = torch.tensor(SCALE)
    with pytest.raises(RuntimeError, match="passing itself"):
        optimizer.step()
    assert "passing itself" in ATTRIBUTE_CONTRACT


def test_torch_update_reads_the_recorded_found_inf():
    """The private torch API of :func:`record_found_inf`: ``update()`` backs off on 1, and
    counts towards growth on 0."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=1)
    scaler.scale(torch.ones(()))
    record_found_inf(scaler, optimizer, torch.ones(()))
    scaler.update()
    assert scaler.get_scale() == SCALE / 2
    record_found_inf(scaler, optimizer, torch.zeros(()))
    scaler.update()
    assert scaler.get_scale() == SCALE


def _classic_scaled_run(bad: bool):
    """Two fp16 steps of the classic (Opacus 0.x) API with a GradScaler: the update of each step
    and the scale after it."""
    x, y = _data(bad=bad)
    model = mlp()
    engine = opacus_dp.PrivacyEngine(model, batch_size=len(x), sample_size=10 * len(x), noise_multiplier=0.0,
                                     max_grad_norm=0.5, loss_reduction="sum")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine.attach(optimizer)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    history = []
    for _ in range(2):
        before = [p.detach().clone() for p in model.parameters()]
        _scaled_step(model, optimizer, None, scaler, x, y)
        history.append(([b - p.detach() for b, p in zip(before, model.parameters())], scaler.get_scale()))
    engine.detach()
    return history, x, y


@pytest.mark.filterwarnings("ignore")
def test_the_classic_api_takes_the_private_found_inf():
    """The patched optimizer hands the scaler to the private step: an overflowing sample is
    dropped and the step still happens (torch would otherwise skip it on the overflow of the
    ordinary p.grad, a data-dependent skip); the update equals the float32 oracle without it."""
    history, x, y = _classic_scaled_run(bad=True)
    clean, _, _ = _classic_scaled_run(bad=False)
    assert [scale for _, scale in history] == [scale for _, scale in clean] == [SCALE, SCALE]
    keep = [i for i in range(len(x)) if i != BAD]
    expected = clipped_sum([g[keep] for g in per_sample_grads(mlp(), x, y)], "flat", 0.5)
    assert relative_error([u / 0.1 for u in history[0][0]], expected) < FP16_TOLERANCE
    assert all(update.abs().sum() > 0 for update in history[1][0])
