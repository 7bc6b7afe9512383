"""Every trainable tensor's update is clipped (flat, over ALL tensors of a sample) and noised;
nothing else is ever updated from data.

Oracle: per-sample gradients by autograd on batches of one, clipped by hand
(σ = 0 and a small C, so that clipping is active and the update is deterministic).
"""

import pytest
import torch
import torch.nn as nn

from opacus_dp.errors import UnsupportedModuleError

from tests.review.helpers import (
    flat_clipped_sum,
    loss_of,
    make_private,
    per_sample_grads,
    tiny_model,
)

C, LR = 0.05, 1.0


def expected_after_step(gsm, x, y, expected_batch_size):
    """``p - lr · Σ_i clip(g_i) / E|B|`` for the trainable parameters (others unchanged)."""
    model = gsm._module
    trainable = [p for p in model.parameters() if p.requires_grad]
    gsm.disable_hooks()
    grads = per_sample_grads(model, x, y)
    gsm.enable_hooks()
    assert max(float(g.reshape(len(g), -1).norm(dim=1).max()) for g in grads) > C
    clipped = flat_clipped_sum(grads, C)
    update = {id(p): LR * s / expected_batch_size for p, s in zip(trainable, clipped)}
    return [p.detach() - update.get(id(p), 0.0) for p in model.parameters()]


def assert_params(model, expected):
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.detach(), e, rtol=1e-9, atol=1e-12)


def test_parameter_frozen_between_backward_and_step_keeps_its_value():
    model = tiny_model()
    engine, gsm, optimizer, loader = make_private(model, noise_multiplier=0.0, max_grad_norm=C, lr=LR)
    x, y = next(iter(loader))
    first = model[0].weight.detach().clone()
    loss_of(gsm, x, y).backward()
    model[0].requires_grad_(False)
    optimizer.step()
    assert torch.equal(model[0].weight.detach(), first)


def test_parameter_unfrozen_after_make_private_is_clipped_with_the_others():
    model = tiny_model()
    model[0].requires_grad_(False)
    engine, gsm, optimizer, loader = make_private(model, noise_multiplier=0.0, max_grad_norm=C, lr=LR)
    x, y = next(iter(loader))
    model[0].requires_grad_(True)
    expected = expected_after_step(gsm, x, y, optimizer.expected_batch_size)
    loss_of(gsm, x, y).backward()
    optimizer.step()
    assert_params(model, expected)


def test_parameter_group_added_later_is_clipped_with_the_others():
    model = tiny_model()
    engine, gsm, optimizer, loader = make_private(model, noise_multiplier=0.0, max_grad_norm=C, lr=LR)
    extra = nn.Linear(2, 2).double()
    optimizer.add_param_group({"params": list(extra.parameters())})
    x, y = next(iter(loader))
    loss_of(gsm, x, y).backward()
    with pytest.raises(ValueError, match="no per-sample gradient"):
        # extra is not part of the private model: its unclipped gradient must not be used
        extra(torch.ones(1, 2, dtype=torch.float64)).sum().backward()
        optimizer.step()


def test_model_called_directly_in_eval_mode_is_still_clipped():
    """The hooks sit on the user's layers: calling the model (not the wrapper), in eval mode."""
    model = tiny_model()
    engine, gsm, optimizer, loader = make_private(model, noise_multiplier=0.0, max_grad_norm=C, lr=LR)
    model.eval()
    x, y = next(iter(loader))
    expected = expected_after_step(gsm, x, y, optimizer.expected_batch_size)
    loss_of(model, x, y).backward()
    optimizer.step()
    assert_params(model, expected)


class Tied(nn.Module):
    """Encoder and decoder share one weight; the encoder is also applied twice."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.enc = nn.Linear(4, 3, bias=False).double()
        self.dec = nn.Linear(3, 4).double()
        self.dec.weight = nn.Parameter(self.enc.weight.detach().t().clone())
        self.head = nn.Linear(4, 2).double()
        self.enc2 = self.enc

    def forward(self, x):
        return self.head(self.dec(torch.tanh(self.enc(x))) + self.enc2(x).sum(1, keepdim=True))


def test_shared_parameters_are_clipped_on_their_whole_per_sample_gradient():
    model = Tied()
    engine, gsm, optimizer, loader = make_private(model, noise_multiplier=0.0, max_grad_norm=C, lr=LR)
    x, y = next(iter(loader))
    expected = expected_after_step(gsm, x, y, optimizer.expected_batch_size)
    loss_of(gsm, x, y).backward()
    optimizer.step()
    assert_params(model, expected)


def test_forward_without_grad_cannot_step():
    model = tiny_model()
    engine, gsm, optimizer, loader = make_private(model)
    x, y = next(iter(loader))
    with torch.no_grad():
        gsm(x)
    with pytest.raises(RuntimeError, match="no per-sample gradients"):
        optimizer.step()
    assert len(engine.accountant) == 0


class FrozenRenormedEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4, max_norm=1.0).double()
        with torch.no_grad():
            self.emb.weight.mul_(10.0)
        self.emb.requires_grad_(False)
        self.head = nn.Linear(4, 2).double()

    def forward(self, tokens):
        return self.head(self.emb(tokens))


def test_frozen_embedding_renormalised_by_the_data_is_refused():
    """``max_norm`` rewrites the looked-up rows in place, without noise: the rows a batch used
    become visible in the weights, even when the embedding is frozen."""
    model = FrozenRenormedEmbedding()
    with pytest.raises(UnsupportedModuleError, match="max_norm"):
        make_private(model)
