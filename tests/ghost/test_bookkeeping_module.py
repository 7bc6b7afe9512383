"""Whole models in the norms-only modes: norms and clipped sums against the oracle.

Every test runs a model wrapped in ``BookkeepingGradSampleModule`` (rule "mixed" = mode
``bk``, "ghost" = mode ``ghost``), asks for the per-sample norms and for ``Σ_i f_i g_i`` with
random factors, and compares both with the batch-size-1 autograd oracle (float64).
"""

import pytest
import torch
import torch.nn as nn

from opacus_dp.grad_sample import BookkeepingGradSampleModule
from opacus_dp.layers import DPLSTM, DPMultiheadAttention
from tests.ghost.helpers import assert_norms_and_sums, model_oracle, run_backward

RULES = ["mixed", "ghost"]


class Scale(nn.Module):
    """A layer without a registered sampler (generic torch.func fallback)."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n))

    def forward(self, x):
        return torch.tanh(x * self.weight)


class SequenceModel(nn.Module):
    """Embedding, convolution over positions, norms, a fallback layer and a pooled head."""

    def __init__(self, vocab=11, d=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        self.conv = nn.Conv1d(d, d, 3, padding=1, groups=2)
        self.gn = nn.GroupNorm(2, d)
        self.ln = nn.LayerNorm(d)
        self.rms = nn.RMSNorm(d)
        self.fc = nn.Linear(d, 2 * d)
        self.scale = Scale(2 * d)
        self.head = nn.Linear(2 * d, 3)

    def forward(self, tokens):
        h = self.gn(self.conv(self.emb(tokens).transpose(1, 2))).transpose(1, 2)
        h = self.scale(self.fc(self.rms(self.ln(h))))
        return self.head(h.mean(dim=1))


def build(cls, *args):
    torch.manual_seed(0)
    return cls(*args).double()


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_sequence_model_norms_and_sums(rule, loss_reduction):
    model = build(SequenceModel)
    tokens = torch.randint(0, 11, (5, 7))
    oracle = model_oracle(model, (tokens,))
    wrapper = BookkeepingGradSampleModule(model, loss_reduction=loss_reduction, layer_rule=rule)
    run_backward(wrapper, (tokens,), loss_reduction, 5)
    modes = wrapper.layer_modes()
    assert modes["scale (Scale)"] == "materialised" and modes["ln (LayerNorm)"] == "materialised"
    assert modes["emb (Embedding)"] == "ghost"
    assert_norms_and_sums(wrapper, oracle)


def test_mixed_rule_materialises_wide_images_and_ghosts_long_features():
    """Bu et al. 2022: ghost iff 2T² < d·p (T positions, d·p weight size per group)."""
    model = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.Flatten(), nn.Linear(2 * 64, 4)).double()
    x = torch.randn(3, 1, 8, 8, dtype=torch.float64)
    oracle = model_oracle(model, (x,))
    for rule, conv_mode in (("mixed", "materialised"), ("ghost", "ghost")):
        wrapper = BookkeepingGradSampleModule(model, layer_rule=rule)
        run_backward(wrapper, (x,), "mean", 3)
        assert wrapper.layer_modes() == {"0 (Conv2d)": conv_mode, "2 (Linear)": "ghost"}
        assert_norms_and_sums(wrapper, oracle)
        wrapper.close()


def test_bk_materialises_linears_whose_per_sample_gradient_is_no_larger_than_what_ghost_keeps():
    """``d·p ≤ T (d + p)``: the per-sample gradient takes no more memory than the kept
    ``A_i``, ``G_i`` and its clipped sum needs no product; a norms-only pass (the ``ghost``
    mode, which keeps nothing) still takes the ghost norm."""
    model = build(lambda: nn.Sequential(nn.Linear(8, 24), nn.Tanh(), nn.Linear(24, 24)))
    x = torch.randn(3, 8, 8, dtype=torch.float64)  # T = 8: 8·24 ≤ 8·32, 24·24 > 8·48
    oracle = model_oracle(model, (x,))
    wrapper = BookkeepingGradSampleModule(model)
    run_backward(wrapper, (x,), "mean", 3)
    assert wrapper.layer_modes() == {"0 (Linear)": "materialised", "2 (Linear)": "ghost"}
    assert_norms_and_sums(wrapper, oracle)
    wrapper.zero_grad_sample()
    with wrapper.norms_pass():
        run_backward(wrapper, (x,), "mean", 3)
    assert wrapper.layer_modes() == {"0 (Linear)": "ghost", "2 (Linear)": "ghost"}
    params = [p for _, p in wrapper.trainable_parameters()]
    for (name, _), norm in zip(wrapper.trainable_parameters(), wrapper.per_sample_norms(params)):
        torch.testing.assert_close(norm, oracle[name].flatten(1).norm(dim=1), rtol=1e-9, atol=1e-10)


class TwiceAndTied(nn.Module):
    """A Linear called twice per forward, and an output layer tied to the embedding."""

    def __init__(self, vocab=9, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.out = nn.Linear(d, vocab, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, tokens):
        h = self.emb(tokens)
        h = self.mix(torch.tanh(self.mix(h)))
        return self.out(h)


@pytest.mark.parametrize("rule", RULES)
def test_repeated_calls_and_tied_weights(rule):
    model = build(TwiceAndTied)
    tokens = torch.randint(0, 9, (4, 2))
    oracle = model_oracle(model, (tokens,))
    wrapper = BookkeepingGradSampleModule(model, layer_rule=rule)
    run_backward(wrapper, (tokens,), "mean", 4)
    modes = wrapper.layer_modes()
    # two calls of 2 positions each: T = 4, 2·T² = 32 < d·p = 256, and d·p > T (d + p) = 128
    assert modes["mix (Linear)"] == "ghost", "calls of one Linear merge into one ghost call"
    assert modes["emb (Embedding)"] == modes["out (Linear)"] == "materialised", "tied weights"
    assert_norms_and_sums(wrapper, oracle)


@pytest.mark.parametrize("rule", RULES)
def test_dp_lstm_and_dp_multihead_attention(rule):
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = DPLSTM(4, 8, batch_first=True)  # hh: 8 -> 32 over T = 5 steps, ghost
            self.attn = DPMultiheadAttention(8, 2, batch_first=True, add_bias_kv=True)
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            h, _ = self.lstm(x)
            h, _ = self.attn(h, h, h, need_weights=False)
            return self.head(h)

    model = build(Block)
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    oracle = model_oracle(model, (x,))
    wrapper = BookkeepingGradSampleModule(model, layer_rule=rule)
    run_backward(wrapper, (x,), "mean", 3)
    assert wrapper.layer_modes()["lstm.l0.hh (BatchFirstLinear)"] == "ghost"
    assert_norms_and_sums(wrapper, oracle)


def test_sequence_first_layout():
    model = build(lambda: nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.LayerNorm(4), nn.Linear(4, 2)))
    x = torch.randn(6, 3, 3, dtype=torch.float64)  # (T, B, features)
    oracle = model_oracle(model, (x,), batch_dim=1)
    wrapper = BookkeepingGradSampleModule(model, batch_first=False)
    run_backward(wrapper, (x,), "mean", 3)
    assert_norms_and_sums(wrapper, oracle)


def test_two_backward_passes_concatenate_norms_and_add_sums():
    model = build(SequenceModel)
    a, b = torch.randint(0, 11, (3, 4)), torch.randint(0, 11, (2, 4))
    oracle_a, oracle_b = model_oracle(model, (a,)), model_oracle(model, (b,))
    oracle = {n: torch.cat([oracle_a[n], oracle_b[n]]) for n in oracle_a}
    wrapper = BookkeepingGradSampleModule(model, loss_reduction="sum")
    run_backward(wrapper, (a,), "sum", 3)
    run_backward(wrapper, (b,), "sum", 2)
    assert_norms_and_sums(wrapper, oracle)


def test_float32_norms_match_float64_oracle_to_1e5_relative():
    torch.manual_seed(0)
    model = SequenceModel()
    tokens = torch.randint(0, 11, (6, 9))
    oracle = {n: g.float() for n, g in model_oracle(build(SequenceModel), (tokens,)).items()}
    wrapper = BookkeepingGradSampleModule(model)
    run_backward(wrapper, (tokens,), "mean", 6)
    assert_norms_and_sums(wrapper, oracle, rtol=1e-5, atol=1e-6)


class ThreeCalls(nn.Module):
    """One Linear called at three steps, as a recurrent cell's projection is."""

    def __init__(self, d=6):
        super().__init__()
        self.step = nn.Linear(d, d)

    def forward(self, x):
        h = x
        for _ in range(3):
            h = torch.tanh(self.step(h))
        return h.sum(dim=1)


def test_merged_calls_free_their_records_before_the_norms(monkeypatch):
    """The calls of a layer merged into one ghost call are dropped once merged: while the norms
    are formed only the merged copy holds their inputs and output gradients (a DPLSTM's step
    projection held both its 64 calls and their concatenation). The two-pass ``ghost`` mode's
    norms pass keeps them for its second pass."""
    import opacus_dp.grad_sample.bookkeeping.bookkeeper as bookkeeper
    import opacus_dp.grad_sample.bookkeeping.passes as passes

    model = build(ThreeCalls)
    x = torch.randn(4, 5, 6, dtype=torch.float64)
    oracle = model_oracle(model, (x,))
    resolved, held_at_norms = [], []
    resolve, norms = bookkeeper.resolve_calls, passes.ghost_norms

    def spy_resolve(current, layer, calls, **options):
        resolved.append(calls)
        return resolve(current, layer, calls, **options)

    def spy_norms(layer, activations, backprops):
        held_at_norms.append([(c.backprops[0] is not None, not c.call.released) for c in resolved[-1]])
        return norms(layer, activations, backprops)

    monkeypatch.setattr(bookkeeper, "resolve_calls", spy_resolve)
    monkeypatch.setattr(passes, "ghost_norms", spy_norms)
    wrapper = BookkeepingGradSampleModule(model, layer_rule="ghost")
    run_backward(wrapper, (x,), "mean", 4)
    assert held_at_norms == [[(False, False)] * 3]
    assert_norms_and_sums(wrapper, oracle)
    wrapper.zero_grad_sample()
    resolved.clear(), held_at_norms.clear()
    with wrapper.norms_pass():
        run_backward(wrapper, (x,), "mean", 4)
    assert held_at_norms == [[(True, True)] * 3]
    wrapper.close()
