"""Independent single-process reference for DP-SGD with σ = 0: per-sample gradients from
an autograd loop over batch-size-1 samples, clipped by hand, averaged over the *global*
expected batch size, applied with plain SGD.

Clip factor (Abadi et al. 2016): ``min(1, C / (‖g‖ + 1e-6))`` with ``‖g‖`` over all
parameters (flat) or per parameter tensor with its own bound (per-layer).
"""

from typing import Callable, List, Sequence, Union

import torch
import torch.nn as nn


def per_sample_grads(model: nn.Module, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor):
    """``[[g_i for each param] for each sample i]`` of the per-sample loss ``loss_fn(f(x_i), y_i)``."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = []
    for i in range(x.shape[0]):
        loss = loss_fn(model(x[i : i + 1]), y[i : i + 1])
        grads.append([g.detach() for g in torch.autograd.grad(loss, params)])
    return grads


def clipped_sum(grads, max_grad_norm: Union[float, Sequence[float]], params) -> List[torch.Tensor]:
    """``Σ_i f_i · g_i`` with flat or per-layer clip factors."""
    total = [torch.zeros_like(p) for p in params]
    for sample in grads:
        if isinstance(max_grad_norm, (list, tuple)):
            factors = [min(1.0, c / (g.norm().item() + 1e-6)) for g, c in zip(sample, max_grad_norm)]
        else:
            norm = torch.sqrt(sum(g.pow(2).sum() for g in sample)).item()
            factors = [min(1.0, max_grad_norm / (norm + 1e-6))] * len(sample)
        for t, g, f in zip(total, sample, factors):
            t.add_(f * g)
    return total


def clipped_mean_update(model, loss_fn, x, y, max_grad_norm, global_batch_size: float):
    """The σ = 0 DP-SGD gradient of one logical batch ``(x, y)``: clipped sum / B_global."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [s / global_batch_size for s in clipped_sum(per_sample_grads(model, loss_fn, x, y),
                                                        max_grad_norm, params)]


@torch.no_grad()
def sgd_step(model: nn.Module, update: List[torch.Tensor], lr: float) -> None:
    """``p ← p − lr · update`` for the trainable parameters of ``model``."""
    for p, u in zip([p for p in model.parameters() if p.requires_grad], update):
        p.sub_(lr * u)


def replay_on_one_process(model: nn.Module, reports, max_grad_norm, lr: float) -> List[torch.Tensor]:
    """σ = 0 reference: ``model`` set to the ranks' starting parameters, then SGD on the ranks'
    pieces of each logical step concatenated (empty pieces included), cross-entropy, clipped mean
    over ``reports[0]["global_batch"]``."""
    with torch.no_grad():
        for p, value in zip(model.parameters(), reports[0]["start"]):
            p.copy_(value)
    for step in range(len(reports[0]["batches"])):
        pieces = [piece for r in reports for piece in r["batches"][step]]
        x = torch.cat([x for x, _ in pieces])
        y = torch.cat([y for _, y in pieces])
        update = clipped_mean_update(model, nn.CrossEntropyLoss(), x, y, max_grad_norm, reports[0]["global_batch"])
        sgd_step(model, update, lr)
    return [p.detach() for p in model.parameters()]
