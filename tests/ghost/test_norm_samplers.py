"""Per-layer ghost norms and weighted gradients against a batch-size-1 autograd oracle.

For every layer type with a norm sampler: ``norm_sampler(layer, a, g)[p] == ‖g_i(p)‖²`` and
``weighted_grad(layer, a, g, f)[p] == Σ_i f_i g_i(p)``, where ``g_i`` are the oracle's
per-sample gradients (float64, hypothesis shapes).
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from opacus_dp.grad_sample import GRAD_SAMPLERS, NORM_SAMPLERS
from opacus_dp.grad_sample.registry import PerSampleGrads
from opacus_dp.grad_sample.conv import padded_input
from opacus_dp.grad_sample.bookkeeping.norm_rules import NORM_RULES
from opacus_dp.grad_sample.bookkeeping.norm_samplers.conv import _prefers_autocorrelation, patch_gram
from opacus_dp.grad_sample.bookkeeping.norm_samplers.linear import gram_sq_norms, row_blocks
from opacus_dp.layers import BatchFirstLinear
from tests.ghost.helpers import layer_call, sq_norms, weighted

SETTINGS = settings(max_examples=12, deadline=None)


def check_layer(layer: nn.Module, x: torch.Tensor, seed: int = 0, same_factors: bool = False) -> None:
    """``same_factors``: one factor per sample for all parameters (flat clipping), else one
    per sample and parameter (per-layer clipping)."""
    activations, backprops, oracle = layer_call(layer, x)
    norms = NORM_SAMPLERS[type(layer)](layer, activations, backprops)
    assert set(norms) == set(oracle)
    factors_gen = torch.Generator().manual_seed(seed)
    shared = torch.rand(x.shape[0], generator=factors_gen, dtype=torch.float64)
    factors = {p: shared.clone() if same_factors else
               torch.rand(x.shape[0], generator=factors_gen, dtype=torch.float64) for p in oracle}
    sums = NORM_RULES[type(layer)].weighted_grad(layer, activations, backprops, factors)
    assert set(sums) == set(oracle)
    for p, expected in oracle.items():
        if isinstance(norms[p], PerSampleGrads):  # returned in full (biases)
            torch.testing.assert_close(norms[p].grads, expected, rtol=1e-9, atol=1e-10)
        else:
            torch.testing.assert_close(norms[p], sq_norms(expected), rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(sums[p], weighted(factors[p], expected), rtol=1e-9, atol=1e-10)


@SETTINGS
@given(batch=st.integers(1, 4), middle=st.lists(st.integers(1, 3), max_size=2),
       features=st.tuples(st.integers(1, 5), st.integers(1, 5)), bias=st.booleans(),
       batch_first_type=st.booleans())
def test_linear_2d_and_sequences(batch, middle, features, bias, batch_first_type):
    cls = BatchFirstLinear if batch_first_type else nn.Linear
    layer = cls(*features, bias=bias).double()
    check_layer(layer, torch.randn(batch, *middle, features[0], dtype=torch.float64))


@SETTINGS
@given(batch=st.integers(1, 4), positions=st.integers(1, 3),
       features=st.tuples(st.integers(1, 5), st.integers(1, 5)),
       frozen=st.sampled_from([None, "weight", "bias"]), same_factors=st.booleans())
def test_linear_weighted_sums_both_scaled_sides_and_frozen_parameters(batch, positions, features,
                                                                    frozen, same_factors):
    """Both ways of the weighted sum (inputs scaled when ``d ≤ p``, output gradients
    otherwise), shared or separate factors, either parameter frozen."""
    layer = nn.Linear(*features).double()
    if frozen is not None:
        getattr(layer, frozen).requires_grad_(False)
    check_layer(layer, torch.randn(batch, positions, features[0], dtype=torch.float64),
                same_factors=same_factors)


@st.composite
def conv_cases(draw):
    dims = draw(st.integers(1, 3))
    groups = draw(st.sampled_from([1, 2]))
    cin, cout = groups * draw(st.integers(1, 2)), groups * draw(st.integers(1, 2))
    kernel = draw(st.integers(1, 3))
    padding = draw(st.sampled_from([0, 1, "same", "valid"]))
    stride = 1 if padding == "same" else draw(st.integers(1, 2))
    mode = draw(st.sampled_from(["zeros", "reflect", "circular"])) if padding == 1 else "zeros"
    size = draw(st.integers(kernel + 2, 6)) if dims < 3 else kernel + 2
    return dims, dict(in_channels=cin, out_channels=cout, kernel_size=kernel, stride=stride,
                      padding=padding, dilation=draw(st.integers(1, 2)), groups=groups,
                      bias=draw(st.booleans()), padding_mode=mode), size, draw(st.integers(1, 3))


@SETTINGS
@given(case=conv_cases())
def test_conv_1d_2d_3d_with_groups_stride_dilation_padding(case):
    dims, kwargs, size, batch = case
    layer = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims](**kwargs).double()
    dilated = kwargs["dilation"] * (kwargs["kernel_size"] - 1) + 1
    size = max(size, dilated)
    check_layer(layer, torch.randn(batch, kwargs["in_channels"], *[size] * dims, dtype=torch.float64))


@SETTINGS
@given(case=conv_cases())
def test_conv_patch_gram_methods_agree_with_unfolded_patches(case):
    """Both forms of ``A_i A_iᵀ`` against the Gram of explicitly unfolded patches (F.unfold
    is an independent im2col, 2-D only; 1-D/3-D compare with the windows form)."""
    dims, kwargs, size, batch = case
    layer = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims](**kwargs).double()
    size = max(size, kwargs["dilation"] * (kwargs["kernel_size"] - 1) + 1)
    x = torch.randn(batch, kwargs["in_channels"], *[size] * dims, dtype=torch.float64)
    windows = patch_gram(layer, x, method="windows")
    auto = patch_gram(layer, x, method="auto")
    correlated = patch_gram(layer, x, method="autocorrelation")
    torch.testing.assert_close(correlated, windows, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(auto, windows, rtol=1e-10, atol=1e-10)
    if dims == 2:
        padded = padded_input(layer, x)
        patches = F.unfold(padded, layer.kernel_size, dilation=layer.dilation, stride=layer.stride)
        groups = layer.groups
        patches = patches.view(batch, groups, -1, patches.shape[-1]).flatten(0, 1)
        torch.testing.assert_close(windows, patches.transpose(1, 2) @ patches, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kwargs", [dict(kernel_size=2, padding=3, dilation=2, stride=2),
                                    dict(kernel_size=3, padding=(4, 0), stride=(1, 3)),
                                    dict(kernel_size=1, padding=2)])
def test_autocorrelation_with_zero_padding_wider_than_the_taps_reach(kwargs):
    """Under zero padding the autocorrelation form takes the Gram of the unpadded input: outputs
    whose taps all fall into the padding are zero rows, the others sum only their inner taps."""
    layer = nn.Conv2d(3, 2, **kwargs).double()
    x = torch.randn(2, 3, 5, 4, dtype=torch.float64)
    windows = patch_gram(layer, x, method="windows")
    torch.testing.assert_close(patch_gram(layer, x, method="autocorrelation"), windows, rtol=1e-12, atol=1e-12)
    assert windows.abs().sum() > 0 and bool((windows.diagonal(dim1=1, dim2=2) == 0).any())


@pytest.mark.parametrize("kwargs", [dict(kernel_size=3, padding=1, stride=3),  # a phase no tap reads
                                    dict(kernel_size=(3, 2), padding=(2, 1), dilation=(1, 3), stride=(2, 4)),
                                    dict(kernel_size=5, padding=2, stride=2, groups=2),
                                    dict(kernel_size=3, padding=1, stride=2, padding_mode="reflect")])
def test_strided_autocorrelation_from_the_phases_grams_is_the_unfolded_patches_gram(kwargs):
    """A strided layer's taps read the input's phases (positions ``r + j·s``): the Grams within each
    phase give every entry of ``A_i A_iᵀ`` (F.unfold: an independent im2col)."""
    layer = nn.Conv2d(4, 2, **kwargs).double()
    x = torch.randn(3, 4, 9, 10, dtype=torch.float64)
    patches = F.unfold(padded_input(layer, x), layer.kernel_size, dilation=layer.dilation, stride=layer.stride)
    patches = patches.view(3, layer.groups, -1, patches.shape[-1]).flatten(0, 1)
    torch.testing.assert_close(patch_gram(layer, x, method="autocorrelation"), patches.transpose(1, 2) @ patches,
                               rtol=1e-12, atol=1e-12)


def test_autocorrelation_is_chosen_for_layers_with_several_taps_and_many_channels():
    x = torch.zeros(2, 64, 8, 8)
    assert _prefers_autocorrelation(nn.Conv2d(64, 64, 3, padding=1), x)
    assert _prefers_autocorrelation(nn.Conv2d(64, 128, 3, padding=1), torch.zeros(2, 64, 4, 4))
    # strided: the Grams of the input's phases (a ResNet's downsampling convolution)
    assert _prefers_autocorrelation(nn.Conv2d(64, 64, 3, padding=1, stride=2), x)
    assert _prefers_autocorrelation(nn.Conv2d(32, 64, 3, padding=1, stride=2), torch.zeros(2, 32, 16, 16))
    assert not _prefers_autocorrelation(nn.Conv2d(64, 64, 1), x)  # 1x1: the patches are the input
    assert not _prefers_autocorrelation(nn.Conv2d(3, 8, 3, padding=1), torch.zeros(2, 3, 32, 32))
    assert not _prefers_autocorrelation(nn.Conv2d(3, 8, 3, padding=1, stride=2), torch.zeros(2, 3, 32, 32))
    with pytest.raises(ValueError, match="method"):
        patch_gram(nn.Conv2d(2, 2, 3), torch.zeros(1, 2, 4, 4), method="fft")


@SETTINGS
@given(batch=st.integers(1, 4), shape=st.lists(st.integers(1, 5), max_size=2),
       vocab=st.integers(2, 6), padding_idx=st.sampled_from([None, 0, 1]),
       scale_grad_by_freq=st.booleans())
def test_embedding_index_matching(batch, shape, vocab, padding_idx, scale_grad_by_freq):
    layer = nn.Embedding(vocab, 3, padding_idx=padding_idx,
                         scale_grad_by_freq=scale_grad_by_freq).double()
    check_layer(layer, torch.randint(0, vocab, (batch, *shape)))


def test_repeated_indices_are_summed_before_the_norm():
    """Index matching must add the gradients of equal indices inside one sample."""
    layer = nn.Embedding(4, 2).double()
    check_layer(layer, torch.tensor([[1, 1, 1, 2], [3, 0, 3, 3]]))


@pytest.mark.parametrize("make", [lambda: nn.Linear(3, 4), lambda: nn.Conv2d(2, 3, 2),
                                  lambda: nn.Embedding(5, 3)])
def test_frozen_parameters_are_left_out(make):
    layer = make().double()
    for p in layer.parameters():
        p.requires_grad_(False)
    layer.weight.requires_grad_(True)
    x = torch.randint(0, 5, (2, 3)) if isinstance(layer, nn.Embedding) else \
        torch.randn(2, 3, dtype=torch.float64) if isinstance(layer, nn.Linear) else \
        torch.randn(2, 2, 4, 4, dtype=torch.float64)
    check_layer(layer, x)


def test_empty_batch_gives_empty_norms():
    layer = nn.Conv2d(2, 3, 2).double()
    x = torch.zeros(0, 2, 4, 4, dtype=torch.float64)
    norms = NORM_SAMPLERS[nn.Conv2d](layer, [x], torch.zeros(0, 3, 3, 3, dtype=torch.float64))
    assert norms[layer.weight].shape == (0,) and norms[layer.bias].grads.shape == (0, 3)


@pytest.mark.parametrize("layer, shape", [(nn.Linear(3, 4), (5, 6, 3)), (nn.Conv1d(3, 4, 2), (5, 3, 6))],
                         ids=["linear", "conv"])
def test_norm_samplers_return_bias_gradients_per_sample_and_weights_as_norms(layer, shape):
    """Biases come back as per-sample gradients (kept as materialised, so their clipped sum
    needs no second pass over the output gradients); weights as squared norms."""
    layer = layer.double()
    activations, backprops, oracle = layer_call(layer, torch.randn(*shape, dtype=torch.float64))
    norms = NORM_SAMPLERS[type(layer)](layer, activations, backprops)
    assert isinstance(norms[layer.bias], PerSampleGrads) and torch.is_tensor(norms[layer.weight])
    torch.testing.assert_close(norms[layer.bias].grads, oracle[layer.bias], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(norms[layer.weight], sq_norms(oracle[layer.weight]), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("positions", [1, 5, 127, 128, 131, 256, 259, 512, 517, 1024, 1031])
def test_linear_gram_norms_with_and_without_row_blocks(positions):
    """The ghost identity (in 1, 2, 4 or 8 row blocks, uneven ones included) against ‖G_iᵀ A_i‖²."""
    assert [row_blocks(n) for n in (5, 127, 131, 259, 517, 1031)] == [1, 1, 2, 4, 8, 8]  # every path
    assert [row_blocks(n, "cuda") for n in (131, 259, 517, 1031)] == [1, 2, 4, 8]  # 128-row floor
    a = torch.randn(3, positions, 4, dtype=torch.float64)
    g = torch.randn(3, positions, 5, dtype=torch.float64)
    expected = torch.einsum("btp,btd->bpd", g, a).pow(2).sum(dim=(1, 2))
    torch.testing.assert_close(gram_sq_norms(a, g), expected, rtol=1e-10, atol=1e-10)


@SETTINGS
@given(batch=st.integers(1, 4), per_bag=st.integers(1, 4), mode=st.sampled_from(["sum", "mean", "max"]),
       padding_idx=st.sampled_from([None, 0]))
def test_embedding_bag_2d_input(batch, per_bag, mode, padding_idx):
    layer = nn.EmbeddingBag(5, 3, mode=mode, padding_idx=padding_idx).double()
    check_layer(layer, torch.randint(0, 5, (batch, per_bag)))


@SETTINGS
@given(lengths=st.lists(st.integers(0, 4), min_size=1, max_size=4),
       mode=st.sampled_from(["sum", "mean", "max"]), padding=st.booleans(), use_weights=st.booleans(),
       include_last_offset=st.booleans(), seed=st.integers(0, 1000), by_freq=st.booleans())
def test_embedding_bag_offsets_against_materialised_gradients(lengths, mode, padding, use_weights,
                                                              include_last_offset, seed, by_freq):
    """Bags from offsets (empty bags, padding, per-sample weights) against the grad sampler,
    itself checked against autograd in tests/grad_sample/test_embedding_bag.py."""
    torch.manual_seed(seed)
    layer = nn.EmbeddingBag(6, 3, mode=mode, padding_idx=2 if padding else None,
                            include_last_offset=include_last_offset,
                            scale_grad_by_freq=by_freq and mode != "max").double()
    indices = torch.randint(0, 6, (sum(lengths),))
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    offsets = starts if include_last_offset else starts[:-1]
    weights = torch.randn(sum(lengths), dtype=torch.float64) if use_weights and mode == "sum" else None
    activations = [indices, offsets, weights]
    backprops = torch.randn(len(lengths), 3, dtype=torch.float64)
    materialised = GRAD_SAMPLERS[nn.EmbeddingBag](layer, activations, backprops)[layer.weight]
    norms = NORM_SAMPLERS[nn.EmbeddingBag](layer, activations, backprops)
    torch.testing.assert_close(norms[layer.weight], sq_norms(materialised), rtol=1e-10, atol=1e-12)
    factors = {layer.weight: torch.rand(len(lengths), dtype=torch.float64)}
    sums = NORM_RULES[nn.EmbeddingBag].weighted_grad(layer, activations, backprops, factors)
    torch.testing.assert_close(sums[layer.weight], weighted(factors[layer.weight], materialised),
                               rtol=1e-10, atol=1e-12)


def test_conv_clipped_sum_runs_without_cudnn_where_its_tf32_default_would_apply(monkeypatch):
    """A float32 CUDA clipped sum is computed with cuDNN off (its TF32 default would round the
    products more coarsely than the norms'); the flag is restored, also after an error, and left
    alone elsewhere. Here the CUDA condition is forced: the wiring and the restore are checked."""
    from opacus_dp.grad_sample.bookkeeping.norm_samplers import conv as conv_samplers

    seen = []
    original = conv_samplers._WEIGHT_GRAD[2]

    def recording(*args, **kwargs):
        seen.append(torch.backends.cudnn.enabled)
        return original(*args, **kwargs)

    monkeypatch.setitem(conv_samplers._WEIGHT_GRAD, 2, recording)
    layer = nn.Conv2d(2, 3, 3, padding=1).double()
    x = torch.randn(3, 2, 5, 5, dtype=torch.float64)
    assert torch.backends.cudnn.enabled
    check_layer(layer, x)  # on CPU: cuDNN untouched
    assert seen == [True]
    monkeypatch.setattr(conv_samplers, "_cuda_float32", lambda t: True)
    check_layer(layer, x)  # "CUDA float32": computed with cuDNN off, same results
    assert seen == [True, False] and torch.backends.cudnn.enabled
    with pytest.raises(RuntimeError, match="boom"):
        with conv_samplers.products_as_exact_as_the_norms(x):
            assert not torch.backends.cudnn.enabled
            raise RuntimeError("boom")
    assert torch.backends.cudnn.enabled
    monkeypatch.undo()
    for t in (torch.zeros(1), torch.zeros(1, dtype=torch.bfloat16)):
        assert not conv_samplers._cuda_float32(t)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_conv_clipped_sum_on_cuda_is_as_exact_as_the_norms_with_tf32_allowed():
    """With cuDNN's TF32 allowed, the clipped sum still equals the float64 oracle to float32
    precision (TF32 products would be ~1e-3 off)."""
    previous = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = True
    try:
        layer64 = nn.Conv2d(16, 32, 3, padding=1).double()
        x64 = torch.randn(8, 16, 12, 12, dtype=torch.float64)
        activations, backprops, oracle = layer_call(layer64, x64)
        layer = nn.Conv2d(16, 32, 3, padding=1).cuda()
        with torch.no_grad():
            layer.weight.copy_(layer64.weight)
            layer.bias.copy_(layer64.bias)
        factors = {layer.weight: torch.rand(8, device="cuda")}
        sums = NORM_RULES[nn.Conv2d].weighted_grad(
            layer, [activations[0].float().cuda()], backprops.float().cuda(), factors)
        expected = weighted(factors[layer.weight].double().cpu(), oracle[layer64.weight])
        torch.testing.assert_close(sums[layer.weight].double().cpu(), expected, rtol=1e-5, atol=1e-5)
    finally:
        torch.backends.cudnn.allow_tf32 = previous
