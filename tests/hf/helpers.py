"""One private step (σ = 0, clipping active) against a microbatch oracle.

``oracle_update`` differentiates each sample's loss alone (autograd on a batch of one), clips
the flat per-sample gradient to ``C`` and averages over the batch; nothing of ``opacus_dp`` is
used. ``private_update`` runs ``PrivacyEngine().make_private`` in a given mode on the same model
and returns the update of one SGD step with learning rate 1 (the DP gradient).
"""

import warnings
from typing import Callable, Dict

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp import PrivacyEngine
from tests.engine.helpers import clipped_sum_oracle

MODES = ["hooks", "functorch", "ghost", "bk"]

# loss(model, criterion, rows) -> scalar: the mean over the samples ``rows`` of their losses;
# ``criterion`` is nn.CrossEntropyLoss() or the ghost mode's GhostCriterion around it.
LossFn = Callable[[nn.Module, Callable, slice], torch.Tensor]


def named_trainable(model: nn.Module):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def oracle_grads(model: nn.Module, loss_fn: LossFn, batch_size: int):
    """``[(name, (B, *shape))]``: each sample's gradient, by autograd on that sample alone."""
    named = named_trainable(model)
    rows = []
    for i in range(batch_size):
        loss = loss_fn(model, nn.CrossEntropyLoss(), slice(i, i + 1))
        rows.append(torch.autograd.grad(loss, [p for _, p in named], allow_unused=True))
    return [(n, torch.stack([torch.zeros_like(p) if r[j] is None else r[j] for r in rows]))
            for j, (n, p) in enumerate(named)]


def flat_norms(grads) -> torch.Tensor:
    batch_size = grads[0][1].shape[0]
    return torch.sqrt(sum(g.reshape(batch_size, -1).pow(2).sum(1) for _, g in grads))


def oracle_update(grads, bound: float) -> Dict[str, torch.Tensor]:
    """``{name: Σ_i clip_C(g_i) / B}`` (flat clipping, the engine's factor ``min(1, C/(‖g_i‖+1e-6))``)."""
    batch_size = grads[0][1].shape[0]
    sums = clipped_sum_oracle([g for _, g in grads], bound, per_layer=False)
    return {n: s / batch_size for (n, _), s in zip(grads, sums)}


def private_update(model: nn.Module, loss_fn: LossFn, batch_size: int, bound: float,
                   mode: str) -> Dict[str, torch.Tensor]:
    """The DP gradient of one σ = 0 step of ``mode`` on the whole batch (read from the update)."""
    before = {n: p.detach().clone() for n, p in named_trainable(model)}
    loader = DataLoader(TensorDataset(torch.arange(batch_size)), batch_size=batch_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), data_loader=loader,
            noise_multiplier=0.0, max_grad_norm=bound, poisson_sampling=False,
            grad_sample_mode=mode, criterion=nn.CrossEntropyLoss())
    wrapper, optimizer = result[0], result[1]
    criterion = result[2] if mode == "ghost" else nn.CrossEntropyLoss()
    try:
        loss_fn(wrapper, criterion, slice(0, batch_size)).backward()
        optimizer.step()
    finally:
        wrapper.close()
    return {n: before[n] - p.detach() for n, p in named_trainable(model)}


def assert_private_step_matches_oracle(make_model: Callable[[], nn.Module], loss_fn: LossFn,
                                       batch_size: int, mode: str, rtol: float = 1e-6) -> None:
    """One private step of ``mode`` equals the oracle within ``rtol`` of the largest entry."""
    model = make_model()
    grads = oracle_grads(model, loss_fn, batch_size)
    norms = flat_norms(grads)
    bound = float(norms.min() + norms.max()) / 2  # clipping binds for some samples, not all
    expected = oracle_update(grads, bound)
    got = private_update(model, loss_fn, batch_size, bound, mode)
    scale = max(float(t.abs().max()) for t in expected.values())
    assert scale > 0
    for name, want in expected.items():
        error = float((got[name] - want).abs().max())
        assert error <= rtol * scale, f"{mode}: {name} differs by {error:.3g} (scale {scale:.3g})"


def oracle_step(model: nn.Module, loss_fn: LossFn, batch_size: int):
    """``(expected update, bound, scale)`` of one σ = 0 step on ``model``: the bound lies between
    the smallest and largest per-sample norm (clipping binds for some samples, not all), and
    ``scale`` is the largest entry of the expected update (the unit of the tolerance)."""
    grads = oracle_grads(model, loss_fn, batch_size)
    norms = flat_norms(grads)
    bound = float(norms.min() + norms.max()) / 2
    expected = oracle_update(grads, bound)
    scale = max(float(t.abs().max()) for t in expected.values())
    assert scale > 0 and float(norms.min()) < bound < float(norms.max())
    return expected, bound, scale


def assert_update_matches(expected: Dict[str, torch.Tensor], got: Dict[str, torch.Tensor],
                          scale: float, rtol: float, label: str) -> None:
    """Every tensor of ``got`` within ``rtol · scale`` of ``expected`` (max abs error)."""
    assert got.keys() == expected.keys(), f"{label}: trainable tensors differ"
    for name, want in expected.items():
        error = float((got[name] - want).abs().max())
        assert error <= rtol * scale, f"{label}: {name} differs by {error:.3g} (scale {scale:.3g})"
