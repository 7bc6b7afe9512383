"""Channels-last models (``model.to(memory_format=torch.channels_last)``): the per-sample formulas
read channels-last activations and output gradients from their channels-moved-last views
(:mod:`opacus_dp.maths.layouts`) and give what they give in the default layout. Each formula
against an independent oracle, the views against the default layout's, and every mode's private
step of a channels-last model against the float64 per-sample oracle, with spies showing that the
channels-last paths ran."""

import copy

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp.grad_sample import conv as conv_samplers
from opacus_dp.grad_sample import norms
from opacus_dp.grad_sample.bookkeeping.norm_samplers import conv as conv_norms
from opacus_dp.maths.layouts import channels_innermost, positions_by_channels
from tests.engine.helpers import median_clipped_mean
from tests.ghost.helpers import private_update
from tests.grad_sample.oracle import oracle_grad_samples, trainable

F64 = torch.float64


def channels_last(t: torch.Tensor) -> torch.Tensor:
    """The same values laid out channels-last, for any number of positions' dimensions."""
    return t.movedim(1, -1).contiguous().movedim(-1, 1)


@pytest.mark.parametrize("shape", [(3, 4, 5, 6), (2, 6, 7), (2, 4, 3, 2, 5)])
@pytest.mark.parametrize("groups", [1, 2])
def test_positions_by_channels_reads_channels_last_without_transposing(shape, groups):
    x = torch.randn(shape)
    rows, channels = shape[0] * groups, shape[1] // groups
    expected = x.reshape(rows, channels, -1).transpose(1, 2)
    plain = positions_by_channels(x, groups)
    assert plain.stride() == expected.stride() and plain.data_ptr() == x.data_ptr()  # the old view itself
    laid_out = channels_last(x)
    assert channels_innermost(laid_out) and not channels_innermost(x)
    got = positions_by_channels(laid_out, groups)
    assert torch.equal(got, expected)
    assert got.stride(-1) == 1  # each position's channels together: no transposing copy
    if groups == 1:
        assert got.data_ptr() == laid_out.data_ptr()  # a view
    phase = laid_out[:, :, 1::2]  # a strided convolution's phase: channels still inner
    assert channels_innermost(phase)
    got = positions_by_channels(phase, groups)
    assert torch.equal(got, x[:, :, 1::2].reshape(rows, channels, -1).transpose(1, 2))
    assert got.stride(-1) == 1


def test_a_tensor_contiguous_in_both_layouts_keeps_the_default_path():
    """One channel, or one position: both layouts at once; the default layout's reading is kept."""
    for t in (torch.randn(3, 1, 4, 4), torch.randn(3, 5, 1, 1)):
        assert not channels_innermost(t)
        assert not channels_innermost(t.contiguous(memory_format=torch.channels_last))


def oracle_norm_grads(layer: nn.GroupNorm, x: torch.Tensor, gy: torch.Tensor) -> dict:
    """Each sample's weight and bias gradient through the layer alone, by autograd."""
    rows = {p: [] for p in (layer.weight, layer.bias)}
    for i in range(x.shape[0]):
        out = layer(x[i:i + 1])
        grads = torch.autograd.grad(out, [layer.weight, layer.bias], gy[i:i + 1])
        for p, g in zip(rows, grads):
            rows[p].append(g)
    return {p: torch.stack(r) for p, r in rows.items()}


@pytest.mark.parametrize("shape,groups", [((4, 6, 5, 5), 3), ((3, 8, 7), 2), ((2, 4, 3, 2, 3), 1)])
def test_group_norm_from_statistics_in_channels_last(monkeypatch, shape, groups):
    calls = []
    original = norms._group_norm_grads_channels_last
    monkeypatch.setattr(norms, "_group_norm_grads_channels_last", lambda *a: calls.append(1) or original(*a))
    torch.manual_seed(0)
    layer = nn.GroupNorm(groups, shape[1], dtype=F64)
    nn.init.normal_(layer.weight)
    nn.init.normal_(layer.bias)
    x = channels_last(4 + 2 * torch.randn(shape, dtype=F64))  # far from zero mean: the statistics must be the forward's
    out = layer(x)
    gy = channels_last(torch.randn(shape, dtype=F64))
    got = norms.group_norm_grad_sample(layer, [x], gy, statistics=norms.saved_statistics(layer, out))
    assert calls == [1]
    for p, expected in oracle_norm_grads(layer, x, gy).items():
        torch.testing.assert_close(got[p], expected, rtol=1e-10, atol=1e-10)
    layer.weight.requires_grad_(False)  # a frozen weight: the bias alone
    got = norms.group_norm_grad_sample(layer, [x], gy, statistics=norms.saved_statistics(layer, layer(x)))
    assert set(got) == {layer.bias}


def test_group_norm_in_channels_last_float32_agrees_with_the_default_layout():
    torch.manual_seed(1)
    layer = nn.GroupNorm(4, 16)
    x, gy = torch.randn(8, 16, 9, 9), torch.randn(8, 16, 9, 9)
    default = norms.group_norm_grad_sample(layer, [x], gy, statistics=norms.saved_statistics(layer, layer(x)))
    x_cl, gy_cl = channels_last(x), channels_last(gy)
    laid_out = norms.group_norm_grad_sample(layer, [x_cl], gy_cl, statistics=norms.saved_statistics(layer, layer(x_cl)))
    for p in default:
        torch.testing.assert_close(laid_out[p], default[p], rtol=1e-4, atol=1e-5)


def per_sample_conv_oracle(layer: nn.Conv2d, x: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
    return torch.stack([torch.autograd.grad(layer(x[i:i + 1]), layer.weight, gy[i:i + 1])[0]
                        for i in range(x.shape[0])])


@pytest.mark.parametrize("method", ["im2col", "folded"])
@pytest.mark.parametrize("groups", [1, 2])
def test_conv_per_sample_gradients_of_channels_last_inputs(method, groups):
    torch.manual_seed(2)
    layer = nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=groups, dtype=F64)
    x = channels_last(torch.randn(3, 4, 7, 6, dtype=F64))
    gy = channels_last(torch.randn(3, 6, 4, 3, dtype=F64))
    got = conv_samplers.per_sample_conv_weight_grad(layer, x, gy, method=method)
    torch.testing.assert_close(got, per_sample_conv_oracle(layer, x, gy), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("stride,groups", [(1, 1), (2, 1), (2, 2)])
def test_patch_gram_of_a_channels_last_input_equals_the_windows_gram(stride, groups):
    torch.manual_seed(3)
    layer = nn.Conv2d(4, 4, 3, stride=stride, padding=1, groups=groups, dtype=F64)
    x = torch.randn(3, 4, 8, 6, dtype=F64)
    windows = conv_samplers.conv_windows(layer, x).flatten(0, 1)  # (B·G, C/G·K, L)
    expected = windows.transpose(1, 2) @ windows
    got = conv_norms._autocorrelation_gram(layer, channels_last(x))
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


class ChannelsLastNet(nn.Module):
    """Convolutions of each per-sample rule (few input channels: im2col; strided and grouped:
    folded or ghost; few positions: im2col) with GroupNorms between them; the loss is read from
    the last convolution's output, so the output gradients are channels-last too."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.Tanh(),
            nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2), nn.GroupNorm(4, 8), nn.Tanh(),
            nn.Conv2d(8, 6, 3, padding=1))

    def forward(self, x):
        return self.layers(x)


def spy_on_layouts(monkeypatch) -> list:
    """Record, for each call of ``positions_by_channels`` by the samplers, whether it read a
    channels-last tensor; and each call of the channels-last GroupNorm form."""
    seen = []

    def spy(x, groups=1):
        seen.append("channels-last" if channels_innermost(x) else "default")
        return positions_by_channels(x, groups)

    monkeypatch.setattr(conv_samplers, "positions_by_channels", spy)
    monkeypatch.setattr(conv_norms, "positions_by_channels", spy)
    original = norms._group_norm_grads_channels_last
    monkeypatch.setattr(norms, "_group_norm_grads_channels_last",
                        lambda *a: seen.append("group norm") or original(*a))
    return seen


@pytest.mark.parametrize("mode", ["hooks", "functorch", "bk", "ghost", "auto"])
def test_every_mode_trains_a_channels_last_model_as_the_oracle(monkeypatch, mode):
    seen = spy_on_layouts(monkeypatch)
    torch.manual_seed(4)
    batch = 4
    model = ChannelsLastNet().double().to(memory_format=torch.channels_last)
    x = torch.randn(batch, 3, 8, 8, dtype=F64).contiguous(memory_format=torch.channels_last)
    grads = oracle_grad_samples(copy.deepcopy(model), (x,))
    names = [n for n, _ in trainable(model)]
    rows = [grads[n] for n in names]
    bound, expected = median_clipped_mean(rows, batch)
    updates = private_update(  # the loader stacks samples in the default layout: laid out again
        model, DataLoader(TensorDataset(x), batch_size=batch), mode, bound, batch,
        prepare=lambda xb: xb.contiguous(memory_format=torch.channels_last))
    for name, u, e in zip(names, updates, expected):
        torch.testing.assert_close(u, e, rtol=1e-9, atol=1e-12, msg=lambda m: f"update of {name}: {m}")
    if mode != "functorch":  # functorch differentiates each layer's forward: no formula of its own
        assert "channels-last" in seen and "group norm" in seen, seen


def layout_update(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mode: str, per_layer: bool,
                  autocast: bool, channels_last_layout: bool):
    """One private SGD step's update (σ = 0, cross-entropy) of a copy of ``model`` in the given layout."""
    import warnings

    from opacus_dp import PrivacyEngine

    model = copy.deepcopy(model)
    if channels_last_layout:
        model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    count = len(list(model.parameters()))
    clipping = dict(clipping="per_layer", max_grad_norm=[0.3] * count) if per_layer else dict(max_grad_norm=0.3)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        private, optimizer, _ = PrivacyEngine(accountant="rdp").make_private(
            module=model, optimizer=optimizer, data_loader=DataLoader(TensorDataset(x, y), batch_size=len(x)),
            noise_multiplier=0.0, poisson_sampling=False, grad_sample_mode=mode, **clipping)
    before = [p.detach().clone() for p in model.parameters()]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = nn.functional.cross_entropy(private(x), y)
    loss.backward()
    optimizer.step()
    return [b - p.detach() for b, p in zip(before, model.parameters())]


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per-layer"])
@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_channels_last_updates_equal_the_default_layouts(monkeypatch, mode, per_layer, autocast):
    """Per-layer clipping and bfloat16 autocast in channels-last: the update of the same model and
    batch in the default layout. (Under bfloat16 autocast GroupNorm's input is bfloat16 and its
    statistics float32: its per-sample sums are taken in float32 from the statistics.)"""
    seen = spy_on_layouts(monkeypatch)
    torch.manual_seed(5)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.GroupNorm(4, 16), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1, groups=2), nn.GroupNorm(4, 16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 5))
    x, y = torch.randn(16, 3, 16, 16), torch.randint(0, 5, (16,))
    default = layout_update(model, x, y, mode, per_layer, autocast, channels_last_layout=False)
    assert "group norm" not in seen and "channels-last" not in seen
    laid_out = layout_update(model, x, y, mode, per_layer, autocast, channels_last_layout=True)
    assert "channels-last" in seen and "group norm" in seen
    tolerance = dict(rtol=2e-3, atol=2e-4) if autocast else dict(rtol=1e-4, atol=1e-6)
    for got, want in zip(laid_out, default):
        torch.testing.assert_close(got, want, **tolerance)
