"""Hugging Face ``Conv1D`` (``y = x W + b``, ``W`` of shape ``(in, out)``): the dedicated grad
sampler (hooks) and norm rule (ghost / bk) against the batch-size-1 autograd oracle (float64),
on ``(B, in)`` and ``(B, T, in)`` inputs."""

import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp import PrivacyEngine
from opacus_dp.grad_sample import GRAD_SAMPLERS, NORM_SAMPLERS, BookkeepingGradSampleModule
from opacus_dp.grad_sample.bookkeeping import chunked_sums
from opacus_dp.grad_sample.bookkeeping.norm_rules import NORM_RULES
from opacus_dp.grad_sample.hf_conv1d import conv1d_grad_sample
from tests.engine.helpers import clipped_sum_oracle
from tests.ghost.helpers import assert_norms_and_sums, model_oracle, run_backward
from tests.ghost.test_norm_samplers import check_layer
from tests.grad_sample.oracle import assert_grad_samples_close, gsm_grad_samples, oracle_grad_samples

Conv1D = pytest.importorskip("transformers.pytorch_utils").Conv1D
SETTINGS = settings(max_examples=12, deadline=None)


def conv1d(n_in: int, n_out: int, frozen=None) -> nn.Module:
    layer = Conv1D(n_out, n_in).double()  # Conv1D(nf=out, nx=in)
    nn.init.normal_(layer.weight)
    nn.init.normal_(layer.bias)
    if frozen is not None:
        getattr(layer, frozen).requires_grad_(False)
    return layer


class Block(nn.Module):
    """A GPT-2 MLP: Conv1D → GELU → Conv1D, then a pooled head."""

    def __init__(self, d=5, hidden=7):
        super().__init__()
        self.c_fc, self.c_proj, self.head = conv1d(d, hidden), conv1d(hidden, d), nn.Linear(d, 3)

    def forward(self, x):
        return self.head(self.c_proj(nn.functional.gelu(self.c_fc(x))).mean(dim=1))


def test_conv1d_is_registered_with_a_ghost_path():
    assert GRAD_SAMPLERS[Conv1D] is conv1d_grad_sample
    assert Conv1D in NORM_SAMPLERS and NORM_RULES[Conv1D].has_ghost_path


@SETTINGS
@given(batch=st.integers(1, 4), middle=st.lists(st.integers(1, 3), max_size=2),
       features=st.tuples(st.integers(1, 5), st.integers(1, 5)),
       frozen=st.sampled_from([None, "weight", "bias"]), loss_reduction=st.sampled_from(["mean", "sum"]))
def test_hooks_per_sample_gradients(batch, middle, features, frozen, loss_reduction):
    layer = conv1d(*features, frozen=frozen)
    x = torch.randn(batch, *middle, features[0], dtype=torch.float64)
    expected = oracle_grad_samples(layer, (x,))
    assert_grad_samples_close(gsm_grad_samples(layer, (x,), loss_reduction=loss_reduction), expected)


@SETTINGS
@given(batch=st.integers(1, 4), middle=st.lists(st.integers(1, 3), max_size=2),
       features=st.tuples(st.integers(1, 5), st.integers(1, 5)),
       frozen=st.sampled_from([None, "weight", "bias"]), same_factors=st.booleans())
def test_norms_and_weighted_sums_of_both_scaled_sides(batch, middle, features, frozen, same_factors):
    """``d ≤ p`` scales the inputs, ``d > p`` the output gradients."""
    layer = conv1d(*features, frozen=frozen)
    check_layer(layer, torch.randn(batch, *middle, features[0], dtype=torch.float64),
                same_factors=same_factors)


@pytest.mark.parametrize("rule", ["mixed", "ghost"])
@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_norms_only_modes_on_sequences(rule, loss_reduction):
    torch.manual_seed(0)
    model = Block().double()
    x = torch.randn(4, 6, 5, dtype=torch.float64)
    oracle = model_oracle(model, (x,))
    wrapper = BookkeepingGradSampleModule(model, loss_reduction=loss_reduction, layer_rule=rule)
    try:
        run_backward(wrapper, (x,), loss_reduction, 4)
        modes = wrapper.layer_modes()
        if rule == "ghost":
            assert modes["c_fc (Conv1D)"] == modes["c_proj (Conv1D)"] == "ghost"
        assert_norms_and_sums(wrapper, oracle)
    finally:
        wrapper.close()


def test_per_layer_clipping_in_chunks_equals_the_oracle(monkeypatch):
    """Per-layer clipping forms the per-sample gradients ``A_iᵀ G_i`` a few samples at a time."""
    monkeypatch.setattr(chunked_sums, "CHUNK_BYTES", 3 * 8 * 8 * 8)
    torch.manual_seed(1)
    model = nn.Sequential(conv1d(8, 8), nn.Tanh(), conv1d(8, 3))
    x, y = torch.randn(10, 16, 8, dtype=torch.float64), torch.randint(0, 3, (10, 16))

    def loss_of(out, target):
        return nn.functional.cross_entropy(out.reshape(-1, 3), target.reshape(-1), reduction="sum")

    params = list(model.parameters())
    rows = [torch.autograd.grad(loss_of(model(x[i:i + 1]), y[i:i + 1]), params) for i in range(10)]
    bounds = [0.5, 0.2, 0.3, 0.1]
    sums = clipped_sum_oracle([torch.stack([r[j] for r in rows]) for j in range(4)], bounds, per_layer=True)
    expected = [p.detach() - s / 10 for p, s in zip(params, sums)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gsm, optimizer, _ = PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(params, lr=1.0),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=10), noise_multiplier=0.0,
            max_grad_norm=bounds, clipping="per_layer", grad_sample_mode="bk", poisson_sampling=False)
    (loss_of(gsm(x), y) / 10).backward()
    assert gsm.layer_modes()["0 (Conv1D)"] == "chunked"
    optimizer.step()
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.detach(), e, rtol=1e-10, atol=1e-12)


def test_registered_when_transformers_is_imported_after_opacus_dp():
    """``import opacus_dp`` does not import ``transformers``; a later import of it still gets
    ``Conv1D`` its sampler at the first look-up."""
    code = ("import sys, opacus_dp.grad_sample as g\n"
            "assert 'transformers' not in sys.modules\n"
            "from transformers.pytorch_utils import Conv1D\n"
            "assert g.GRAD_SAMPLERS.get(Conv1D) is g.hf_conv1d.conv1d_grad_sample\n"
            "assert Conv1D in g.NORM_SAMPLERS\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
