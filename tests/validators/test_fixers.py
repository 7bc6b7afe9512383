"""Replacements made by ModuleValidator.fix: group counts, kept weights, equal outputs.

Oracles: group counts by hand; normalisation recomputed from its definition
(x - mean) / sqrt(var + eps) · γ + β; DP layers compared with the torch layer they replace.
"""

import copy

import pytest
import torch
import torch.nn as nn

from opacus_dp.validators import ModuleValidator, default_num_groups

F64 = torch.float64


@pytest.mark.parametrize(
    "channels, groups", [(3, 1), (6, 2), (50, 2), (96, 32), (64, 32), (7, 1), (37, 1), (1, 1), (33, 1), (48, 16)]
)
def test_group_count_is_that_of_opacus(channels, groups):
    """gcd(32, C) by hand, and the count Opacus 1.6's fix gives (same architecture, same
    checkpoints for a ported script)."""
    from opacus.validators import ModuleValidator as OpacusValidator

    assert default_num_groups(channels) == groups
    fixed = ModuleValidator.fix(nn.Sequential(nn.BatchNorm2d(channels)))
    assert fixed[0].num_groups == groups and channels % fixed[0].num_groups == 0
    assert OpacusValidator.fix(nn.Sequential(nn.BatchNorm2d(channels)))[0].num_groups == groups


def group_norm_oracle(x, groups, gamma, beta, eps):
    n, c = x.shape[:2]
    grouped = x.reshape(n, groups, -1)
    mean = grouped.mean(-1, keepdim=True)
    var = grouped.var(-1, unbiased=False, keepdim=True)
    y = ((grouped - mean) / torch.sqrt(var + eps)).reshape(x.shape)
    shape = (1, c) + (1,) * (x.dim() - 2)
    return y * gamma.reshape(shape) + beta.reshape(shape)


def test_groupnorm_replacement_keeps_affine_eps_dtype_and_trainability():
    bn = nn.BatchNorm2d(6, eps=1e-3).to(F64)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 2.0)
        bn.bias.uniform_(-1.0, 1.0)
    bn.bias.requires_grad_(False)
    fixed = ModuleValidator.fix(nn.Sequential(bn))[0]
    assert isinstance(fixed, nn.GroupNorm) and fixed.eps == 1e-3 and fixed.weight.dtype == F64
    assert fixed.weight.requires_grad and not fixed.bias.requires_grad
    x = torch.randn(4, 6, 3, 3, dtype=F64)
    torch.testing.assert_close(fixed(x), group_norm_oracle(x, 2, bn.weight.detach(), bn.bias.detach(), 1e-3))


def test_batchnorm_without_trainable_parameters_is_kept_as_in_opacus():
    """Nothing to clip: kept (it must then run in eval mode, checked at every forward call,
    tests/grad_sample/test_frozen_batch_norm.py). Oracle: Opacus's fix."""
    from opacus.validators import ModuleValidator as OpacusValidator

    frozen = nn.BatchNorm2d(6).requires_grad_(False)
    for module in (nn.BatchNorm1d(4, affine=False), frozen):
        model = nn.Sequential(nn.Linear(4, 4), module)
        ours, theirs = ModuleValidator.fix(model), OpacusValidator.fix(model)
        assert type(ours[1]) is type(theirs[1]) is type(module)
        assert ModuleValidator.validate(model) == [] and OpacusValidator.validate(model) == []


@pytest.mark.parametrize(
    "bn, target, shape",
    [
        (nn.BatchNorm1d(4), nn.InstanceNorm1d, (3, 4, 5)),
        (nn.BatchNorm2d(4), nn.InstanceNorm2d, (3, 4, 2, 5)),
        (nn.BatchNorm3d(4), nn.InstanceNorm3d, (3, 4, 2, 2, 3)),
        (nn.SyncBatchNorm(4), nn.GroupNorm, (3, 4, 2, 5)),
    ],
)
def test_instancenorm_replacement_normalises_each_channel_of_each_sample(bn, target, shape):
    from opacus.validators import ModuleValidator as OpacusValidator

    fixed = ModuleValidator.fix(nn.Sequential(bn.to(F64)), replace_bn_with_in=True)[0]
    assert type(fixed) is target
    if target is not nn.GroupNorm:  # Opacus refuses SyncBatchNorm here; else the same architecture
        theirs = OpacusValidator.fix(nn.Sequential(bn), replace_bn_with_in=True)[0]
        assert type(theirs) is target and set(theirs.state_dict()) == set(fixed.state_dict())
    x = torch.randn(*shape, dtype=F64)
    expected = group_norm_oracle(x, 4, torch.ones(4, dtype=F64), torch.zeros(4, dtype=F64), 1e-5)
    torch.testing.assert_close(fixed(x), expected)


def test_instancenorm_running_stats_removed_outputs_unchanged_in_training():
    original = nn.InstanceNorm1d(3, affine=True, track_running_stats=True).to(F64)
    with torch.no_grad():
        original.weight.uniform_(0.5, 2.0)
    fixed = ModuleValidator.fix(nn.Sequential(original))[0]
    assert isinstance(fixed, nn.InstanceNorm1d) and not fixed.track_running_stats
    assert fixed.running_mean is None
    x = torch.randn(2, 3, 6, dtype=F64)
    torch.testing.assert_close(fixed(x), original(x))


def test_training_mode_is_kept():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).eval()
    assert not ModuleValidator.fix(model)[1].training


# ----------------------------------------------------------------- DP layers


def recurrent_cases():
    return [
        nn.LSTM(3, 5),
        nn.LSTM(3, 5, num_layers=2, bidirectional=True, batch_first=True),
        nn.LSTM(3, 5, proj_size=2),
        nn.GRU(3, 4, num_layers=2),
        nn.GRU(3, 4, bias=False, batch_first=True, bidirectional=True),
        nn.RNN(3, 4, nonlinearity="relu"),
        nn.RNN(3, 4, num_layers=2, bidirectional=True),
    ]


@pytest.mark.parametrize("layer", recurrent_cases(), ids=lambda m: repr(m))
def test_recurrent_replacement_gives_same_outputs(layer):
    from opacus_dp import layers

    layer = layer.to(F64)
    fixed = ModuleValidator.fix(nn.Sequential(layer))[0]
    assert type(fixed).__name__ == "DP" + type(layer).__name__ and isinstance(fixed, layers.DPRNNBase)
    x = torch.randn(2, 4, 3, dtype=F64) if layer.batch_first else torch.randn(4, 2, 3, dtype=F64)
    expected, got = layer(x), fixed(x)
    torch.testing.assert_close(got[0], expected[0])
    if isinstance(layer, nn.LSTM):
        torch.testing.assert_close(got[1][0], expected[1][0])
        torch.testing.assert_close(got[1][1], expected[1][1])
    else:
        torch.testing.assert_close(got[1], expected[1])
    assert ModuleValidator.is_valid(nn.Sequential(fixed))


def test_recurrent_replacement_keeps_frozen_parameters():
    lstm = nn.LSTM(3, 4, num_layers=2)
    lstm.weight_hh_l1.requires_grad_(False)
    fixed = ModuleValidator.fix(nn.Sequential(lstm))[0]
    flags = {name: p.requires_grad for name, p in fixed.state_dict(keep_vars=True).items()}
    assert flags["weight_hh_l1"] is False
    assert flags["weight_ih_l1"] is True and flags["weight_hh_l0"] is True


@pytest.mark.parametrize(
    "settings",
    [
        dict(embed_dim=6, num_heads=2),
        dict(embed_dim=6, num_heads=3, batch_first=True, add_bias_kv=True, add_zero_attn=True),
        dict(embed_dim=6, num_heads=2, kdim=4, vdim=5, bias=False),
    ],
)
def test_attention_replacement_gives_same_outputs(settings):
    attention = nn.MultiheadAttention(**settings).to(F64)
    fixed = ModuleValidator.fix(nn.Sequential(attention))[0]
    assert type(fixed).__name__ == "DPMultiheadAttention"
    length, source, batch = 3, 4, 2
    kdim, vdim = settings.get("kdim", 6), settings.get("vdim", 6)
    first = (batch, length) if settings.get("batch_first") else (length, batch)
    key_shape = (batch, source) if settings.get("batch_first") else (source, batch)
    query = torch.randn(*first, 6, dtype=F64)
    key, value = torch.randn(*key_shape, kdim, dtype=F64), torch.randn(*key_shape, vdim, dtype=F64)
    expected, got = attention(query, key, value), fixed(query, key, value)
    torch.testing.assert_close(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1])
    assert ModuleValidator.is_valid(nn.Sequential(fixed))


def test_attention_with_frozen_fused_projection_is_refused_clearly():
    attention = nn.MultiheadAttention(4, 2)
    attention.in_proj_weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"model\.0 \(MultiheadAttention\).*in_proj_weight"):
        ModuleValidator.fix(nn.Sequential(attention))
    attention.out_proj.weight.requires_grad_(False)
    attention.in_proj_weight.requires_grad_(True)
    fixed = ModuleValidator.fix(nn.Sequential(attention))[0]
    assert not fixed.out_proj.weight.requires_grad and fixed.out_proj.bias.requires_grad


@pytest.mark.parametrize("stacked", [False, True])
def test_fixed_batch_first_transformer_runs_in_eval_mode_with_the_same_outputs(stacked):
    """torch's Transformer layers pick a fused inference path from their attention's packed
    in-projection; after the fix that path is off and the DP attention computes the same
    outputs (eval mode, with and without grad, with a key padding mask)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True) if stacked else layer
    model.eval()
    fixed = ModuleValidator.fix(model)
    assert ModuleValidator.validate(fixed.train()) == []  # (in eval mode: "needs training mode")
    fixed.eval()
    x = torch.randn(3, 5, 16)
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[0, 3:] = True
    kwargs = {"src_key_padding_mask": mask}
    torch.testing.assert_close(fixed(x), model(x), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        got, expected = fixed(x, **kwargs), model(x, **kwargs)
    torch.testing.assert_close(got[~mask], expected[~mask], rtol=1e-5, atol=1e-5)


def test_fix_keeps_float64_weights_exact():
    """The DP replacements are built in the source's dtype: a float64 LSTM / attention with
    float64-only weights gives the same outputs after the fix to float64 rounding (their
    products run in another order than torch's fused kernels, so bit equality depends on the
    BLAS), far below the ~1e-7 that a round trip of the weights through float32 costs."""
    torch.manual_seed(0)
    lstm = nn.LSTM(4, 6, num_layers=2, bidirectional=True).double()
    attention = nn.MultiheadAttention(8, 2, batch_first=True).double()
    for p in [*lstm.parameters(), *attention.parameters()]:
        nn.init.normal_(p, std=0.5)  # float64 values no float32 can hold
    x, q = torch.randn(5, 3, 4, dtype=torch.float64), torch.randn(2, 3, 8, dtype=torch.float64)
    float64_rounding = dict(rtol=1e-12, atol=1e-12)
    for module, inputs in ((lstm, (x,)), (attention, (q, q, q))):
        fixed = ModuleValidator.fix(module)
        assert all(p.dtype == torch.float64 for p in fixed.parameters())
        torch.testing.assert_close(fixed(*inputs)[0], module(*inputs)[0], **float64_rounding)
        through_float32 = copy.deepcopy(fixed).float().double()
        with pytest.raises(AssertionError):  # the tolerance sees a float32 round trip
            torch.testing.assert_close(through_float32(*inputs)[0], module(*inputs)[0],
                                       **float64_rounding)
