"""Per-sample gradients of the DP layers through GradSampleModule.

Oracle: torch's own nn.RNN/GRU/LSTM/MultiheadAttention (same weights) run on one sample
at a time, differentiated with autograd -- an implementation independent of ours.
"""

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.utils.rnn import pack_padded_sequence

from opacus_dp.grad_sample import GradSampleModule
from opacus_dp.grad_sample.registry import GRAD_SAMPLERS, NORM_SAMPLERS
from opacus_dp.layers import BatchFirstSequenceBias, DPGRU, DPLSTM, RNNLinear, SequenceBias
from tests.layers.common import INPUT_SIZE, RNN_KINDS, output_loss, rnn_hx, rnn_pair
from tests.layers.test_dp_multihead_attention import EMBED, HEADS, mha_masks, mha_pair


def per_sample_torch_grads(reference, sample_calls):
    """``{name: (B, *shape)}``: autograd gradient of each sample's own loss."""
    rows = {name: [] for name, _ in reference.named_parameters()}
    for args, kwargs in sample_calls:
        reference.zero_grad()
        output_loss(reference(*args, **kwargs)).backward()
        for name, param in reference.named_parameters():
            rows[name].append(param.grad.clone())
    return {name: torch.stack(r) for name, r in rows.items()}


def run_gsm(layer, args, kwargs, batch, loss_reduction, batch_first):
    gsm = GradSampleModule(layer, batch_first=batch_first, loss_reduction=loss_reduction)
    loss = output_loss(gsm(*args, **kwargs))
    (loss / batch if loss_reduction == "mean" else loss).backward()
    return gsm


def rnn_sample_calls(x_padded, lengths, hx, batch_first):
    """Sample i alone: its valid steps as a batch of one, with its slice of hx."""
    calls = []
    for i in range(x_padded.shape[0]):
        steps = x_padded.shape[1] if lengths is None else int(lengths[i])
        xi = x_padded[i : i + 1, :steps]
        xi = xi if batch_first else xi.transpose(0, 1)
        hi = None if hx is None else tuple(h[:, i : i + 1] for h in hx)
        if hi is not None and len(hi) == 1:
            hi = hi[0]
        calls.append(((xi,) if hi is None else (xi, hi), {}))
    return calls


@settings(max_examples=20, deadline=None)
@given(
    kind=st.sampled_from(sorted(RNN_KINDS)),
    num_layers=st.integers(1, 2),
    bidirectional=st.booleans(),
    batch_first=st.booleans(),
    gsm_batch_first=st.booleans(),
    packing=st.sampled_from([None, "sorted", "unsorted"]),
    with_hx=st.booleans(),
    loss_reduction=st.sampled_from(["mean", "sum"]),
    batch=st.integers(1, 4),
    steps=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_rnn_per_sample_gradients_equal_torch_per_sample_loop(
    kind, num_layers, bidirectional, batch_first, gsm_batch_first, packing, with_hx,
    loss_reduction, batch, steps, seed,
):
    gen = torch.Generator().manual_seed(seed)
    reference, layer = rnn_pair(kind, num_layers=num_layers, bidirectional=bidirectional,
                                batch_first=batch_first)
    x = torch.randn(batch, steps, INPUT_SIZE, dtype=torch.float64, generator=gen)
    lengths = None
    if packing is not None:
        lengths = torch.randint(1, steps + 1, (batch,), generator=gen)
        if packing == "sorted":
            lengths = lengths.sort(descending=True).values
        padded = x if batch_first else x.transpose(0, 1)
        data = pack_padded_sequence(padded, lengths, batch_first=batch_first,
                                    enforce_sorted=packing == "sorted")
    else:
        data = x if batch_first else x.transpose(0, 1)
    hx = rnn_hx(reference, batch, False, gen) if with_hx else None
    args = (data,) if hx is None else (data, hx)
    gsm = run_gsm(layer, args, {}, batch, loss_reduction, gsm_batch_first)

    hx_parts = None if hx is None else (hx if isinstance(hx, tuple) else (hx,))
    calls = rnn_sample_calls(x, lengths, hx_parts, batch_first)
    expected = per_sample_torch_grads(reference, calls)
    for name, grads in expected.items():
        torch.testing.assert_close(getattr(layer, name).grad_sample, grads, atol=1e-10, rtol=0)
    gsm.close()


def _mha_sample_calls(q, k, v, masks, batch_first):
    batch_dim = 0 if batch_first else 1
    calls = []
    for i in range(q.shape[batch_dim]):
        args = tuple(t.narrow(batch_dim, i, 1) for t in (q, k, v))
        kwargs = dict(masks)
        if "key_padding_mask" in masks:
            kwargs["key_padding_mask"] = masks["key_padding_mask"][i : i + 1]
        if "attn_mask" in masks and masks["attn_mask"].dim() == 3:
            kwargs["attn_mask"] = masks["attn_mask"][i * HEADS : (i + 1) * HEADS]
        calls.append((args, kwargs))
    return calls


def _torch_named_grad_samples(layer):
    q, k, v = layer.qlinear, layer.klinear, layer.vlinear
    named = {"out_proj.weight": layer.out_proj.weight.grad_sample,
             "out_proj.bias": layer.out_proj.bias.grad_sample,
             "in_proj_bias": torch.cat([q.bias.grad_sample, k.bias.grad_sample,
                                        v.bias.grad_sample], dim=1)}
    if layer._qkv_same_embed_dim:
        named["in_proj_weight"] = torch.cat(
            [q.weight.grad_sample, k.weight.grad_sample, v.weight.grad_sample], dim=1)
    else:
        named.update(q_proj_weight=q.weight.grad_sample, k_proj_weight=k.weight.grad_sample,
                     v_proj_weight=v.weight.grad_sample)
    if layer.add_bias_kv:
        named.update(bias_k=layer.bias_k.grad_sample, bias_v=layer.bias_v.grad_sample)
    return named


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")
@settings(max_examples=15, deadline=None)
@given(
    add_bias_kv=st.booleans(),
    add_zero_attn=st.booleans(),
    kvdim=st.sampled_from([(None, None), (3, 5)]),
    batch_first=st.booleans(),
    gsm_batch_first=st.booleans(),
    mask_kind=st.sampled_from(["none", "attn_bool+padding_bool", "attn_float3d+padding_bool",
                               "padding_float"]),
    loss_reduction=st.sampled_from(["mean", "sum"]),
    sizes=st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 3)),
    seed=st.integers(0, 2**16),
)
def test_mha_per_sample_gradients_equal_torch_per_sample_loop(
    add_bias_kv, add_zero_attn, kvdim, batch_first, gsm_batch_first, mask_kind, loss_reduction,
    sizes, seed,
):
    gen = torch.Generator().manual_seed(seed)
    kdim, vdim = kvdim
    reference, layer = mha_pair(add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn, kdim=kdim,
                                vdim=vdim, batch_first=batch_first)
    batch, tgt_len, src_len = sizes
    shape = (lambda n, d: (batch, n, d)) if batch_first else (lambda n, d: (n, batch, d))
    q = torch.randn(shape(tgt_len, EMBED), dtype=torch.float64, generator=gen)
    k = torch.randn(shape(src_len, kdim or EMBED), dtype=torch.float64, generator=gen)
    v = torch.randn(shape(src_len, vdim or EMBED), dtype=torch.float64, generator=gen)
    masks = mha_masks(mask_kind, batch, tgt_len, src_len, False, gen)
    gsm = run_gsm(layer, (q, k, v), masks, batch, loss_reduction, gsm_batch_first)
    expected = per_sample_torch_grads(reference, _mha_sample_calls(q, k, v, masks, batch_first))
    for name, grads in _torch_named_grad_samples(layer).items():
        torch.testing.assert_close(grads, expected[name], atol=1e-10, rtol=0)
    gsm.close()


class _Tagger(nn.Module):
    """Embedding -> DPGRU -> Linear, all sequence-first ``(T, B, ...)``; also returns h_n."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(10, INPUT_SIZE)
        self.gru = DPGRU(INPUT_SIZE, 4, num_layers=2, bidirectional=True)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens):
        output, h_n = self.gru(self.embedding(tokens))
        return self.head(output), h_n


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_model_with_dp_gru_matches_its_own_batch_of_one_loop(loss_reduction):
    model = _Tagger().double()
    tokens = torch.randint(0, 10, (5, 4))  # (T, B)
    gsm = run_gsm(model, (tokens,), {}, 4, loss_reduction, batch_first=False)
    actual = {name: param.grad_sample.clone() for name, param in model.named_parameters()}
    gsm.close()
    rows = {name: [] for name in actual}
    for i in range(4):
        model.zero_grad()
        output_loss(model(tokens[:, i : i + 1])).backward()
        for name, param in model.named_parameters():
            rows[name].append(param.grad.clone())
    for name, grads in actual.items():
        torch.testing.assert_close(grads, torch.stack(rows[name]), atol=1e-10, rtol=0)


def test_dedicated_samplers_equal_the_generic_fallback():
    _, layer = mha_pair(add_bias_kv=True, add_zero_attn=True)
    q, k, v = (torch.randn(3, 2, EMBED, dtype=torch.float64) for _ in range(3))
    results = []
    for force in (False, True):
        gsm = GradSampleModule(layer, batch_first=False, force_functorch=force)
        output_loss(gsm(q, k, v)).backward()
        results.append({n: p.grad_sample.clone() for n, p in layer.named_parameters()})
        gsm.close()
        layer.zero_grad()
    for name in results[0]:
        torch.testing.assert_close(results[0][name], results[1][name], atol=1e-12, rtol=0)


def test_sequence_bias_samplers_against_autograd():
    layer = BatchFirstSequenceBias(5).double()
    x = torch.randn(4, 3, 5, dtype=torch.float64)
    backprops = torch.randn(4, 4, 5, dtype=torch.float64)
    per_sample = GRAD_SAMPLERS[BatchFirstSequenceBias](layer, [x], backprops)[layer.bias]
    for i in range(4):
        out = layer(x[i : i + 1])
        assert torch.equal(out[0, -1], layer.bias[0, 0]) and torch.equal(out[:, :3], x[i : i + 1])
        (grad,) = torch.autograd.grad((out * backprops[i : i + 1]).sum(), layer.bias)
        torch.testing.assert_close(per_sample[i], grad, atol=1e-14, rtol=0)
    norms = NORM_SAMPLERS[BatchFirstSequenceBias](layer, [x], backprops)[layer.bias]
    torch.testing.assert_close(norms, per_sample.flatten(1).pow(2).sum(1))


@pytest.mark.parametrize("batch_first", [False, True])
def test_public_sequence_bias_follows_its_layout_and_the_wrapper(batch_first):
    layer = SequenceBias(5, batch_first=batch_first).double()
    x = torch.randn(4, 3, 5, dtype=torch.float64)  # (B, S, E) or (S, B, E)
    batch_dim, seq_dim = (0, 1) if batch_first else (1, 0)
    out = layer(x)
    assert out.shape[seq_dim] == x.shape[seq_dim] + 1
    assert torch.equal(out.select(seq_dim, -1), layer.bias[0].expand(x.shape[batch_dim], 5))
    gsm = GradSampleModule(layer, batch_first=batch_first, loss_reduction="sum")
    output_loss(gsm(x)).backward()
    actual = layer.bias.grad_sample.clone()
    gsm.close()
    for i in range(x.shape[batch_dim]):
        layer.zero_grad()
        output_loss(layer(x.narrow(batch_dim, i, 1))).backward()
        torch.testing.assert_close(actual[i], layer.bias.grad, atol=1e-14, rtol=0)


def test_frozen_sequence_bias_yields_nothing_and_rnn_linear_uses_linear_sampler():
    layer = BatchFirstSequenceBias(5).requires_grad_(False)
    sampler = GRAD_SAMPLERS[BatchFirstSequenceBias]
    assert sampler(layer, [torch.zeros(1, 2, 5)], torch.zeros(1, 3, 5)) == {}
    assert GRAD_SAMPLERS[RNNLinear] is GRAD_SAMPLERS[nn.Linear]
    assert sampler is GRAD_SAMPLERS[SequenceBias]


def test_empty_batch_gives_empty_grad_samples():
    layer = DPLSTM(INPUT_SIZE, 4, batch_first=True).double()
    gsm = GradSampleModule(layer, batch_first=True)
    out, (h, c) = gsm(torch.randn(0, 3, INPUT_SIZE, dtype=torch.float64))
    (out.sum() + h.sum() + c.sum()).backward()
    for _, param in layer.named_parameters():
        assert param.grad_sample.shape == (0, *param.shape)
    gsm.close()


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("kind", ["lstm", "gru", "mha"])
def test_per_sample_gradients_agree_with_opacus(kind):
    """Cross-check with Opacus 1.6's DP layers and GradSampleModule (same torch state dict)."""
    opacus = pytest.importorskip("opacus")
    from opacus.layers import DPGRU as OpacusGRU
    from opacus.layers import DPLSTM as OpacusLSTM
    from opacus.layers import DPMultiheadAttention as OpacusMHA

    batch_first = kind != "mha"  # Opacus' attention follows the wrapper's layout
    if kind == "mha":
        reference, ours = mha_pair(add_bias_kv=True)
        theirs = OpacusMHA(EMBED, HEADS, add_bias_kv=True).double()
        x = torch.randn(4, 3, EMBED, dtype=torch.float64)
        args = (x, x, x)
    else:
        reference, ours = rnn_pair(kind, num_layers=2, bidirectional=True, batch_first=True)
        their_cls = OpacusLSTM if kind == "lstm" else OpacusGRU
        theirs = their_cls(INPUT_SIZE, 4, num_layers=2, bidirectional=True, batch_first=True)
        theirs = theirs.double()
        args = (torch.randn(3, 5, INPUT_SIZE, dtype=torch.float64),)
    theirs.load_state_dict(reference.state_dict())
    their_gsm = opacus.GradSampleModule(theirs, batch_first=batch_first, loss_reduction="sum")
    output_loss(their_gsm(*args)).backward()
    gsm = run_gsm(ours, args, {}, 3, "sum", batch_first=batch_first)
    mine = dict(ours.named_parameters())
    for name, param in theirs.named_parameters():
        target = mine[name] if kind == "mha" else getattr(ours, name)
        expected = param.grad_sample.reshape(target.grad_sample.shape)
        torch.testing.assert_close(target.grad_sample, expected, atol=1e-10, rtol=0)
    gsm.close()
