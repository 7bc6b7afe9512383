"""The ghost norms' rounding checks read once per step (``bookkeeping.deferred_checks``).

``bk`` with flat clipping defers each ghost layer's check to one read at the step, and recomputes
the norms of a call with a suspect sample from what it kept. Oracles: the immediate checks
(the same model and batch with deferral switched off: the same bits), a count of the host reads,
and the float64 per-sample gradient's norm against which a clipped contribution is measured."""
import contextlib
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import opacus_dp
from opacus_dp.grad_sample.bookkeeping import deferred_checks, passes
from opacus_dp.grad_sample.bookkeeping.norm_samplers import trust

D, P, T = 64, 96, 16  # 16 positions, 64 -> 64 -> 96: the mixed rule keeps both layers ghost


class _SignedSum(nn.Module):
    """``Σ out ⊙ y`` (``/ B`` for ``"mean"``): the last layer's output gradient is ``y`` itself."""

    def __init__(self, reduction: str = "sum"):
        super().__init__()
        self.reduction = reduction

    def forward(self, output, target):
        total = (output * target).sum()
        return total / output.shape[0] if self.reduction == "mean" else total


def _cancelling_batch(spread: float, batch: int = 3, seed: int = 0):
    """Inputs nearly equal across positions, output gradients of alternating sign: both layers'
    per-sample weight gradients cancel over the positions (the first through the GELU)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 1, D, generator=gen) + spread * torch.randn(batch, T, D, generator=gen)
    signs = torch.ones(T, 1)
    signs[1::2] = -1
    y = signs * torch.randn(batch, 1, P, generator=gen) + spread * torch.randn(batch, T, P, generator=gen)
    return x, y


def _private(x, y, clipping="flat", bound=1e-3, reduction="sum"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), nn.GELU(), nn.Linear(D, P))
    max_norm = bound if clipping == "flat" else [bound / 2] * 4
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer, _ = opacus_dp.PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=1), noise_multiplier=0.0,
            max_grad_norm=max_norm, clipping=clipping, grad_sample_mode="bk",
            poisson_sampling=False, loss_reduction=reduction)
    return model, optimizer


def _clipped_sums(x, y, clipping="flat", passes_per_step=1, reduction="sum"):
    """The step's per-sample norms and clipped sums (no noise)."""
    model, optimizer = _private(x, y, clipping, reduction=reduction)
    optimizer.zero_grad()
    for part in torch.arange(x.shape[0]).chunk(passes_per_step):
        _SignedSum(reduction)(model(x[part]), y[part]).backward()
    norms = [n.clone() for n in model.per_sample_norms(optimizer.params)]
    optimizer.clip_and_accumulate()
    return norms, [s.clone() for s in optimizer.logical_batch.sums.values()]


@contextlib.contextmanager
def _counted(monkeypatch):
    """Counts of immediate reads, deferred reads and recomputed calls."""
    counts = {"immediate": 0, "deferred": 0, "recomputed": 0}

    def wrap(module, name, key):
        original = getattr(module, name)

        def counted(*args, **kwargs):
            counts[key] += 1
            return original(*args, **kwargs)
        monkeypatch.setattr(module, name, counted)
    wrap(trust, "any_suspect", "immediate")
    wrap(deferred_checks, "_read_flags", "deferred")
    wrap(deferred_checks, "_recompute_checked", "recomputed")
    yield counts


def _without_deferral(monkeypatch):
    original = trust.deferred_checks
    monkeypatch.setattr(passes, "deferred_checks", lambda defer: original(False))


@pytest.mark.parametrize("passes_per_step", [1, 3])
def test_flat_bk_reads_the_checks_once_per_step(monkeypatch, passes_per_step):
    x, y = _cancelling_batch(spread=1.0)  # ordinary positions: nothing suspect
    with _counted(monkeypatch) as counts:
        _clipped_sums(x, y, passes_per_step=passes_per_step)
    assert counts == {"immediate": 0, "deferred": 1, "recomputed": 0}


def test_per_layer_clipping_checks_each_layer_at_once(monkeypatch):
    """Per-layer clipping forms each layer's clipped sum in the backward pass: its norms must be
    checked there."""
    x, y = _cancelling_batch(spread=1.0)
    with _counted(monkeypatch) as counts:
        _clipped_sums(x, y, clipping="per_layer")
    assert counts == {"immediate": 2, "deferred": 0, "recomputed": 0}


@pytest.mark.parametrize("passes_per_step", [1, 3])
@pytest.mark.parametrize("spread", [1e-4, 1e-6])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_deferred_checks_give_the_immediate_checks_bits(monkeypatch, spread, passes_per_step, reduction):
    x, y = _cancelling_batch(spread)
    with _counted(monkeypatch) as counts:
        deferred = _clipped_sums(x, y, passes_per_step=passes_per_step, reduction=reduction)
    assert counts["deferred"] == 1 and counts["recomputed"] >= 1 and counts["immediate"] >= 1
    _without_deferral(monkeypatch)
    immediate = _clipped_sums(x, y, passes_per_step=passes_per_step, reduction=reduction)
    for got, expected in zip([*deferred[0], *deferred[1]], [*immediate[0], *immediate[1]], strict=True):
        assert torch.equal(got, expected)


def _alternating(batch, channels, positions, spread, gen, channels_last=True):
    """Per-sample gradients of alternating sign over the positions, slightly perturbed."""
    signs = torch.ones(positions)
    signs[1::2] = -1
    shape = (batch, 1, channels) if channels_last else (batch, channels, 1)
    signs = signs.view(-1, 1) if channels_last else signs
    return signs * torch.randn(*shape, generator=gen) + spread * torch.randn(
        *((batch, positions, channels) if channels_last else (batch, channels, positions)), generator=gen)


def _other_layer(kind, spread):
    """A one-layer model of ``kind`` whose samples' positions cancel, its batch and targets."""
    gen = torch.Generator().manual_seed(3)
    if kind == "conv":  # 64 -> 64 channels, 3 taps, 38 positions: the mixed rule keeps it ghost
        x = torch.randn(3, 64, 1, generator=gen) + spread * torch.randn(3, 64, 40, generator=gen)
        return nn.Conv1d(64, 64, 3), x, _alternating(3, 64, 38, spread, gen, channels_last=False)
    tokens = torch.randint(0, 2, (3, 64), generator=gen)  # two tokens, each repeated; T < V: ghost
    return nn.Embedding(100, 32), tokens, _alternating(3, 32, 64, spread, gen)


@pytest.mark.parametrize("kind", ["conv", "embedding"])
def test_other_layer_types_defer_with_the_same_bits(monkeypatch, kind):
    def run():
        torch.manual_seed(0)
        layer, x, y = _other_layer(kind, spread=1e-5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, optimizer, _ = opacus_dp.PrivacyEngine().make_private(
                module=layer, optimizer=torch.optim.SGD(layer.parameters(), lr=0.0),
                data_loader=DataLoader(TensorDataset(x, y), batch_size=1), noise_multiplier=0.0,
                max_grad_norm=1e-3, grad_sample_mode="bk", poisson_sampling=False,
                loss_reduction="sum")
        optimizer.zero_grad()
        _SignedSum()(model(x), y).backward()
        norms = [n.clone() for n in model.per_sample_norms(optimizer.params)]
        optimizer.clip_and_accumulate()
        return [*norms, *(s.clone() for s in optimizer.logical_batch.sums.values())]

    with _counted(monkeypatch) as counts:
        deferred = run()
    assert counts["deferred"] == 1 and counts["recomputed"] == 1
    _without_deferral(monkeypatch)
    for got, expected in zip(deferred, run(), strict=True):
        assert torch.equal(got, expected)


def _exact_sq_norms(model, x, y):
    """Float64 per-sample squared gradient norms of the whole model (autograd, one sample at a time)."""
    model64 = nn.Sequential(nn.Linear(D, D), nn.GELU(), nn.Linear(D, P)).double()
    model64.load_state_dict({k.removeprefix("_module."): v.double() for k, v in model.state_dict().items()})
    result = []
    for i in range(x.shape[0]):
        model64.zero_grad()
        _SignedSum()(model64(x[i:i + 1].double()), y[i:i + 1].double()).backward()
        result.append(sum(p.grad.pow(2).sum() for p in model64.parameters()))
    return torch.stack(result)


def test_a_recomputed_norm_bounds_the_true_norm(monkeypatch):
    """The norms replaced at the step are at least the float64 norms, where the unchecked float32
    Gram form is below them: no sample's clipped contribution exceeds the bound. (Above them by
    the margin ``√T u N`` per layer: a few percent with these cancelling positions.)"""
    x, y = _cancelling_batch(1e-5, batch=1)
    model, _ = _private(x, y)
    exact = _exact_sq_norms(model, x, y)
    with monkeypatch.context() as unchecked:
        unchecked.setattr(trust, "_trusted", lambda sq_norms, bounds_sq: torch.ones_like(sq_norms, dtype=torch.bool))
        plain = sum(n.double().pow(2) for n in _clipped_sums(x, y)[0])
    assert (plain < exact * 0.9).all()
    with _counted(monkeypatch) as counts:
        norms, sums = _clipped_sums(x, y)
    assert counts["recomputed"] >= 1
    total = sum(n.double().pow(2) for n in norms)
    assert (total >= exact * (1 - 1e-6)).all()
    assert (total <= exact * 1.25).all()
    contribution = torch.sqrt(sum(s.double().pow(2).sum() for s in sums))
    assert contribution <= 1e-3 * (1 + 1e-6)


def test_a_kept_tensor_written_before_the_step_is_refused_before_its_norms_are_read():
    """Norms recomputed from kept tensors need them as the backward pass left them."""
    x, y = _cancelling_batch(1e-5, batch=2)
    model, optimizer = _private(x, y)
    optimizer.zero_grad()
    _SignedSum()(model(x), y).backward()
    (finished,) = model._bookkeeper._resolved
    assert finished.unchecked
    _, _, backprops, _ = finished.ghost_calls[-1]
    backprops.mul_(2.0)  # a kept output gradient written in place
    with pytest.raises(RuntimeError, match="in place"):
        model.per_sample_norms(optimizer.params)
