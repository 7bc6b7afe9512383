"""DPMultiheadAttention against torch's nn.MultiheadAttention with the same weights (float64)."""

import copy

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from opacus_dp.layers import DPMultiheadAttention
from tests.layers.common import assert_outputs_close, output_loss

EMBED, HEADS = 8, 2


def mha_pair(**options):
    reference = nn.MultiheadAttention(EMBED, HEADS, **options).double()
    layer = DPMultiheadAttention(EMBED, HEADS, **options).double()
    layer.load_state_dict(reference.state_dict())
    return reference, layer


def mha_inputs(batch, tgt_len, src_len, kdim, vdim, batch_first, unbatched, gen):
    def make(length, dim):
        x = torch.randn(batch, length, dim, dtype=torch.float64, generator=gen)
        if unbatched:
            return x[0]
        return x if batch_first else x.transpose(0, 1)

    return make(tgt_len, EMBED), make(src_len, kdim or EMBED), make(src_len, vdim or EMBED)


def mha_masks(kind, batch, tgt_len, src_len, unbatched, gen):
    """Masks that never hide key 0, so no row of scores is fully masked."""
    masks = {}
    leading = HEADS if unbatched else batch * HEADS
    if "attn_bool" in kind:
        hidden = torch.rand(tgt_len, src_len, generator=gen) < 0.4
        masks["attn_mask"] = hidden.index_fill(1, torch.tensor([0]), False)
    if "attn_float3d" in kind:
        masks["attn_mask"] = torch.randn(leading, tgt_len, src_len, dtype=torch.float64,
                                         generator=gen)
    if "padding" in kind:
        shape = (src_len,) if unbatched else (batch, src_len)
        hidden = (torch.rand(*shape, generator=gen) < 0.4).index_fill(-1, torch.tensor([0]), False)
        masks["key_padding_mask"] = hidden if "padding_bool" in kind else hidden.double() * -2.5
    return masks


MASK_KINDS = ["none", "attn_bool", "attn_float3d", "padding_bool", "padding_float",
              "attn_bool+padding_bool", "attn_float3d+padding_bool"]


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")
@settings(max_examples=25, deadline=None)
@given(
    bias=st.booleans(),
    add_bias_kv=st.booleans(),
    add_zero_attn=st.booleans(),
    kvdim=st.sampled_from([(None, None), (5, 5), (3, 6)]),
    batch_first=st.booleans(),
    unbatched=st.booleans(),
    need_weights=st.booleans(),
    average=st.booleans(),
    mask_kind=st.sampled_from(MASK_KINDS),
    sizes=st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 4)),
    seed=st.integers(0, 2**16),
)
def test_forward_and_gradients_match_torch(bias, add_bias_kv, add_zero_attn, kvdim,
                                           batch_first, unbatched, need_weights, average,
                                           mask_kind, sizes, seed):
    gen = torch.Generator().manual_seed(seed)
    kdim, vdim = kvdim
    reference, layer = mha_pair(bias=bias, add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn,
                                kdim=kdim, vdim=vdim, batch_first=batch_first, dropout=0.3)
    reference.eval(), layer.eval()
    batch, tgt_len, src_len = sizes
    q, k, v = mha_inputs(batch, tgt_len, src_len, kdim, vdim, batch_first, unbatched, gen)
    masks = mha_masks(mask_kind, batch, tgt_len, src_len, unbatched, gen)
    options = dict(need_weights=need_weights, average_attn_weights=average, **masks)
    expected, actual = reference(q, k, v, **options), layer(q, k, v, **options)
    assert_outputs_close(actual, expected)

    output_loss(expected).backward()
    output_loss(actual).backward()
    for name, grad in _torch_layout_grads(layer).items():
        torch.testing.assert_close(grad, reference.get_parameter(name).grad, atol=1e-11, rtol=0)


def _torch_layout_grads(layer):
    """Our gradients arranged under torch's parameter names (q/k/v stacked by hand)."""
    q, k, v = layer.qlinear, layer.klinear, layer.vlinear
    grads = {"out_proj.weight": layer.out_proj.weight.grad}
    if layer._qkv_same_embed_dim:
        grads["in_proj_weight"] = torch.cat([q.weight.grad, k.weight.grad, v.weight.grad])
    else:
        grads.update(q_proj_weight=q.weight.grad, k_proj_weight=k.weight.grad,
                     v_proj_weight=v.weight.grad)
    if q.bias is not None:
        grads["in_proj_bias"] = torch.cat([q.bias.grad, k.bias.grad, v.bias.grad])
        grads["out_proj.bias"] = layer.out_proj.bias.grad
    if layer.add_bias_kv:
        grads.update(bias_k=layer.bias_k.grad, bias_v=layer.bias_v.grad)
    return grads


@pytest.mark.parametrize("need_weights", [False, True])
def test_is_causal_hint_uses_the_causal_mask_like_torch(need_weights):
    reference, layer = mha_pair(batch_first=True)
    x = torch.randn(2, 4, EMBED, dtype=torch.float64)
    causal = nn.Transformer.generate_square_subsequent_mask(4, dtype=torch.float64)
    options = dict(attn_mask=causal, is_causal=True, need_weights=need_weights)
    assert_outputs_close(layer(x, x, x, **options), reference(x, x, x, **options))
    with pytest.raises(ValueError, match="attn_mask"):
        layer(x, x, x, is_causal=True)


def test_training_dropout_of_one_drops_all_attention_like_torch():
    reference, layer = mha_pair(dropout=1.0)
    x = torch.randn(3, 2, EMBED, dtype=torch.float64)
    assert_outputs_close(layer(x, x, x), reference(x, x, x))
    layer.eval()
    assert not torch.allclose(layer(x, x, x)[0], reference(x, x, x)[0])


CONFIGS = [dict(), dict(bias=False), dict(add_bias_kv=True), dict(kdim=3, vdim=5),
           dict(kdim=3, vdim=5, add_bias_kv=True, bias=False)]


@pytest.mark.parametrize("options", CONFIGS)
def test_state_dict_keys_order_shapes_and_values_equal_torch(options):
    reference, layer = mha_pair(**options)
    theirs, ours = reference.state_dict(), layer.state_dict()
    assert list(ours) == list(theirs)
    for key in theirs:
        assert torch.equal(ours[key], theirs[key]), key


@pytest.mark.parametrize("options", CONFIGS)
def test_torch_loads_our_state_dict(options):
    layer = DPMultiheadAttention(EMBED, HEADS, **options).double()
    reference = nn.MultiheadAttention(EMBED, HEADS, **options).double()
    reference.load_state_dict(layer.state_dict())
    q = torch.randn(3, 2, EMBED, dtype=torch.float64)
    k = torch.randn(4, 2, options.get("kdim", EMBED), dtype=torch.float64)
    v = torch.randn(4, 2, options.get("vdim", EMBED), dtype=torch.float64)
    assert_outputs_close(layer(q, k, v), reference(q, k, v))


def test_internal_names_load_and_bias_properties_alias_parameters():
    _, layer = mha_pair(add_bias_kv=True)
    fresh = DPMultiheadAttention(EMBED, HEADS, add_bias_kv=True).double()
    fresh.load_state_dict({n: p.detach().clone() for n, p in layer.named_parameters()})
    assert torch.equal(fresh.qlinear.weight, layer.qlinear.weight)
    assert fresh.bias_k is fresh.seq_bias_k.bias and fresh.bias_v is fresh.seq_bias_v.bias
    assert DPMultiheadAttention(EMBED, HEADS).bias_k is None
    clone = copy.deepcopy(layer)
    assert list(clone.state_dict()) == list(layer.state_dict())
    with pytest.raises(AttributeError, match="qlinear"):
        layer.in_proj_weight


def test_missing_keys_are_reported_with_torch_names():
    reference = nn.MultiheadAttention(EMBED, HEADS)
    with pytest.raises(RuntimeError, match="bias_k") as info:
        DPMultiheadAttention(EMBED, HEADS, add_bias_kv=True).load_state_dict(reference.state_dict())
    assert "seq_bias" not in str(info.value)


def test_initialisation_follows_torch_scheme():
    torch.manual_seed(1)
    layer = DPMultiheadAttention(64, 4, add_bias_kv=True)
    bound = (6.0 / (64 + 3 * 64)) ** 0.5
    for linear in (layer.qlinear, layer.klinear, layer.vlinear):
        assert linear.weight.abs().max() <= bound
        assert linear.weight.abs().max() > 0.9 * bound
        assert torch.count_nonzero(linear.bias) == 0
    assert torch.count_nonzero(layer.out_proj.bias) == 0


@pytest.mark.parametrize(
    "build, call, message",
    [
        (lambda: DPMultiheadAttention(10, 3), None, "divisible"),
        (lambda: DPMultiheadAttention(8, 2, dropout=-0.1), None, "dropout"),
        (lambda: DPMultiheadAttention(8, 2, kdim=0), None, "kdim"),
        (lambda: DPMultiheadAttention(8, 2),
         lambda m: m(*[torch.randn(3, 2, 8)] * 2, torch.randn(3, 2, 7)), "value has 7"),
        (lambda: DPMultiheadAttention(8, 2),
         lambda m: m(torch.randn(3, 2, 8), torch.randn(3, 8), torch.randn(3, 8)), "2-D"),
        (lambda: DPMultiheadAttention(8, 2),
         lambda m: m(*[torch.randn(3, 2, 8)] * 3, attn_mask=torch.zeros(3, 4)), "attn_mask"),
        (lambda: DPMultiheadAttention(8, 2),
         lambda m: m(*[torch.randn(3, 2, 8)] * 3, key_padding_mask=torch.zeros(3, 2)),
         "key_padding_mask"),
    ],
)
def test_bad_arguments_raise_clear_errors(build, call, message):
    with pytest.raises(ValueError, match=message):
        module = build()
        call(module)


def test_integer_masks_are_refused():
    layer = DPMultiheadAttention(8, 2)
    x = torch.randn(3, 2, 8)
    with pytest.raises(TypeError, match="attn_mask"):
        layer(x, x, x, attn_mask=torch.zeros(3, 3, dtype=torch.long))
