"""Independent per-sample gradient oracle: one autograd pass per sample (float64).

``oracle_grad_samples`` runs ``model`` on each sample alone (a batch of one, sliced along
the batch dimension) and differentiates that sample's loss with ``torch.autograd.grad``.
Nothing of ``opacus_dp`` is used, so it can check every per-sample gradient path.
"""

from typing import Callable, Dict, List, Sequence, Tuple

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves


def default_loss(output) -> torch.Tensor:
    """A nonlinear per-sample loss: sum over float outputs of ``t**2 / 2 + 0.3 t``."""
    total = 0
    for t in tree_leaves(output):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            total = total + (0.5 * t * t + 0.3 * t).sum()
    return total


def trainable(model: nn.Module) -> List[Tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def oracle_from_samples(
    model: nn.Module,
    samples: Sequence[Tuple[tuple, dict]],
    loss_fn: Callable = default_loss,
) -> Dict[str, torch.Tensor]:
    """``{name: (B, *shape)}``: gradient of ``loss_fn(model(*args_i, **kwargs_i))`` per sample."""
    named = trainable(model)
    rows: Dict[str, List[torch.Tensor]] = {n: [] for n, _ in named}
    for args, kwargs in samples:
        loss = loss_fn(model(*args, **kwargs))
        grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
        for (name, param), g in zip(named, grads):
            rows[name].append(torch.zeros_like(param) if g is None else g)
    return {
        n: torch.stack(r) if r else torch.zeros(0, *p.shape, dtype=p.dtype)
        for (n, p), r in zip(named, rows.values())
    }


def oracle_grad_samples(
    model: nn.Module,
    args: tuple,
    kwargs: dict = None,
    batch_dim: int = 0,
    loss_fn: Callable = default_loss,
) -> Dict[str, torch.Tensor]:
    """Oracle for batched tensor inputs: sample ``i`` is slice ``i`` along ``batch_dim``."""
    kwargs = kwargs or {}
    first = next(t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
    cut = lambda v, i: v.narrow(batch_dim, i, 1) if isinstance(v, torch.Tensor) else v  # noqa: E731
    samples = [
        (tuple(cut(a, i) for a in args), {k: cut(v, i) for k, v in kwargs.items()})
        for i in range(first.shape[batch_dim])
    ]
    return oracle_from_samples(model, samples, loss_fn)


def batch_loss(output, batch_size: int, loss_reduction: str, loss_fn: Callable = default_loss):
    """The batch loss matching ``loss_reduction`` (sum of per-sample losses, or their mean)."""
    loss = loss_fn(output)
    return loss / batch_size if loss_reduction == "mean" else loss


def gsm_grad_samples(
    model: nn.Module,
    args: tuple,
    kwargs: dict = None,
    *,
    loss_reduction: str = "mean",
    batch_first: bool = True,
    force_functorch: bool = False,
    loss_fn: Callable = default_loss,
    batch_size: int = None,
) -> Dict[str, torch.Tensor]:
    """Per-sample gradients from ``GradSampleModule`` (closed again afterwards)."""
    from opacus_dp.grad_sample import GradSampleModule

    gsm = GradSampleModule(
        model,
        batch_first=batch_first,
        loss_reduction=loss_reduction,
        force_functorch=force_functorch,
    )
    try:
        output = gsm(*args, **(kwargs or {}))
        if batch_size is None:
            first = next(t for t in tree_leaves(args) if isinstance(t, torch.Tensor))
            batch_size = first.shape[0 if batch_first else 1]
        batch_loss(output, batch_size, loss_reduction, loss_fn).backward()
        return {n: p.grad_sample for n, p in gsm.trainable_parameters()}
    finally:
        gsm.close()


def assert_grad_samples_close(actual, expected, atol=1e-10, rtol=1e-9):
    assert actual.keys() == expected.keys(), (actual.keys(), expected.keys())
    for name in expected:
        a, e = actual[name], expected[name]
        assert a is not None, f"{name}: no grad_sample"
        assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)} != {tuple(e.shape)}"
        torch.testing.assert_close(a, e, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")
