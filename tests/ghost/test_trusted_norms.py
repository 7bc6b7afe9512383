"""Ghost norms under cancelling positions: the Gram form's rounding must never let a sample's
clipped contribution exceed the bound (``norm_samplers.trust``).

Oracle: the per-sample weight gradient formed in float64 from the same float32 inputs (products
of float32 numbers are exact in float64), its norm, and the clipping bound itself."""
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import opacus_dp
from opacus_dp.grad_sample.bookkeeping.norm_samplers.conv import _weight_sq_norms_and_bound, conv_norm_sample
from opacus_dp.grad_sample.bookkeeping.norm_samplers.linear import _gram_sq_norms_and_diagonal, gram_sq_norms
from opacus_dp.grad_sample.bookkeeping.norm_samplers import trust
from opacus_dp.grad_sample.bookkeeping.norm_samplers.trust import trusted_sq_norms

SPREADS = [1e-2, 1e-3, 1e-4, 0.0]  # smaller: the positions' gradients cancel more


def _alternating(shape, generator):
    signs = torch.ones(shape[1], 1)
    signs[1::2] = -1
    return signs * torch.randn(shape[0], 1, shape[2], generator=generator)


def _cancelling_sequences(spread, batch=4, positions=128, d=64, p=96, seed=0):
    """Nearly equal inputs ``a_t`` and output gradients of alternating sign: ``Σ_t g_t a_tᵀ`` is
    far smaller than ``Σ_t ‖g_t‖ ‖a_t‖``."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(batch, 1, d, generator=gen) + spread * torch.randn(batch, positions, d, generator=gen)
    g = _alternating((batch, positions, p), gen) + spread * torch.randn(batch, positions, p, generator=gen)
    return a, g


def _exact_linear_sq_norms(a, g):
    return torch.einsum("btp,btd->bpd", g.double(), a.double()).pow(2).sum(dim=(1, 2))


def _assert_exact_or_tight_upper_bound(got, exact, bound_sq, positions):
    """``n² ≤ got ≤ (n + 2 √T u N)²`` (float32 ``u``; the fallback adds ``√T u N`` to a norm
    whose own error is below it), each to 2e-6 relative."""
    got, margin = got.double(), 2 * positions ** 0.5 * 2.0 ** -24 * bound_sq.sqrt()
    assert (got >= exact * (1 - 2e-6)).all()
    assert (got <= (exact.sqrt() + margin).square() * (1 + 2e-6)).all()


def _position_bound_sq(a, g):
    """``N² = (Σ_t ‖a_t‖ ‖g_t‖)²`` per sample, in float64."""
    return (a.double().norm(dim=-1) * g.double().norm(dim=-1)).sum(dim=1).square()


def test_the_cases_defeat_the_plain_float32_gram_form():
    """Without the check the float32 Gram norms are far off (even negative): the cases below
    exercise the fallbacks."""
    worst = 0.0
    for spread in SPREADS:
        a, g = _cancelling_sequences(spread)
        raw, _ = _gram_sq_norms_and_diagonal(a, g)
        exact = _exact_linear_sq_norms(a, g)
        worst = max(worst, ((raw.double() - exact).abs() / exact.clamp(min=1e-300)).max().item())
    assert worst > 0.5


@pytest.mark.parametrize("spread", SPREADS)
@pytest.mark.parametrize("positions", [128, 300])  # one and two row blocks
def test_linear_ghost_norms_are_exact_or_an_upper_bound_under_cancellation(spread, positions):
    a, g = _cancelling_sequences(spread, positions=positions)
    _assert_exact_or_tight_upper_bound(gram_sq_norms(a, g), _exact_linear_sq_norms(a, g),
                                       _position_bound_sq(a, g), positions)


def test_linear_ghost_norms_of_ordinary_inputs_are_the_plain_gram_form():
    gen = torch.Generator().manual_seed(1)
    a, g = torch.randn(8, 128, 64, generator=gen), torch.randn(8, 128, 96, generator=gen)
    raw, _ = _gram_sq_norms_and_diagonal(a, g)
    assert torch.equal(gram_sq_norms(a, g), raw)  # N ≈ √T n̂: trusted, nothing recomputed


def _cancelling_signal(spread, groups, seed=0):
    gen = torch.Generator().manual_seed(seed)
    batch, channels, out_channels, length = 3, 8, 16, 200
    x = torch.randn(batch, channels, 1, generator=gen).expand(-1, -1, length).contiguous()
    x = x + spread * torch.randn(batch, channels, length, generator=gen)
    positions = length - 2
    signs = torch.ones(positions)
    signs[1::2] = -1
    g = torch.randn(batch, out_channels, 1, generator=gen) * signs
    g = g + spread * torch.randn(batch, out_channels, positions, generator=gen)
    layer = nn.Conv1d(channels, out_channels, 3, groups=groups)
    return layer, x, g


def _exact_conv1d_sq_norms(layer, x, g):
    groups = layer.groups
    patches = x.double().unfold(2, 3, 1)  # (B, C, T, k)
    batch, channels, positions, taps = patches.shape
    patches = patches.reshape(batch, groups, channels // groups, positions, taps)
    grads = g.double().reshape(batch, groups, -1, positions)
    return torch.einsum("bgot,bgctk->bgock", grads, patches).pow(2).sum(dim=(1, 2, 3, 4))


@pytest.mark.parametrize("spread", SPREADS)
@pytest.mark.parametrize("groups", [1, 2])
def test_conv_ghost_norms_are_exact_or_an_upper_bound_under_cancellation(spread, groups):
    layer, x, g = _cancelling_signal(spread, groups)
    got = conv_norm_sample(layer, [x], g)[layer.weight]
    exact = _exact_conv1d_sq_norms(layer, x, g)
    positions = g.shape[-1]
    patches = x.double().unfold(2, 3, 1).reshape(x.shape[0], layer.groups, -1, positions, 3)
    patch_norms = patches.pow(2).sum(dim=(2, 4)).sqrt()                   # (B, G, T)
    grad_norms = g.double().reshape(x.shape[0], layer.groups, -1, positions).norm(dim=2)
    bound_sq = (patch_norms * grad_norms).sum(dim=2).square().sum(dim=1)  # Σ_groups N²
    _assert_exact_or_tight_upper_bound(got, exact, bound_sq, positions)
    if spread == 1e-4:
        raw, _ = _weight_sq_norms_and_bound(layer, x, g)
        assert ((raw.double() - exact).abs() / exact).max() > 0.5  # the plain form fails here


def test_trust_rule_keeps_or_materialises_with_a_margin():
    calls = []

    def materialise(index):
        calls.append(index.tolist())
        return torch.tensor([4.0, 1e-20], dtype=torch.float64), torch.tensor([9.0, 1e8], dtype=torch.float64)

    sq = torch.tensor([1.0, -3.0, 2.0, 0.0])
    bound = torch.tensor([4.0, 9.0, 1e8, 0.0])
    got = trusted_sq_norms(sq, bound, materialise, positions=2)
    # kept: 1.0 (N = 2 n̂) and 0.0 (nothing to bound); materialised: index 1 (negative) and 2
    # (N = 7000 n̂), each plus √T u N
    assert calls == [[1, 2]]
    u = 2.0 ** -24
    expected = [1.0, (2.0 + 2 ** 0.5 * u * 3.0) ** 2, (1e-10 + 2 ** 0.5 * u * 1e4) ** 2, 0.0]
    torch.testing.assert_close(got, torch.tensor(expected))
    unchanged = torch.tensor([1.0, 2.0])
    assert trusted_sq_norms(unchanged, torch.tensor([2.0, 3.0]), materialise, positions=2) is unchanged


def test_float64_gram_norms_are_trusted_far_longer():
    def materialise(index):
        count = len(index)
        return torch.ones(count, dtype=torch.float64), torch.full((count,), 1e12, dtype=torch.float64)

    sq = torch.tensor([1.0, 1.0], dtype=torch.float64)
    got = trusted_sq_norms(sq, torch.tensor([1e10, 1e12], dtype=torch.float64), materialise, positions=4)
    # N = 1e5 n̂ passes in float64 (u N² = 1.1e-6 n̂² ≤ 2⁻¹⁶ n̂²), N = 1e6 n̂ does not
    expected = torch.tensor([1.0, (1.0 + 2 * 2.0 ** -53 * 1e6) ** 2], dtype=torch.float64)
    torch.testing.assert_close(got, expected)


def test_nan_norms_stay_nan():
    def materialise(index):
        count = len(index)
        return torch.full((count,), float("nan"), dtype=torch.float64), torch.ones(count, dtype=torch.float64)

    got = trusted_sq_norms(torch.tensor([float("nan"), 1.0]), torch.tensor([1.0, 1.0]), materialise, 4)
    assert torch.isnan(got[0]) and got[1] == 1.0


@pytest.mark.parametrize("layer_kind", ["linear", "conv"])
def test_materialising_in_chunks_gives_the_same_norms(layer_kind, monkeypatch):
    if layer_kind == "linear":
        a, g = _cancelling_sequences(1e-4)
        norms = lambda: gram_sq_norms(a, g)  # noqa: E731
    else:
        layer, x, g = _cancelling_signal(1e-4, groups=2)
        norms = lambda: conv_norm_sample(layer, [x], g)[layer.weight]  # noqa: E731
    whole = norms()
    monkeypatch.setattr(trust, "CHUNK_ELEMENTS", 1)  # one sample per chunk
    torch.testing.assert_close(norms(), whole, rtol=0, atol=0)


class _SignedSum(nn.Module):
    """``Σ out ⊙ y``: the output gradient is ``y`` itself."""

    reduction = "sum"

    def forward(self, output, target):
        return (output * target).sum()


def _private_linear(mode, clipping, bound, a, y):
    torch.manual_seed(0)
    model = nn.Linear(a.shape[-1], y.shape[-1])
    count = 2
    max_norm = bound if clipping == "flat" else [bound / count ** 0.5] * count
    extra = {"criterion": _SignedSum()} if mode == "ghost" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = opacus_dp.PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
            data_loader=DataLoader(TensorDataset(a, y), batch_size=1), noise_multiplier=0.0,
            max_grad_norm=max_norm, clipping=clipping, grad_sample_mode=mode,
            poisson_sampling=False, loss_reduction="sum", **extra)
    return out[0], out[1], (out[2] if len(out) == 4 else _SignedSum())


@pytest.mark.parametrize("mode", ["ghost", "bk"])
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_a_cancelling_samples_clipped_contribution_stays_within_the_bound(mode, clipping):
    worst = 0.0
    for seed, spread in enumerate([1e-4, 1e-5, 1e-6]):
        # 16 positions, 64 -> 96: the mixed rule keeps this layer on the ghost path
        a, y = _cancelling_sequences(spread, batch=1, positions=16, seed=seed)
        exact = _exact_linear_sq_norms(a, y).sqrt().item()
        bound = exact / 100  # clipping is active: the factor decides the contribution
        model, optimizer, criterion = _private_linear(mode, clipping, bound, a, y)
        optimizer.zero_grad()
        criterion(model(a), y).backward()
        optimizer.clip_and_accumulate()
        sums = list(optimizer.logical_batch.sums.values())
        contribution = torch.sqrt(sum(s.double().pow(2).sum() for s in sums)).item()
        worst = max(worst, contribution / bound)
    assert 0.5 < worst <= 1.0 + 1e-6


def test_an_embedding_samples_clipped_contribution_stays_within_the_bound_when_rows_cancel():
    """The rows' norms are exact sums, but the weighted sum scatters ``f · g_t`` again: without
    the margin a sample whose repeated token's gradients cancel came out ~0.5 % above the bound."""
    from opacus_dp.grad_sample.bookkeeping.norm_samplers.embedding import embedding_norm_sample, embedding_weighted_grad

    worst = 0.0
    for seed in range(10):
        gen = torch.Generator().manual_seed(seed)
        batch, positions, dim = 4, 256, 64
        layer = nn.Embedding(10, dim)
        tokens = torch.randint(0, 2, (batch, positions), generator=gen)
        signs = torch.ones(positions, 1)
        signs[1::2] = -1
        for spread in (1e-3, 1e-4, 1e-5):
            g = signs * torch.randn(batch, 1, dim, generator=gen)
            g = g * (1 + spread * torch.randn(batch, positions, dim, generator=gen))
            norms = embedding_norm_sample(layer, [tokens], g)[layer.weight].sqrt()
            bound = norms / 10  # clipping active: factor C / norm
            for i in range(batch):
                factors = torch.zeros(batch)
                factors[i] = bound[i] / norms[i]
                summed = embedding_weighted_grad(layer, [tokens], g, {layer.weight: factors})[layer.weight]
                worst = max(worst, summed.double().norm().item() / bound[i].item())
    assert 0.9 < worst <= 1.0 + 1e-6
