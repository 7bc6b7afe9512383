"""Layers called with ``None`` among their positional arguments keep every argument.

``bag(idx, None, per_sample_weights)`` is a valid ``nn.EmbeddingBag`` call; the ``bk`` mode
keeps a layer's inputs until the step, and had lost the weights after the ``None`` there: the
norm came with the weights, the clipped sum without them (a sample with weights 0.01 moved the
update by 100 C). Every mode's update must equal the float64 oracle (per-sample autograd loop,
clipped by hand), the weights passed by position or by keyword, and a custom layer (the
``torch.func`` fallback) called with a ``None`` before a tensor argument likewise.
"""

import copy

import pytest
import torch
import torch.nn as nn

from opacus_dp.grad_sample import BookkeepingGradSampleModule
from tests.engine.helpers import clipped_sum_oracle
from tests.ghost.test_outside_use import median_flat_bound
from tests.ghost.test_user_modifications import assert_update_matches, private, snapshot
from tests.grad_sample.oracle import default_loss

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
VOCAB, DIM, BATCH, BAG = 15, 4, 6, 5
MODES = ["hooks", "functorch", "bk", "ghost", "auto"]


class WeightedBag(nn.Module):
    def __init__(self, positional: bool):
        super().__init__()
        self.positional = positional
        self.bag, self.out = nn.EmbeddingBag(VOCAB, DIM, mode="sum"), nn.Linear(DIM, 2)

    def forward(self, idx, weights):
        bags = self.bag(idx, None, weights) if self.positional else self.bag(idx, per_sample_weights=weights)
        return self.out(torch.tanh(bags))


class Gated(nn.Module):
    """A custom layer (no per-sample formula: the fallback) with optional tensor arguments."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(DIM, DIM) / DIM)

    def forward(self, x, shift=None, gate=None):
        out = x @ self.weight
        out = out if shift is None else out + shift
        return out if gate is None else out * gate


class GatedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.gated = nn.Linear(DIM, DIM), Gated()

    def forward(self, x, gate):
        return self.gated(torch.tanh(self.inp(x)), None, gate)


def oracle(model, inputs):
    m64 = copy.deepcopy(model).double()
    names = [n for n, _ in m64.named_parameters()]
    rows = {n: [] for n in names}
    for i in range(BATCH):
        m64.zero_grad()
        sample = [t[i:i + 1].double() if t.is_floating_point() else t[i:i + 1] for t in inputs]
        default_loss(m64(*sample)).backward()
        for n, p in m64.named_parameters():
            rows[n].append(p.grad.clone())
    return names, [torch.stack(rows[n]) for n in names]


def assert_step_matches_oracle(model, inputs, mode):
    """One σ = 0 step of the float64 model (tight comparison: small per-sample weights make
    float32 rounding visible) against the oracle."""
    model = model.double()
    inputs = [t.double() if t.is_floating_point() else t for t in inputs]
    names, rows = oracle(model, inputs)
    bound = median_flat_bound(rows)
    expected = [s / BATCH for s in clipped_sum_oracle(rows, bound, per_layer=False)]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*inputs), batch_size=BATCH)
    _, module, optimizer, criterion, _ = private(model, loader, mode, bound)
    before = snapshot(model)
    optimizer.zero_grad()
    criterion(module(*inputs)).backward()
    optimizer.step()
    assert_update_matches(names, before, model, expected)


def bag_inputs():
    g = torch.Generator().manual_seed(2)
    idx = torch.randint(0, VOCAB, (BATCH, BAG), generator=g)
    weights = torch.rand(BATCH, BAG, generator=g) * 0.1  # small weights: unclipped norms look small
    return idx, weights


@pytest.mark.parametrize("positional", [True, False])
@pytest.mark.parametrize("mode", MODES)
def test_embedding_bag_weights_after_a_none_offsets(mode, positional):
    torch.manual_seed(7)
    assert_step_matches_oracle(WeightedBag(positional), bag_inputs(), mode)


@pytest.mark.parametrize("mode", MODES)
def test_fallback_layer_with_a_none_before_a_tensor_argument(mode):
    torch.manual_seed(8)
    g = torch.Generator().manual_seed(3)
    inputs = (torch.randn(BATCH, DIM, generator=g), torch.rand(BATCH, DIM, generator=g))
    assert_step_matches_oracle(GatedModel(), inputs, mode)


@pytest.mark.parametrize("rule", ["mixed", "ghost"])
def test_an_input_from_inference_mode_is_refused_naming_the_layer_and_the_fix(rule):
    """Frozen features computed under ``torch.inference_mode()`` cannot be kept for the
    per-sample gradients (autograd refuses to save them too): a clear error, not the version
    counter's, and the same features under ``torch.no_grad()`` train."""
    model = nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 2))
    with torch.inference_mode():
        frozen = torch.randn(3, 8)
    wrapper = BookkeepingGradSampleModule(model, layer_rule=rule)
    with pytest.raises(RuntimeError, match=r"0 \(Linear\).*inference_mode.*torch\.no_grad\(\).*clone"):
        wrapper(frozen)
    with torch.no_grad():
        features = torch.randn(3, 8)
    wrapper(features).sum().backward()
    assert set(wrapper.layer_modes()) == {"0 (Linear)", "2 (Linear)"}
    wrapper.close()
