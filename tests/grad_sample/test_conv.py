"""Per-sample gradients of Conv1d/2d/3d against a batch-size-1 autograd oracle.

The sampler is called directly: ``backprops`` is a random output gradient ``gy`` and the oracle
differentiates ``sum(layer(x[i:i+1]) * gy[i:i+1])`` for each sample ``i`` separately.
"""

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from opacus_dp.grad_sample.conv import (
    conv_grad_sample,
    per_sample_conv_weight_grad,
    prefers_im2col,
    side_padding,
)
from opacus_dp.grad_sample.registry import GRAD_SAMPLERS

CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}


def oracle_per_sample_grads(layer, x, gy):
    """{param: (B, *param.shape)} from one autograd call per sample."""
    params = [p for p in layer.parameters() if p.requires_grad]
    rows = {p: [] for p in params}
    for i in range(x.shape[0]):
        grads = torch.autograd.grad((layer(x[i : i + 1]) * gy[i : i + 1]).sum(), params)
        for p, g in zip(params, grads):
            rows[p].append(g)
    return {p: torch.stack(r) for p, r in rows.items()}


def assert_matches_oracle(layer, x, atol=1e-10, rtol=1e-8):
    """The registered sampler, and both weight-gradient methods, agree with the oracle."""
    gy = torch.randn_like(layer(x))
    got = conv_grad_sample(layer, [x], gy)
    expected = oracle_per_sample_grads(layer, x, gy)
    assert set(got) == set(expected)
    for p, g in expected.items():
        assert got[p].shape == (x.shape[0], *p.shape)
        torch.testing.assert_close(got[p], g, atol=atol, rtol=rtol)
    if layer.weight.requires_grad:
        for method in ("folded", "im2col"):
            by_method = per_sample_conv_weight_grad(layer, x, gy, method=method)
            torch.testing.assert_close(by_method, expected[layer.weight], atol=atol, rtol=rtol)


@st.composite
def conv_cases(draw):
    """A small conv layer (any padding flavour/mode, groups, dilation) and a batch for it."""
    nd = draw(st.integers(1, 3))
    groups = draw(st.integers(1, 3))
    kernel = tuple(draw(st.integers(1, 3)) for _ in range(nd))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(nd))
    padding = draw(st.sampled_from(["int", "tuple", "same", "valid"]))
    if padding == "int":
        padding = draw(st.integers(0, 2))
    elif padding == "tuple":
        padding = tuple(draw(st.integers(0, 2)) for _ in range(nd))
    stride = 1 if padding == "same" else tuple(draw(st.integers(1, 3)) for _ in range(nd))
    layer = CONV[nd](
        in_channels=groups * draw(st.integers(1, 2)),
        out_channels=groups * draw(st.integers(1, 2)),
        kernel_size=kernel,
        stride=stride,
        padding=padding,
        dilation=dilation,
        groups=groups,
        bias=draw(st.booleans()),
        padding_mode=draw(st.sampled_from(["zeros", "reflect", "replicate", "circular"])),
    ).double()
    # Every side is at least the dilated kernel and larger than any padding (reflect needs it).
    spatial = [draw(st.integers(max(3, d * (k - 1) + 1), max(3, d * (k - 1) + 1) + 2))
               for k, d in zip(kernel, dilation)]
    batch = draw(st.integers(1, 3))
    return layer, torch.randn(batch, layer.in_channels, *spatial, dtype=torch.float64)


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@settings(max_examples=25, deadline=None)
@given(conv_cases())
def test_matches_oracle_for_generated_layers(case):
    layer, x = case
    assert_matches_oracle(layer, x)


@pytest.mark.parametrize("in_channels,out_channels", [(1, 16), (3, 32), (16, 4)])
def test_im2col_orientations_match_oracle(in_channels, out_channels):
    """Windows with fewer rows than the outputs (1·9 < 16, 3·9 < 32) take the transposed product,
    the others the direct one: both give the oracle's per-sample gradients."""
    torch.manual_seed(3)
    layer = nn.Conv2d(in_channels, out_channels, 3, padding=1).double()
    assert_matches_oracle(layer, torch.randn(5, in_channels, 6, 7, dtype=torch.float64))


@pytest.mark.parametrize(
    "layer, shape",
    [
        (nn.Conv2d(3, 8, 3, padding=1), (4, 3, 9, 9)),
        (nn.Conv2d(6, 6, 3, stride=2, padding=1, groups=6), (3, 6, 8, 8)),  # depthwise
        (nn.Conv1d(4, 6, 4, padding="same", padding_mode="reflect", groups=2), (3, 4, 11)),
        (nn.Conv3d(2, 4, (2, 3, 2), stride=(1, 2, 1), padding=(1, 0, 1)), (2, 2, 5, 6, 4)),
    ],
)
def test_float32_matches_oracle(layer, shape):
    """float32 takes different (mkldnn) kernels on CPU than float64."""
    assert_matches_oracle(layer, torch.randn(shape), atol=1e-5, rtol=1e-4)


def test_channels_last_input():
    layer = nn.Conv2d(3, 5, 3, padding=1).double()
    x = torch.randn(3, 3, 6, 7, dtype=torch.float64).to(memory_format=torch.channels_last)
    assert_matches_oracle(layer, x)


@pytest.mark.parametrize("frozen", ["weight", "bias"])
def test_frozen_parameters_are_not_returned(frozen):
    layer = nn.Conv2d(2, 3, 3, padding=1).double()
    getattr(layer, frozen).requires_grad_(False)
    assert_matches_oracle(layer, torch.randn(3, 2, 5, 5, dtype=torch.float64))


def test_no_bias():
    layer = nn.Conv1d(2, 3, 3, bias=False).double()
    assert_matches_oracle(layer, torch.randn(2, 2, 6, dtype=torch.float64))


@pytest.mark.parametrize("nd", [1, 2, 3])
def test_empty_batch_gives_zero_rows(nd):
    layer = CONV[nd](2, 4, 3, padding=1, groups=2)
    x = torch.randn(0, 2, *[5] * nd)
    gy = layer(x).detach()
    got = conv_grad_sample(layer, [x], gy)
    assert got[layer.weight].shape == (0, *layer.weight.shape)
    assert got[layer.bias].shape == (0, *layer.bias.shape)


def test_unknown_method_is_rejected():
    layer = nn.Conv1d(1, 1, 2)
    x = torch.randn(2, 1, 4)
    with pytest.raises(ValueError, match="method"):
        per_sample_conv_weight_grad(layer, x, layer(x).detach(), method="fft")


def test_auto_method_choice():
    """im2col only for ungrouped layers with few output positions or few input channels."""
    small, large = torch.zeros(2, 4, 4, 4), torch.zeros(2, 4, 6, 6)
    assert prefers_im2col(nn.Conv2d(8, 4, 3), small)
    assert not prefers_im2col(nn.Conv2d(8, 4, 3), large)
    assert prefers_im2col(nn.Conv2d(3, 4, 3), large)  # few input channels: any resolution
    assert not prefers_im2col(nn.Conv2d(4, 4, 3, groups=2), small)


def test_unbatched_input_is_rejected():
    layer = nn.Conv2d(2, 3, 3)
    x = torch.randn(2, 5, 5)
    with pytest.raises(ValueError, match="batch"):
        conv_grad_sample(layer, [x], layer(x).detach())


@pytest.mark.parametrize("kernel, dilation", [(2, 1), (4, 1), (3, 2), (2, 3)])
def test_same_padding_split_matches_torch(kernel, dilation):
    """'same' puts the odd padding element after, like torch's forward pass."""
    layer = nn.Conv2d(1, 1, kernel, padding="same", dilation=dilation, padding_mode="reflect")
    flat = [p for pair in reversed(side_padding(layer)) for p in pair]
    assert flat == list(layer._reversed_padding_repeated_twice)


def test_all_conv_types_registered():
    for cls in CONV.values():
        assert GRAD_SAMPLERS[cls] is conv_grad_sample


# ---------------------------------------------------------------- through GradSampleModule
def per_sample_loss(out, target):
    """Loss term of each sample (batch on dim 0): squared error summed over the rest."""
    return (out - target).pow(2).flatten(start_dim=1).sum(dim=1)


def oracle_model_grads(model, x, target):
    """{param: (B, *param.shape)}: gradient of each sample's own loss term, one at a time."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = [torch.autograd.grad(per_sample_loss(model(x[i : i + 1]), target[i : i + 1]).sum(),
                                params) for i in range(x.shape[0])]
    return {p: torch.stack([r[j] for r in rows]) for j, p in enumerate(params)}


def conv_model(padding_mode="zeros"):
    torch.manual_seed(1)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1, groups=2, padding_mode=padding_mode),
        nn.Tanh(),
        nn.Conv2d(4, 4, 3, stride=2, dilation=(1, 2), groups=4, bias=False),
        nn.Tanh(),
        nn.Flatten(start_dim=2),
        nn.Conv1d(4, 3, 2, padding="same", padding_mode=padding_mode),
    ).double()


def run_grad_sample_module(wrapper_cls, model, x, target, reduction):
    gsm = wrapper_cls(model, batch_first=True, loss_reduction=reduction)
    losses = per_sample_loss(gsm(x), target)
    (losses.sum() if reduction == "sum" else losses.mean()).backward()
    return gsm, {p: p.grad_sample for p in model.parameters() if p.requires_grad}


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("padding_mode", ["zeros", "reflect", "circular"])
def test_grad_sample_module_matches_oracle(reduction, padding_mode):
    from opacus_dp.grad_sample import GradSampleModule

    model = conv_model(padding_mode)
    model[0].weight.requires_grad_(False)
    x = torch.randn(4, 2, 7, 8, dtype=torch.float64)
    target = torch.randn_like(model(x))
    expected = oracle_model_grads(model, x, target)
    gsm, got = run_grad_sample_module(GradSampleModule, model, x, target, reduction)
    assert set(got) == set(expected)
    for p, g in expected.items():
        torch.testing.assert_close(got[p], g, atol=1e-10, rtol=1e-8)
        scale = 1.0 if reduction == "sum" else 1.0 / x.shape[0]
        torch.testing.assert_close(p.grad, scale * g.sum(dim=0), atol=1e-10, rtol=1e-8)
    gsm.close()


@pytest.mark.filterwarnings("ignore:Full backward hook")
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_grad_sample_module_agrees_with_opacus(reduction):
    import copy

    from opacus import GradSampleModule as OpacusGradSampleModule

    from opacus_dp.grad_sample import GradSampleModule

    model = conv_model()
    twin = copy.deepcopy(model)
    x = torch.randn(3, 2, 7, 8, dtype=torch.float64)
    target = torch.randn_like(model(x))
    _, ours = run_grad_sample_module(GradSampleModule, model, x, target, reduction)
    _, theirs = run_grad_sample_module(OpacusGradSampleModule, twin, x, target, reduction)
    assert len(ours) == len(theirs) == 5
    for g, h in zip(ours.values(), theirs.values()):
        torch.testing.assert_close(g, h, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_grad_sample_module_empty_batch(reduction):
    from opacus_dp.grad_sample import GradSampleModule

    model = conv_model()
    x = torch.randn(0, 2, 7, 8, dtype=torch.float64)
    _, got = run_grad_sample_module(GradSampleModule, model, x, model(x).detach(), reduction)
    assert {p: g.shape for p, g in got.items()} == {p: (0, *p.shape) for p in model.parameters()}
