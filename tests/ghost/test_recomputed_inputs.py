"""Layer inputs held as the input of the activation that produced them (``bk`` memory).

The recomputed input must be bit-identical to the original, the swap must be refused
whenever it would be wrong or gain nothing, and whole models with such activations must
still give the oracle's norms and clipped sums.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from opacus_dp.grad_sample import BookkeepingGradSampleModule
from opacus_dp.grad_sample.layer_call import LayerCall
from opacus_dp.grad_sample.bookkeeping.recomputed_inputs import RecomputedInput, lean, materialise, producer_of
from tests.ghost.helpers import assert_norms_and_sums, model_oracle, run_backward

ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
    "silu": F.silu,
    "mish": F.mish,
    "hardswish": F.hardswish,
    "leaky_relu": lambda h: F.leaky_relu(h, 0.07),
    "softplus": lambda h: F.softplus(h, beta=2.0, threshold=3.0),
    "elu": lambda h: F.elu(h, alpha=0.7),
    "selu": F.selu,
    "celu": lambda h: F.celu(h, alpha=1.3),
}


def _produced(name: str, dtype=torch.float32, transposed: bool = False):
    torch.manual_seed(0)
    h = (torch.randn(4, 3, 5, dtype=dtype) * 4).requires_grad_(True)
    h2 = h * 1.0  # a non-leaf, like a layer's output
    if transposed:  # a non-contiguous input: the kernels take their scalar path
        h2 = h2.transpose(0, 2)
    return h2, ACTIVATIONS[name](h2)


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
@pytest.mark.parametrize("exclusive", [True, False])
@pytest.mark.parametrize("transposed", [False, True])
def test_recomputed_value_is_bit_identical(name, exclusive, transposed):
    h, a = _produced(name, transposed=transposed)
    recomputed = lean(a.detach(), producer_of(a), batch_dim=0, holders=2)
    assert isinstance(recomputed, RecomputedInput)
    expected = a.detach().clone()
    del a
    if exclusive:  # nothing else holds h: computed into h's own memory
        h_values = h.detach().clone()
        del h
    value = recomputed.value()
    assert torch.equal(value, expected) and value.dtype == expected.dtype
    assert recomputed.value() is value  # computed once
    if not exclusive:
        assert not torch.equal(h.detach(), value)  # h untouched (held by the test)
    else:
        assert not torch.equal(h_values, value)


def test_batch_second_inputs_are_moved_like_the_recorded_view():
    h, a = _produced("gelu")
    recorded = a.detach()
    view = recorded.movedim(1, 0)
    recomputed = lean(recorded, producer_of(a), batch_dim=1, holders=3)
    assert torch.equal(materialise([recomputed])[0], view)


def test_not_swapped_when_wrong_or_useless():
    h, a = _produced("gelu")
    assert producer_of(F.relu(h)) is None  # ReLU saves its output: nothing to gain
    assert producer_of(a[1:]) is None  # a view of the activation output
    assert producer_of(a.detach()) is None
    producer = producer_of(a)
    held_elsewhere = a.detach()
    assert lean(held_elsewhere, producer, 0, holders=1) is None  # `a` itself is still alive
    del a
    held_elsewhere.mul_(2)  # modified in place after the call
    assert lean(held_elsewhere, producer, 0, holders=1) is None


def test_not_tracked_under_saved_tensor_hooks():
    """Checkpointing / ``save_on_cpu`` pack the saved input: unpacking would recompute or copy."""
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        h, a = _produced("gelu")
        assert producer_of(a) is None
    assert producer_of(_produced("gelu")[1]) is not None


@pytest.mark.parametrize("layer_rule", ["mixed", "ghost"])
def test_checkpointed_mlp_blocks_match_the_oracle(layer_rule):
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(Model):
        def forward(self, tokens):
            h = self.emb(tokens)
            for block in self.blocks:
                h = checkpoint(block, h, use_reentrant=False)
            return self.head(h.mean(dim=1, keepdim=True)).squeeze(1)

    torch.manual_seed(0)
    model = Checkpointed(nn.GELU()).double()
    tokens = torch.randint(0, 9, (3, 4))
    oracle = model_oracle(model, (tokens,))
    wrapper = BookkeepingGradSampleModule(model, layer_rule=layer_rule)
    run_backward(wrapper, (tokens,), "mean", 3)
    (finished,) = wrapper._bookkeeper._resolved
    assert not any(isinstance(a, RecomputedInput) for _, acts, _, _ in finished.ghost_calls for a in acts)
    assert_norms_and_sums(wrapper, oracle)


def test_not_swapped_after_the_activation_input_changed_or_its_backward_ran():
    h, a = _produced("silu")
    recorded, producer = a.detach(), producer_of(a)
    del a
    with torch.no_grad():
        h.add_(1)  # autograd's saved input is stale: unpacking it raises, so no swap
    assert lean(recorded, producer, 0, holders=1) is None
    h, a = _produced("silu")
    recorded, producer = a.detach(), producer_of(a)
    a.sum().backward()  # frees the saved input
    del a
    assert lean(recorded, producer, 0, holders=1) is None


def test_layer_call_swaps_only_tracked_plain_calls():
    layer = nn.Linear(5, 2)
    for track in (True, False):
        h, a = _produced("gelu")
        call = LayerCall.capture((a,), {}, 0, 4, track_producers=track)
        del a
        swapped = call.lean_activations(layer, call.activations(layer))
        assert isinstance(swapped[0], RecomputedInput if track else torch.Tensor)
        call.release()
        assert call.producers == ()
    h, a = _produced("gelu")
    call = LayerCall.capture((a,), {}, 0, 4, track_producers=True)
    second = LayerCall.capture((a,), {}, 0, 4)  # another record holds the same input
    del a
    assert isinstance(call.lean_activations(layer, call.activations(layer))[0], torch.Tensor)


class MLPBlock(nn.Module):
    def __init__(self, d, act):
        super().__init__()
        self.ln, self.up, self.down, self.act = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(3 * d, d), act

    def forward(self, x):
        return x + self.down(self.act(self.up(self.ln(x))))


class Model(nn.Module):
    """Embedding, two pre-LayerNorm MLP blocks, mean over positions, head; (B, T) tokens, or
    (T, B) with ``batch_first=False``."""

    def __init__(self, act, batch_first=True, d=8):
        super().__init__()
        self.emb = nn.Embedding(9, d)
        self.blocks = nn.Sequential(MLPBlock(d, act), MLPBlock(d, act))
        self.head = nn.Linear(d, 2)
        self.positions = 1 if batch_first else 0

    def forward(self, tokens):
        pooled = self.blocks(self.emb(tokens)).mean(dim=self.positions, keepdim=True)
        return self.head(pooled).squeeze(self.positions)  # the head also sees (T=1, B) inputs


@pytest.mark.parametrize("act", [nn.GELU(), nn.SiLU(), nn.GELU(approximate="tanh")], ids=str)
@pytest.mark.parametrize("batch_first", [True, False])
def test_mlp_blocks_keep_activation_inputs_and_match_the_oracle(act, batch_first):
    """T = 4 positions, d = 8: the mixed rule keeps the MLP linears (8 ↔ 24) ghost."""
    torch.manual_seed(0)
    model = Model(act, batch_first).double()
    tokens = torch.randint(0, 9, (3, 4) if batch_first else (4, 3))
    oracle = model_oracle(model, (tokens,), batch_dim=0 if batch_first else 1)
    wrapper = BookkeepingGradSampleModule(model, batch_first=batch_first)
    run_backward(wrapper, (tokens,), "mean", 3)
    (finished,) = wrapper._bookkeeper._resolved
    kept = {name: activations[0] for layer, activations, _, _ in finished.ghost_calls
            for name, m in model.named_modules() if m is layer}
    assert isinstance(kept["blocks.0.down"], RecomputedInput)
    assert isinstance(kept["blocks.1.down"], RecomputedInput)
    assert isinstance(kept["blocks.0.up"], torch.Tensor)  # LayerNorm output: not an activation
    assert_norms_and_sums(wrapper, oracle)


def test_recomputed_with_the_forward_thread_count_and_restored():
    """On CPU the value is computed with the forward pass's intra-op thread count (chunk
    tails run a scalar path, which differs in the last bits from the vector loop)."""
    previous = torch.get_num_threads()
    seen = []
    try:
        torch.set_num_threads(1)
        h, a = _produced("gelu")
        recomputed = lean(a.detach(), producer_of(a), batch_dim=0, holders=2)
        expected = a.detach().clone()
        torch.set_num_threads(3)
        original = recomputed._op
        recomputed._op = type("Spy", (), {
            "default": lambda self, *args, **kw: (seen.append(torch.get_num_threads()),
                                                  original.default(*args, **kw))[1],
            "out": lambda self, *args, **kw: (seen.append(torch.get_num_threads()),
                                              original.out(*args, **kw))[1]})()
        assert torch.equal(recomputed.value(), expected)
        assert seen == [1] and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(previous)
