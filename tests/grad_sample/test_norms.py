"""Per-sample gradients of LayerNorm, GroupNorm, InstanceNorm and RMSNorm against a
batch-size-1 autograd oracle (samplers called directly with a random output gradient)."""

import math

import pytest
import torch
import torch.nn as nn
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from opacus_dp.grad_sample import norms
from opacus_dp.grad_sample.registry import GRAD_SAMPLERS

F64 = torch.float64
needs_rms_norm = pytest.mark.skipif(not hasattr(nn, "RMSNorm"), reason="torch without nn.RMSNorm")


def oracle_per_sample_grads(layer, x, gy):
    """{param: (B, *param.shape)} from one autograd call per sample."""
    params = [p for p in layer.parameters() if p.requires_grad]
    rows = {p: [] for p in params}
    for i in range(x.shape[0] if params else 0):
        grads = torch.autograd.grad((layer(x[i : i + 1]) * gy[i : i + 1]).sum(), params)
        for p, g in zip(params, grads):
            rows[p].append(g)
    return {p: torch.stack(r) for p, r in rows.items()}


def assert_matches_oracle(layer, x, atol=1e-10, rtol=1e-8):
    gy = torch.randn_like(layer(x))
    got = GRAD_SAMPLERS[type(layer)](layer, [x], gy)
    expected = oracle_per_sample_grads(layer, x, gy)
    assert set(got) == set(expected)
    for p, g in expected.items():
        assert got[p].shape == (x.shape[0], *p.shape)
        torch.testing.assert_close(got[p], g, atol=atol, rtol=rtol)


def randomise_affine(layer):
    """Non-trivial weight/bias so that a swapped or missing term shows up."""
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
    return layer


batch_sizes = st.integers(1, 3)
small = st.integers(1, 4)


@settings(max_examples=20, deadline=None)
@given(st.lists(small, min_size=1, max_size=2), st.lists(small, max_size=2), batch_sizes,
       st.booleans(), st.sampled_from([1e-5, 0.3]))
def test_layer_norm(normalized, leading, batch, with_bias, eps):
    layer = randomise_affine(nn.LayerNorm(normalized, eps=eps, bias=with_bias, dtype=F64))
    assert_matches_oracle(layer, torch.randn(batch, *leading, *normalized, dtype=F64))


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.lists(small, max_size=3), batch_sizes,
       st.sampled_from([1e-5, 0.3]))
def test_group_norm(groups, channels_per_group, spatial, batch, eps):
    assume(channels_per_group * torch.Size(spatial).numel() > 1)  # torch needs >1 value per group
    layer = randomise_affine(nn.GroupNorm(groups, groups * channels_per_group, eps=eps, dtype=F64))
    x = torch.randn(batch, groups * channels_per_group, *spatial, dtype=F64)
    assert_matches_oracle(layer, x)


INSTANCE = {1: nn.InstanceNorm1d, 2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), batch_sizes, st.booleans(), st.data())
def test_instance_norm(nd, channels, batch, track, data):
    spatial = data.draw(st.lists(st.integers(2, 4), min_size=nd, max_size=nd))
    layer = INSTANCE[nd](channels, affine=True, track_running_stats=track, eps=0.2, dtype=F64)
    x = torch.randn(batch, channels, *spatial, dtype=F64)
    assert_matches_oracle(randomise_affine(layer), x)


@pytest.mark.parametrize("nd", [1, 2, 3])
def test_instance_norm_eval_uses_running_statistics(nd):
    layer = randomise_affine(INSTANCE[nd](3, affine=True, track_running_stats=True, dtype=F64))
    layer.running_mean.normal_()
    layer.running_var.uniform_(0.5, 2.0)
    layer.eval()
    assert_matches_oracle(layer, torch.randn(3, 3, *[4] * nd, dtype=F64))


@needs_rms_norm
@settings(max_examples=15, deadline=None)
@given(st.lists(small, min_size=1, max_size=2), st.lists(small, max_size=2), batch_sizes,
       st.sampled_from([None, 1e-6, 0.3]))
def test_rms_norm(normalized, leading, batch, eps):
    layer = randomise_affine(nn.RMSNorm(normalized, eps=eps, dtype=F64))
    assert_matches_oracle(layer, torch.randn(batch, *leading, *normalized, dtype=F64))


@needs_rms_norm
def test_rms_norm_default_eps_follows_input_dtype():
    """eps=None is finfo(float32).eps here; inputs small enough for it to matter."""
    layer = randomise_affine(nn.RMSNorm(6))
    assert_matches_oracle(layer, 1e-4 * torch.randn(3, 2, 6), atol=1e-6, rtol=1e-4)


def all_layers():
    layers = [nn.LayerNorm(4, dtype=F64), nn.GroupNorm(2, 4, dtype=F64),
              nn.InstanceNorm1d(4, affine=True, dtype=F64)]
    if hasattr(nn, "RMSNorm"):
        layers.append(nn.RMSNorm(4, dtype=F64))
    return layers


@pytest.mark.parametrize("layer", all_layers(), ids=lambda m: type(m).__name__)
def test_empty_batch_gives_zero_rows(layer):
    x = torch.randn(0, 4, 4, dtype=F64)
    got = GRAD_SAMPLERS[type(layer)](layer, [x], torch.zeros_like(x))
    assert {p: g.shape for p, g in got.items()} == {p: (0, *p.shape) for p in layer.parameters()}


@pytest.mark.parametrize("layer", all_layers(), ids=lambda m: type(m).__name__)
def test_frozen_weight(layer):
    layer.weight.requires_grad_(False)
    assert_matches_oracle(randomise_affine(layer), torch.randn(3, 4, 4, dtype=F64))


@pytest.mark.parametrize(
    "layer",
    [nn.LayerNorm(4, elementwise_affine=False), nn.GroupNorm(2, 4, affine=False),
     nn.InstanceNorm2d(4)],
    ids=lambda m: type(m).__name__,
)
def test_layers_without_parameters_give_nothing(layer):
    x = torch.randn(2, 4, 4, 4)
    assert GRAD_SAMPLERS[type(layer)](layer, [x], torch.randn_like(x)) == {}


@pytest.mark.parametrize(
    "layer, shape",
    [(nn.LayerNorm((3, 4)), (2, 4, 3)), (nn.GroupNorm(2, 4), (2, 6, 3)),
     (nn.InstanceNorm2d(4, affine=True), (2, 3, 5, 5))],
    ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else str(v),
)
def test_wrong_input_shape_is_rejected(layer, shape):
    x = torch.randn(shape)
    with pytest.raises(ValueError, match=type(layer).__name__):
        GRAD_SAMPLERS[type(layer)](layer, [x], torch.randn_like(x))


def test_registrations():
    assert GRAD_SAMPLERS[nn.LayerNorm] is norms.layer_norm_grad_sample
    assert GRAD_SAMPLERS[nn.GroupNorm] is norms.group_norm_grad_sample
    for cls in INSTANCE.values():
        assert GRAD_SAMPLERS[cls] is norms.instance_norm_grad_sample
    if hasattr(nn, "RMSNorm"):
        assert GRAD_SAMPLERS[nn.RMSNorm] is norms.rms_norm_grad_sample


# ---------------------------------------------------------------- through GradSampleModule
def per_sample_loss(out, target, batch_dim):
    """Loss term of each sample: squared error summed over all but the batch dimension."""
    return (out - target).pow(2).movedim(batch_dim, 0).flatten(start_dim=1).sum(dim=1)


def oracle_model_grads(model, x, target, batch_dim):
    """{param: (B, *param.shape)}: gradient of each sample's own loss term, one at a time."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(x.shape[batch_dim]):
        xi, ti = x.narrow(batch_dim, i, 1), target.narrow(batch_dim, i, 1)
        rows.append(torch.autograd.grad(per_sample_loss(model(xi), ti, batch_dim).sum(), params))
    return {p: torch.stack([r[j] for r in rows]) for j, p in enumerate(params)}


def sequence_model(second_bias=False):
    """Norms over the feature dims of (B, T, C) or (T, B, C) inputs.

    Opacus 1.6 fails on ``LayerNorm(bias=False)``: compare with it using ``second_bias=True``.
    """
    layers = [nn.LayerNorm(6, eps=0.1), nn.Tanh(), nn.LayerNorm(6, bias=second_bias)]
    if hasattr(nn, "RMSNorm"):
        layers += [nn.Tanh(), nn.RMSNorm(6)]
    return nn.Sequential(*layers).double()


def image_model():
    return nn.Sequential(
        nn.GroupNorm(2, 4), nn.Tanh(), nn.InstanceNorm2d(4, affine=True), nn.Tanh(),
        nn.LayerNorm((5, 5)),
    ).double()


def run_grad_sample_module(wrapper_cls, model, x, target, batch_first, reduction):
    gsm = wrapper_cls(model, batch_first=batch_first, loss_reduction=reduction)
    losses = per_sample_loss(gsm(x), target, 0 if batch_first else 1)
    (losses.sum() if reduction == "sum" else losses.mean()).backward()
    return gsm, {p: p.grad_sample for p in model.parameters() if p.requires_grad}


def model_and_input(kind, batch_first, second_bias=False):
    model = sequence_model(second_bias) if kind == "sequence" else image_model()
    model = randomise_affine(model)
    if kind == "sequence":
        shape = (3, 4, 6) if batch_first else (4, 3, 6)
    else:
        shape = (3, 4, 5, 5)
    return model, torch.randn(shape, dtype=F64)


CASES = [("sequence", True), ("sequence", False), ("image", True)]


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("kind, batch_first", CASES)
def test_grad_sample_module_matches_oracle(kind, batch_first, reduction):
    from opacus_dp.grad_sample import GradSampleModule

    model, x = model_and_input(kind, batch_first)
    target = torch.randn_like(model(x))
    batch_dim = 0 if batch_first else 1
    expected = oracle_model_grads(model, x, target, batch_dim)
    gsm, got = run_grad_sample_module(GradSampleModule, model, x, target, batch_first, reduction)
    assert set(got) == set(expected)
    for p, g in expected.items():
        torch.testing.assert_close(got[p], g, atol=1e-10, rtol=1e-8)
    gsm.close()


@pytest.mark.filterwarnings("ignore:Full backward hook")
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("kind, batch_first", CASES)
def test_grad_sample_module_agrees_with_opacus(kind, batch_first, reduction):
    import copy

    from opacus import GradSampleModule as OpacusGradSampleModule

    from opacus_dp.grad_sample import GradSampleModule

    model, x = model_and_input(kind, batch_first, second_bias=True)
    twin = copy.deepcopy(model)
    target = torch.randn_like(model(x))
    _, ours = run_grad_sample_module(GradSampleModule, model, x, target, batch_first, reduction)
    _, theirs = run_grad_sample_module(
        OpacusGradSampleModule, twin, x, target, batch_first, reduction)
    assert len(ours) == len(theirs) == len(list(model.parameters()))
    for g, h in zip(ours.values(), theirs.values()):
        torch.testing.assert_close(g, h, atol=1e-10, rtol=1e-8)


def test_results_do_not_alias_backprops():
    """Without leading dims the bias gradient is gy itself: it must still be a new tensor."""
    layer = nn.LayerNorm(4)
    x = torch.randn(3, 4)
    gy = torch.randn(3, 4)
    got = norms.layer_norm_grad_sample(layer, [x], gy)
    torch.testing.assert_close(got[layer.bias], gy)
    got[layer.bias].mul_(0.0)
    assert gy.abs().sum() > 0


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.lists(small, max_size=3), batch_sizes,
       st.sampled_from([1e-5, 0.3]), st.sampled_from(["both", "weight", "bias"]))
def test_group_norm_from_the_forwards_saved_statistics(groups, channels_per_group, spatial, batch,
                                                       eps, trained):
    """The one-pass form from the (mean, rstd) the forward saved equals the oracle, also with
    a frozen weight or bias (inputs far from zero mean: the statistics must be the forward's)."""
    assume(channels_per_group * torch.Size(spatial).numel() > 1)
    layer = randomise_affine(nn.GroupNorm(groups, groups * channels_per_group, eps=eps, dtype=F64))
    layer.weight.requires_grad_(trained != "bias")
    layer.bias.requires_grad_(trained != "weight")
    x = 5 + 3 * torch.randn(batch, groups * channels_per_group, *spatial, dtype=F64)
    out = layer(x)
    statistics = norms.saved_statistics(layer, out)
    assert statistics is not None and statistics[0].shape == (batch, groups)
    gy = torch.randn_like(out)
    got = norms.group_norm_grad_sample(layer, [x], gy, statistics=statistics)
    expected = oracle_per_sample_grads(layer, x, gy)
    assert set(got) == set(expected)
    for p, g in expected.items():
        torch.testing.assert_close(got[p], g, atol=1e-10, rtol=1e-8)


def test_group_norm_statistics_are_read_only_from_the_ops_own_output(monkeypatch):
    """GradSampleModule hands the saved statistics to the sampler (one-pass form used, results
    equal the oracle); not under saved-tensor hooks or for a tensor that is not GroupNorm's result."""
    from tests.grad_sample.oracle import assert_grad_samples_close, gsm_grad_samples, oracle_grad_samples

    used = []
    original = norms._group_norm_grads_from_statistics
    monkeypatch.setattr(norms, "_group_norm_grads_from_statistics",
                        lambda *a: used.append(1) or original(*a))
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4), nn.Tanh()).double()
    x = torch.randn(3, 2, 5, 5, dtype=F64)
    assert_grad_samples_close(gsm_grad_samples(model, (x,)), oracle_grad_samples(model, (x,)))
    assert used == [1]
    with torch.autograd.graph.save_on_cpu():
        assert norms.saved_statistics(model[1], model[1](model[0](x))) is None
        assert_grad_samples_close(gsm_grad_samples(model, (x,)), oracle_grad_samples(model, (x,)))
    assert used == [1]
    assert norms.saved_statistics(model[1], torch.tanh(model[1](model[0](x)))) is None


@settings(max_examples=20, deadline=None)
@given(st.lists(small, min_size=1, max_size=2), st.lists(small, max_size=2), batch_sizes,
       st.sampled_from([1e-5, 0.3]), st.sampled_from(["both", "weight", "bias"]))
def test_layer_norm_from_the_forwards_saved_statistics(normalized, leading, batch, eps, trained):
    """``x_hat`` from the forward's saved (mean, rstd) gives the oracle's per-sample gradients
    (inputs far from zero mean, so that wrong statistics show), also with a frozen parameter."""
    layer = randomise_affine(nn.LayerNorm(normalized, eps=eps, dtype=F64))
    layer.weight.requires_grad_(trained != "bias")
    layer.bias.requires_grad_(trained != "weight")
    x = 5 + 3 * torch.randn(batch, *leading, *normalized, dtype=F64)
    out = layer(x)
    statistics = norms.saved_statistics(layer, out)
    assert statistics is not None
    assert statistics[0].shape == (batch, *leading, *[1] * len(normalized))
    gy = torch.randn_like(out)
    got = norms.layer_norm_grad_sample(layer, [x], gy, statistics=statistics)
    expected = oracle_per_sample_grads(layer, x, gy)
    assert set(got) == set(expected)
    for p, g in expected.items():
        torch.testing.assert_close(got[p], g, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("normalized, leading", [((256,), (64,)), ((16, 32), (4, 8)), ((8,), (3,))])
@pytest.mark.parametrize("trained", ["both", "weight", "bias", "no bias"])
def test_layer_norm_per_sample_kernel_on_long_samples(monkeypatch, normalized, leading, trained):
    """On CPU, samples of ≥ PER_SAMPLE_KERNEL_MIN_ELEMENTS values get their gradients from
    torch's LayerNorm backward kernel, one call per sample (the small case with the threshold
    lowered): the oracle's per-sample gradients, with frozen or absent parameters."""
    if math.prod(normalized) * math.prod(leading) < norms.PER_SAMPLE_KERNEL_MIN_ELEMENTS:
        monkeypatch.setattr(norms, "PER_SAMPLE_KERNEL_MIN_ELEMENTS", 1)
    calls = []
    kernel = norms._layer_norm_grads_per_sample
    monkeypatch.setattr(norms, "_layer_norm_grads_per_sample",
                        lambda *a: calls.append(1) or kernel(*a))
    layer = randomise_affine(nn.LayerNorm(normalized, bias=trained != "no bias", dtype=F64))
    layer.weight.requires_grad_(trained != "bias")
    if layer.bias is not None:
        layer.bias.requires_grad_(trained != "weight")
    x = 5 + 3 * torch.randn(3, *leading, *normalized, dtype=F64)
    out = layer(x)
    gy = torch.randn_like(out)
    got = norms.layer_norm_grad_sample(layer, [x], gy, statistics=norms.saved_statistics(layer, out))
    assert calls == [1]
    expected = oracle_per_sample_grads(layer, x, gy)
    assert set(got) == set(expected)
    for p, g in expected.items():
        torch.testing.assert_close(got[p], g, atol=1e-10, rtol=1e-8)


def test_layer_norm_statistics_are_used_and_read_only_from_the_ops_own_output(monkeypatch):
    """GradSampleModule hands LayerNorm's saved statistics to its sampler, which normalises
    with them (results equal the oracle; wrong statistics would not); not under saved-tensor
    hooks, for another op's output, or when their shape does not fit the input."""
    from tests.grad_sample.oracle import assert_grad_samples_close, gsm_grad_samples, oracle_grad_samples

    fits = []
    original = norms._layer_statistics_fit
    monkeypatch.setattr(norms, "_layer_statistics_fit", lambda *a: fits.append(original(*a)) or fits[-1])
    model = nn.Sequential(nn.Linear(3, 6), nn.LayerNorm(6), nn.Tanh()).double()
    x = 2 + torch.randn(4, 5, 3, dtype=F64)
    assert_grad_samples_close(gsm_grad_samples(model, (x,)), oracle_grad_samples(model, (x,)))
    assert fits == [True]
    with torch.autograd.graph.save_on_cpu():
        assert norms.saved_statistics(model[1], model[1](model[0](x))) is None
        assert_grad_samples_close(gsm_grad_samples(model, (x,)), oracle_grad_samples(model, (x,)))
    assert fits == [True]
    assert norms.saved_statistics(model[1], torch.tanh(model[1](model[0](x)))) is None
    h = model[0](x)
    mean, rstd = norms.saved_statistics(model[1], model[1](h))
    assert not norms._layer_statistics_fit(model[1], h[:2], (mean, rstd))
    gy = torch.randn(4, 5, 6, dtype=F64)
    wrong = norms.layer_norm_grad_sample(model[1], [h], gy, statistics=(torch.zeros_like(mean), rstd))
    right = norms.layer_norm_grad_sample(model[1], [h], gy, statistics=(mean, rstd))
    assert not torch.allclose(wrong[model[1].weight], right[model[1].weight])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 5, 4), (2, 1, 7), (0, 3, 2), (3, 0, 2), (4, 128, 33)])
def test_sum_over_positions_equals_sum_over_the_middle_dimension(dtype, shape):
    from opacus_dp.grad_sample.support import sum_over_positions

    t = torch.randn(*shape, dtype=torch.float64).to(dtype)
    for view in (t, t.transpose(0, 1).contiguous().transpose(0, 1)):
        got = sum_over_positions(view)
        assert got.shape == (shape[0], shape[2]) and got.dtype == dtype
        torch.testing.assert_close(got, view.sum(dim=1), atol=1e-5, rtol=1e-5)
        if got.numel():
            got.add_(1.0)  # a new tensor: the input is not changed
            torch.testing.assert_close(view.double(), t.double())


@pytest.mark.parametrize("laid_out", ["default", "channels-last"])
def test_group_norm_under_bfloat16_autocast_sums_in_float32_from_the_statistics(monkeypatch, laid_out):
    """bfloat16 autocast on CPU: GroupNorm's input and output gradient are bfloat16, its statistics
    and parameters float32. The per-sample sums are taken in float32 from the statistics (one pass,
    as torch's own weight gradient): they equal the float32 oracle on the same bfloat16 values to
    float32 rounding, where a normalisation recomputed in bfloat16 gave bfloat16 sums."""
    used = []
    original = norms._group_statistics_fit
    monkeypatch.setattr(norms, "_group_statistics_fit", lambda *a: used.append(original(*a)) or used[-1])
    torch.manual_seed(3)
    layer = randomise_affine(nn.GroupNorm(4, 8))
    x = (3 + 2 * torch.randn(5, 8, 6, 6)).to(torch.bfloat16)
    if laid_out == "channels-last":
        x = x.contiguous(memory_format=torch.channels_last)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    statistics = norms.saved_statistics(layer, out)
    assert statistics is not None and statistics[0].dtype == torch.float32 and out.dtype == torch.bfloat16
    gy = torch.randn(out.shape).to(torch.bfloat16).contiguous(memory_format=torch.channels_last
                                                              if laid_out == "channels-last" else torch.contiguous_format)
    got = norms.group_norm_grad_sample(layer, [x], gy, statistics=statistics)
    assert used == [True]
    expected = oracle_per_sample_grads(layer, x.float(), gy.float())
    for p, g in expected.items():
        assert got[p].dtype == torch.float32
        torch.testing.assert_close(got[p], g, rtol=1e-5, atol=1e-5)
