"""A parameter used outside the module that owns it, and parameters tied between modules.

``F.linear(h, emb.weight)`` in a parent's forward (or in the loss) adds a gradient that no
per-sample hook sees: the private update would silently leave that use out. Where the owner's
weight gradients are switched off (``bk``/``ghost``, ``skip_weight_grads=True``), any gradient
autograd still accumulates into the parameter comes from such a use; where they are kept
(``hooks``/``functorch`` by default) the pass's total gradient differs from the sum of the
per-sample gradients. Either way the backward pass is refused, naming the parameter, and
nothing is updated. Tying the weight through a second
module (``head.weight = emb.weight``) is the supported form: every mode's update equals the
float64 oracle (per-sample autograd loop, clipped by hand). Layers whose own calls leave
their parameters requiring grad (an ``EmbeddingBag`` on the token input, ``disable_hooks``)
must not be mistaken for outside uses, in the two-pass ``ghost`` backward too.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from tests.engine.helpers import clipped_sum_oracle
from tests.ghost.test_user_modifications import (
    assert_unchanged, assert_update_matches, private, snapshot)
from tests.grad_sample.oracle import default_loss

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
VOCAB, DIM, BATCH, LENGTH = 12, 6, 8, 5
ALL_MODES = ["hooks", "functorch", "bk", "ghost", "auto"]


class OutsideHead(nn.Module):
    """The embedding's weight reused as the output projection by ``F.linear``."""

    def __init__(self):
        super().__init__()
        self.emb, self.mix = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, DIM)

    def features(self, tokens):
        return torch.tanh(self.mix(self.emb(tokens))).mean(dim=1)

    def forward(self, tokens):
        return F.linear(self.features(tokens), self.emb.weight)


class TiedHead(nn.Module):
    """The same model with the output projection a module whose weight is the embedding's."""

    def __init__(self):
        super().__init__()
        self.emb, self.mix = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.emb(tokens))).mean(dim=1))


class BagFirst(nn.Module):
    """An ``EmbeddingBag`` on the token input: its parameters keep requiring grad in its call."""

    def __init__(self):
        super().__init__()
        self.bag, self.out = nn.EmbeddingBag(VOCAB, DIM, mode="mean"), nn.Linear(DIM, 3)

    def forward(self, tokens):
        return self.out(torch.tanh(self.bag(tokens)))


def tokens(seed=3):
    return torch.randint(0, VOCAB, (BATCH, LENGTH), generator=torch.Generator().manual_seed(seed))


def loader(x):
    return DataLoader(TensorDataset(x), batch_size=BATCH)


def build(cls, seed=5):
    torch.manual_seed(seed)
    return cls()


def token_oracle(model, x):
    """``(names, per-sample gradients (B, *shape))`` of a float64 copy, one sample at a time."""
    m64 = copy.deepcopy(model).double()
    named = dict(m64.named_parameters())
    rows = {n: [] for n in named}
    for i in range(len(x)):
        m64.zero_grad()
        default_loss(m64(x[i:i + 1])).backward()
        for n, p in named.items():
            rows[n].append(p.grad.clone())
    return list(named), [torch.stack(rows[n]) for n in named]


def median_flat_bound(rows):
    return torch.sqrt(sum(g.reshape(len(g), -1).pow(2).sum(1) for g in rows)).median().item()


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("mode", ALL_MODES)
def test_use_outside_the_owner_in_forward_is_refused(mode, clipping):
    model, x = build(OutsideHead), tokens()
    bound = 0.1 if clipping == "flat" else [0.1, 0.1, 0.1]
    _, module, optimizer, criterion, _ = private(model, loader(x), mode, bound, clipping=clipping)
    before = snapshot(model)
    optimizer.zero_grad()
    with pytest.raises(RuntimeError, match=r"parameter emb\.weight .*outside the module that owns it"):
        criterion(module(x)).backward()
    assert_unchanged(before, model)


@pytest.mark.parametrize("mode", ["hooks", "functorch", "bk", "auto"])
def test_use_outside_the_model_in_the_loss_is_refused(mode):
    model, x = build(OutsideHead), tokens()
    _, module, optimizer, _, _ = private(model, loader(x), mode, 0.1)
    optimizer.zero_grad()
    with pytest.raises(RuntimeError, match=r"parameter emb\.weight .*outside"):
        default_loss(F.linear(module.features(x), model.emb.weight)).backward()


@pytest.mark.parametrize("mode", ["hooks", "functorch", "bk", "ghost", "auto"])
def test_weight_tied_through_a_module_matches_the_oracle(mode):
    model, x = build(TiedHead), tokens()
    names, rows = token_oracle(model, x)
    bound = median_flat_bound(rows)
    expected = [s / BATCH for s in clipped_sum_oracle(rows, bound, per_layer=False)]
    _, module, optimizer, criterion, _ = private(model, loader(x), mode, bound)
    before = snapshot(model)
    optimizer.zero_grad()
    criterion(module(x)).backward()
    optimizer.step()
    assert_update_matches(names, before, model, expected)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_own_gradients_of_an_unswitched_layer_are_not_taken_for_an_outside_use(mode):
    model, x = build(BagFirst), tokens()
    names, rows = token_oracle(model, x)
    bound = median_flat_bound(rows)
    expected = [s / BATCH for s in clipped_sum_oracle(rows, bound, per_layer=False)]
    _, module, optimizer, criterion, _ = private(model, loader(x), mode, bound)
    before = snapshot(model)
    optimizer.zero_grad()
    criterion(module(x)).backward()
    optimizer.step()
    assert_update_matches(names, before, model, expected)


def test_use_outside_the_owner_is_refused_by_the_classic_api():
    from opacus_dp import PrivacyEngine

    model, x = build(OutsideHead), tokens()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    with pytest.warns(UserWarning):
        PrivacyEngine(model, batch_size=BATCH, sample_size=10 * BATCH, noise_multiplier=1.0,
                      max_grad_norm=1.0).attach(optimizer)
    with pytest.raises(RuntimeError, match=r"parameter emb\.weight .*outside"):
        default_loss(model(x)).backward()


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_disabled_hooks_give_the_ordinary_gradient_of_an_outside_use(mode):
    model, x = build(OutsideHead), tokens()
    plain = copy.deepcopy(model)
    default_loss(plain(x)).backward()
    _, module, _, _, _ = private(model, loader(x), mode, 0.1)
    module.disable_hooks()
    default_loss(module(x)).backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"{name}: {m}")


class BagOutside(nn.Module):
    """An EmbeddingBag on the tokens; its weight reused by ``F.linear`` outside it."""

    def __init__(self):
        super().__init__()
        self.first, self.mix = nn.EmbeddingBag(VOCAB, DIM, mode="mean"), nn.Linear(DIM, DIM)

    def forward(self, tokens):
        return F.linear(torch.tanh(self.mix(self.first(tokens))), self.first.weight)


class RMSNormOutside(nn.Module):
    """An RMSNorm on the (float) data; its weight reused by ``F.linear`` outside it."""

    def __init__(self):
        super().__init__()
        self.first, self.mix = nn.RMSNorm(DIM), nn.Linear(DIM, DIM)

    def forward(self, x):
        return F.linear(torch.tanh(self.mix(self.first(x))), self.first.weight.unsqueeze(0))


@pytest.mark.skipif(not hasattr(nn, "RMSNorm"), reason="nn.RMSNorm needs torch >= 2.4")
@pytest.mark.parametrize("first", ["embedding_bag", "rms_norm"])
@pytest.mark.parametrize("mode", ALL_MODES)
def test_first_layers_of_other_types_are_watched_too(mode, first):
    """EmbeddingBag and RMSNorm on data have their weight gradients switched off as well (they
    had been exempted for good, so an outside use of their weight went unseen)."""
    torch.manual_seed(3)
    if first == "embedding_bag":
        model, x = BagOutside(), tokens()
    else:
        model, x = RMSNormOutside(), torch.randn(BATCH, DIM)
    _, module, optimizer, criterion, _ = private(model, loader(x), mode, 0.1)
    with pytest.raises(RuntimeError, match=r"parameter first\.weight .*outside"):
        criterion(module(x)).backward()


def test_excuses_of_a_pass_with_hooks_disabled_end_at_the_step():
    """A non-private pass (hooks disabled) excuses the gradients it accumulates until the step
    consumes the batch; from the next batch on an outside use is refused again."""
    model, x = build(OutsideHead), tokens()
    _, module, optimizer, criterion, _ = private(model, loader(x), "bk", 0.1)
    module.disable_hooks()
    default_loss(module(x)).backward()  # an ordinary (non-private) pass
    module.enable_hooks()
    optimizer.zero_grad()
    criterion(module(x)).backward()
    optimizer.step()
    optimizer.zero_grad()
    with pytest.raises(RuntimeError, match=r"parameter emb\.weight .*outside"):
        criterion(module(x)).backward()


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, 1))

    def forward(self, x):
        return self.net(x)


@pytest.mark.parametrize("mode", ["hooks", "functorch", "bk"])
def test_hooks_disabled_around_a_forward_only_is_an_ordinary_pass(mode):
    """A GAN's generator step through a private discriminator, hooks off around the forward
    only (Opacus examples): the generator gets the plain gradient, nothing is refused."""
    torch.manual_seed(4)
    disc, gen = Discriminator(), nn.Linear(3, DIM)
    plain_disc, plain_gen = copy.deepcopy(disc), copy.deepcopy(gen)
    z = torch.randn(BATCH, 3)
    _, module, _, _, _ = private(disc, loader(torch.randn(BATCH, DIM)), mode, 0.1)
    module.disable_hooks()
    out = module(gen(z))
    module.enable_hooks()
    default_loss(out).backward()
    default_loss(plain_disc(plain_gen(z))).backward()
    for p, q in zip(gen.parameters(), plain_gen.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_a_forward_interrupted_inside_a_layer_leaves_nothing_switched_off(mode):
    """Ctrl-C inside a layer's forward skips torch's always_call hooks: the parameters the
    switch turned off get requires_grad back at the next forward, and train (``hooks``: with
    its opt-in ``skip_weight_grads``)."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, 2))
    x = torch.randn(BATCH, DIM)
    _, module, optimizer, criterion, _ = private(model, loader(x), mode, 0.1, skip_weight_grads=True,
                                                 check_sample_independence=False)  # no check's runs first
    first, forward = model[0], model[0].forward

    def interrupted(inputs):
        del first.forward  # once
        raise KeyboardInterrupt

    first.forward = interrupted
    with pytest.raises(KeyboardInterrupt):
        module(x)
    assert not first.weight.requires_grad, "the interrupt left the switch on (what is repaired)"
    assert first.forward == forward
    before = snapshot(model)
    optimizer.zero_grad()
    criterion(module(x)).backward()
    optimizer.step()
    assert all(p.requires_grad for p in model.parameters())
    assert all(not torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))


class Scaled(nn.Module):
    """A custom layer (the torch.func fallback)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(DIM))

    def forward(self, x):
        return x * self.w


class FallbackOutside(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.custom, self.lin = nn.Linear(DIM, DIM), Scaled(), nn.Linear(DIM, DIM)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        side = F.linear(h, self.lin.weight).sum(1, keepdim=True) + (h * self.custom.w).sum(1, keepdim=True)
        return self.lin(self.custom(h)) + side


@pytest.mark.parametrize("mode", ["hooks", "functorch", "bk"])
def test_uses_before_the_owner_call_are_refused_when_layers_are_recomputed(mode):
    """The torch.func fallback recomputes layers during the backward pass with copies of the
    parameters: that recomputation excuses nothing (it had hidden these outside uses)."""
    torch.manual_seed(6)
    model, x = FallbackOutside(), torch.randn(BATCH, DIM)
    _, module, _, criterion, _ = private(model, loader(x), mode, 0.1)
    with pytest.raises(RuntimeError, match=r"parameter (lin\.weight|custom\.w) .*outside"):
        criterion(module(x)).backward()


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_a_tensor_unfrozen_after_wrapping_is_watched(mode):
    model, x = build(OutsideHead), tokens()
    model.emb.weight.requires_grad_(False)
    _, module, optimizer, criterion, _ = private(model, loader(x), mode, 0.1)
    model.emb.weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"parameter emb\.weight .*outside"):
        criterion(module(x)).backward()
