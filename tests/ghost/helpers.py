"""Oracles for the norms-only modes: per-sample gradients from batch-size-1 autograd passes.

Norms and clipped sums are computed here from the oracle's per-sample gradients; nothing of
the code under test is used.
"""

from typing import Dict, List, Sequence

import torch
import torch.nn as nn

from tests.grad_sample.oracle import default_loss, oracle_grad_samples, trainable


def layer_call(layer: nn.Module, x: torch.Tensor):
    """``(activations, backprops, oracle)`` of one call: backprops of ``default_loss`` (a sum
    over samples) w.r.t. the output, and the oracle per-sample gradients ``{param: (B, ...)}``."""
    out = layer(x)
    out_leaf = out.detach().requires_grad_(True)
    (backprops,) = torch.autograd.grad(default_loss(out_leaf), [out_leaf])
    named = oracle_grad_samples(layer, (x,))
    return [x], backprops, {p: named[n] for n, p in trainable(layer)}


def sq_norms(grad_samples: torch.Tensor) -> torch.Tensor:
    return grad_samples.reshape(grad_samples.shape[0], -1).pow(2).sum(dim=1)


def weighted(factors: torch.Tensor, grad_samples: torch.Tensor) -> torch.Tensor:
    return torch.einsum("i,i...->...", factors.to(grad_samples.dtype), grad_samples)


def model_oracle(model: nn.Module, inputs: Sequence, batch_dim: int = 0) -> Dict[str, torch.Tensor]:
    """``{name: (B, *shape)}`` per-sample gradients of ``default_loss(model(*inputs))``."""
    return oracle_grad_samples(model, tuple(inputs), batch_dim=batch_dim)


def run_backward(wrapper: nn.Module, inputs: Sequence, loss_reduction: str, batch_size: int) -> None:
    loss = default_loss(wrapper(*inputs))
    (loss / batch_size if loss_reduction == "mean" else loss).backward()


def assert_norms_and_sums(wrapper, oracle: Dict[str, torch.Tensor], seed: int = 0,
                          rtol: float = 1e-9, atol: float = 1e-10) -> List[torch.Tensor]:
    """Compare ``per_sample_norms`` and ``clipped_sums`` (random factors) with the oracle."""
    names = [n for n, _ in wrapper.trainable_parameters()]
    params = [p for _, p in wrapper.trainable_parameters()]
    norms = wrapper.per_sample_norms(params)
    g = torch.Generator().manual_seed(seed)
    factors = [torch.rand(n.shape[0], generator=g, dtype=n.dtype) for n in norms]
    sums = wrapper.clipped_sums(params, factors)
    for name, norm, total, f in zip(names, norms, sums, factors):
        expected = oracle[name]
        torch.testing.assert_close(norm, sq_norms(expected).sqrt(), rtol=rtol, atol=atol,
                                   msg=lambda m: f"norm of {name}: {m}")
        torch.testing.assert_close(total, weighted(f, expected), rtol=rtol, atol=atol,
                                   msg=lambda m: f"clipped sum of {name}: {m}")
    return norms


def per_step(model: nn.Module) -> None:
    """Make the recurrent layers' steps call ``hh`` (hooked per step) instead of the wrapper's
    joined call: the cells' recorders removed (:mod:`opacus_dp.layers.joined_steps`)."""
    from opacus_dp.layers import joined_steps

    for cell in model.modules():
        joined_steps._RECORDERS.pop(cell, None)


def private_update(model: nn.Module, loader, mode: str, bound: float, batch: int, prepare=None,
                   **private) -> List[torch.Tensor]:
    """``before − after`` of each parameter after one ``make_private`` SGD step (lr 1, σ 0, flat
    bound ``bound``, loss ``default_loss / batch``) on the loader's first batch, ``prepare``d."""
    import warnings

    from opacus_dp import PrivacyEngine

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = PrivacyEngine(accountant="rdp").make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), data_loader=loader,
            noise_multiplier=0.0, max_grad_norm=bound, poisson_sampling=False, grad_sample_mode=mode,
            criterion=lambda out, *_: default_loss(out) / batch, **private)
    wrapper, optimizer, loader = result[0], result[1], result[-1]
    criterion = result[2] if mode == "ghost" else (lambda out: default_loss(out) / batch)
    before = [p.detach().clone() for p in model.parameters()]
    (xb,) = next(iter(loader))
    criterion(wrapper(xb if prepare is None else prepare(xb))).backward()
    optimizer.step()
    return [b - p.detach() for b, p in zip(before, model.parameters())]
