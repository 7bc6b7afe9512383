"""Input Gram products shared by the ``Linear`` calls of one pass that read the same tensor.

Each model here is run twice: as released (sharing on) and with the forward counting switched
off (no call then expects another on its input, so nothing is kept or taken). The two must agree
bit for bit, both must match the batch-size-1 autograd oracle (float64), and the number of
products taken must be the number of calls that found their input's products already formed.
"""

import gc
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from opacus_dp.grad_sample import BookkeepingGradSampleModule
from opacus_dp.grad_sample.bookkeeping import shared_input_grams as shared
from tests.ghost.helpers import assert_norms_and_sums, model_oracle, run_backward


class Block(nn.Module):
    """An attention block's q/k/v projections and a gated MLP's gate/up projections, each
    group called on one tensor (as in Llama, BERT, ViT)."""

    def __init__(self, d=8, hidden=12, use_k=True):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.gate, self.up = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d)
        self.use_k = use_k

    def forward(self, x):
        k = self.k(x) if self.use_k else self.q(x).detach()
        scores = torch.softmax(self.q(x) @ k.transpose(1, 2) / 4, dim=-1)
        h = x + self.o(scores @ self.v(x))
        return self.down(F.silu(self.gate(h)) * self.up(h)).mean(dim=1)


def _wrap(rule, model, **kwargs):
    return BookkeepingGradSampleModule(model, layer_rule=rule, **kwargs)


def _run(rule, model, x, share: bool, monkeypatch, **kwargs):
    """``(wrapper, norms, sums)`` with sharing on or off (random factors, seed 0)."""
    with monkeypatch.context() as patch:
        if not share:
            patch.setattr(shared.SharedInputGrams, "expect", lambda self, inputs: None)
        wrapper = _wrap(rule, model, **kwargs)
        run_backward(wrapper, (x,), "mean", x.shape[0])
    params = [p for _, p in wrapper.trainable_parameters()]
    norms = wrapper.per_sample_norms(params)
    factors = [torch.rand(n.shape[0], generator=torch.Generator().manual_seed(i), dtype=n.dtype)
               for i, n in enumerate(norms)]
    taken, modes = wrapper._bookkeeper._input_grams.taken, wrapper.layer_modes()
    sums = wrapper.clipped_sums(params, factors)
    wrapper.close()
    return taken, modes, norms, sums


@pytest.mark.parametrize("rule", ["ghost", "mixed"])
@pytest.mark.parametrize("positions", [6, 300])  # one row block; two (T ≥ 256)
def test_shared_products_give_the_same_bits_and_the_oracle(rule, positions, monkeypatch):
    torch.manual_seed(0)
    model = Block().double()
    x = torch.randn(3, positions, 8, dtype=torch.float64)
    taken, modes, norms, sums = _run(rule, model, x, True, monkeypatch)
    plain_taken, plain_modes, plain_norms, plain_sums = _run(rule, model, x, False, monkeypatch)
    ghost = {name for name, mode in modes.items() if mode == "ghost"}
    assert modes == plain_modes and plain_taken == 0
    # q, k, v read x; gate and up read h: each group's later ghost calls take the first one's
    expected = max(0, len(ghost & {"q (Linear)", "k (Linear)", "v (Linear)"}) - 1) \
        + max(0, len(ghost & {"gate (Linear)", "up (Linear)"}) - 1)
    assert taken == expected
    if rule == "ghost":
        assert taken == 3
    for a, b in zip(norms + sums, plain_norms + plain_sums):
        assert torch.equal(a, b)
    oracle = model_oracle(model, (x,))
    wrapper = _wrap(rule, model)
    run_backward(wrapper, (x,), "mean", 3)
    assert_norms_and_sums(wrapper, oracle)


def test_products_are_dropped_with_the_last_call_and_at_the_end_of_the_pass(monkeypatch):
    """``k`` is not called here and ``q`` is called a second time on ``x`` for a detached
    result, which never receives a gradient: the count that call leaves, and anything kept for
    it, are dropped when the backward pass ends."""
    torch.manual_seed(0)
    model = Block(use_k=False).double()
    x = torch.randn(3, 6, 8, dtype=torch.float64)
    oracle = model_oracle(model, (x,))
    wrapper = _wrap("ghost", model)
    grams = wrapper._bookkeeper._input_grams
    kept_during = []
    original = shared.SharedInputGrams._products

    def spy(self, key, keep, a, bounds):
        result = original(self, key, keep, a, bounds)
        kept_during.append(len(self._entries))
        return result

    monkeypatch.setattr(shared.SharedInputGrams, "_products", spy)
    run_backward(wrapper, (x,), "mean", 3)
    assert max(kept_during) >= 1  # something was kept while the pass ran
    assert grams._entries == {} and grams._uses == {}
    named = [(n, p) for n, p in wrapper.trainable_parameters() if not n.startswith("k.")]
    for (name, _), norm in zip(named, wrapper.per_sample_norms([p for _, p in named])):
        torch.testing.assert_close(norm, oracle[name].flatten(1).norm(dim=1), rtol=1e-9, atol=1e-10)
    wrapper.close()


def test_an_entry_is_taken_only_for_the_tensor_it_came_from():
    base = torch.randn(2, 5, 4, dtype=torch.float64)
    bounds = (0, 5)
    grams = shared.SharedInputGrams()
    key = shared.input_key((base,))
    kept = grams._products(key, True, base, bounds)
    assert grams._entries and grams.taken == 0
    torch.testing.assert_close(kept[0], base @ base.transpose(1, 2), rtol=0, atol=0)
    assert grams._products(key, True, base.detach(), bounds) is kept and grams.taken == 1
    for other in (base.clone(), base.float(), base[:, :4], base.transpose(1, 2).contiguous().transpose(1, 2)):
        assert grams._products(key, False, other, (0, other.shape[1])) is not kept
    assert grams._products(key, False, base, (0, 2, 5)) is not kept  # other row blocks
    base.add_(1.0)  # written in place: the version counter moved
    fresh = list(grams._products(key, False, base, bounds))
    torch.testing.assert_close(fresh[0], base @ base.transpose(1, 2), rtol=0, atol=0)
    assert grams.taken == 1


def test_a_kept_entry_holds_its_tensor_so_its_memory_is_not_reused():
    grams = shared.SharedInputGrams()
    a = torch.randn(2, 5, 4)
    alive = weakref.ref(a)
    grams._products(shared.input_key((a,)), True, a, (0, 5))
    del a
    gc.collect()
    assert alive() is not None
    grams.end_pass()
    gc.collect()
    assert alive() is None


def test_without_a_resolution_products_are_formed_one_block_at_a_time():
    a = torch.randn(2, 8, 3, dtype=torch.float64)
    blocks = shared.input_products(a, [0, 4, 8])
    assert not isinstance(blocks, list)  # a generator: no block is held before it is used
    first, second = list(blocks)
    torch.testing.assert_close(first, a[:, :4] @ a.transpose(1, 2), rtol=0, atol=0)
    torch.testing.assert_close(second, a[:, 4:] @ a[:, 4:].transpose(1, 2), rtol=0, atol=0)


def test_input_key_refuses_tensors_without_storage_of_their_own():
    assert shared.input_key(()) is None and shared.input_key((3,)) is None
    assert shared.input_key((torch.empty(2, 3, device="meta"),)) is None
    x = torch.randn(4, 3)
    assert shared.input_key((x,)) == shared.input_key((x.detach(),)) != shared.input_key((x[1:],))


def test_autocast_copies_are_not_shared_and_norms_stay_those_of_the_rounded_inputs(monkeypatch):
    """Under autocast each call's input is its own rounded copy: nothing is taken, and the
    results are those without sharing, bit for bit."""
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(3, 6, 8)

    def run(share):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _run("ghost", model, x, share, monkeypatch)

    taken, _, norms, sums = run(True)
    _, _, plain_norms, plain_sums = run(False)
    assert taken == 0
    for a, b in zip(norms + sums, plain_norms + plain_sums):
        assert torch.equal(a, b)


class CalledTwice(nn.Module):
    """``a`` called twice on the same input (its calls merge) beside ``b`` on that input."""

    def __init__(self, d=8):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return (self.a(x) * self.a(x).tanh() + self.b(x)).mean(dim=1)


def test_merged_calls_and_a_forward_without_backward_change_nothing(monkeypatch):
    torch.manual_seed(0)
    model = CalledTwice().double()
    x = torch.randn(3, 6, 8, dtype=torch.float64)

    def run(share):
        with monkeypatch.context() as patch:
            if not share:
                patch.setattr(shared.SharedInputGrams, "expect", lambda self, inputs: None)
            wrapper = _wrap("ghost", model)
            wrapper(x)  # a forward whose backward never runs: its counts are stale
            run_backward(wrapper, (x,), "mean", 3)
        params = [p for _, p in wrapper.trainable_parameters()]
        result = wrapper.per_sample_norms(params)
        wrapper.close()
        return result

    oracle = model_oracle(model, (x,))
    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)
    wrapper = _wrap("ghost", model)
    run_backward(wrapper, (x,), "mean", 3)
    assert_norms_and_sums(wrapper, oracle)


def test_a_resolution_inside_another_restores_the_outer_scope():
    """A resolution nested on the same thread (another model's, say) neither leaks its scope
    into the outer one nor leaves the outer one without its own when it ends."""
    outer, inner = shared.SharedInputGrams(), shared.SharedInputGrams()
    a = torch.randn(2, 5, 4)

    class Recorded:
        def __init__(self, x):
            self.call = type("Call", (), {"args": (x,)})()

    outer.expect((a,))
    outer.expect((a,))
    with outer.resolving([Recorded(a)]):
        with inner.resolving([Recorded(torch.randn(2, 5, 4))]):
            list(shared.input_products(torch.randn(2, 5, 4), [0, 5]))
        kept = shared.input_products(a, [0, 5])
        assert isinstance(kept, list) and outer._entries and not inner._entries
    assert getattr(shared._ACTIVE, "scope", None) is None
    with outer.resolving([Recorded(a)]):
        assert shared.input_products(a, [0, 5]) is kept and outer.taken == 1
    assert not outer._entries  # the last call of ``a``: dropped


class Conv1DPair(nn.Module):
    """Two Hugging Face ``Conv1D`` layers (GPT-2's linear layers) and a ``Linear`` on one input."""

    def __init__(self, conv1d, d=8):
        super().__init__()
        self.a, self.b, self.c = conv1d(d, d), conv1d(2 * d, d), nn.Linear(d, d)

    def forward(self, x):
        return (self.a(x).tanh() + self.b(x)[..., :8] * self.c(x)).mean(dim=1)


def test_hugging_face_conv1d_shares_with_linear(monkeypatch):
    conv1d = pytest.importorskip("transformers.pytorch_utils").Conv1D
    torch.manual_seed(0)
    model = Conv1DPair(conv1d).double()
    x = torch.randn(3, 6, 8, dtype=torch.float64)
    oracle = model_oracle(model, (x,))
    taken, modes, norms, sums = _run("ghost", model, x, True, monkeypatch)
    _, _, plain_norms, plain_sums = _run("ghost", model, x, False, monkeypatch)
    assert set(modes.values()) == {"ghost"} and taken == 2
    for a, b in zip(norms + sums, plain_norms + plain_sums):
        assert torch.equal(a, b)
    wrapper = _wrap("ghost", model)
    run_backward(wrapper, (x,), "mean", 3)
    assert_norms_and_sums(wrapper, oracle)
