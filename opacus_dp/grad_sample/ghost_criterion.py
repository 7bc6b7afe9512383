"""The criterion ``make_private(..., grad_sample_mode="ghost")`` returns (Opacus 1.6 API).

Opacus 1.6 returns ``(model, optimizer, criterion, data_loader)`` in ghost mode; its criterion
runs two backward passes. Here the ghost mode needs one (the clipped sum is book-kept), so
:class:`GhostCriterion` returns the ordinary loss of the wrapped criterion, with one
Opacus feature kept: ``criterion(logits, target, shape=(B, T, V))`` for token-level losses of
sequence models makes the loss of sample ``i`` the mean over its valid tokens (``target !=
ignore_index``), and the batch loss the mean (or sum, per ``loss_reduction``) of those.
"""

from typing import Optional, Sequence

import torch


class GhostCriterion:
    """Callable wrapper of ``criterion`` (any loss module with a ``reduction`` attribute)."""

    def __init__(self, criterion, loss_reduction: str = "mean"):
        if not callable(criterion):
            raise TypeError(f"criterion must be callable (a loss module), got {type(criterion).__name__}")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        reduction = getattr(criterion, "reduction", loss_reduction)
        if reduction != loss_reduction:
            raise ValueError(
                f"criterion.reduction is {reduction!r} but loss_reduction is {loss_reduction!r}: "
                "they must agree (the per-sample gradients undo the loss's reduction)"
            )
        self.criterion = criterion
        self.loss_reduction = loss_reduction

    def __call__(self, *args, shape: Optional[Sequence[int]] = None, **kwargs) -> torch.Tensor:
        if shape is None:
            return self.criterion(*args, **kwargs)
        per_token = self._unreduced(*args, **kwargs).view(shape[0], shape[1])
        target = kwargs.get("target", args[1] if len(args) > 1 else None)
        ignore_index = getattr(self.criterion, "ignore_index", None)
        if ignore_index is not None and target is not None:
            valid = (target.reshape(shape[0], shape[1]) != ignore_index).sum(dim=1).clamp(min=1)
        else:
            valid = torch.full((shape[0],), shape[1], device=per_token.device)
        per_sample = per_token.sum(dim=1) / valid.to(per_token.dtype)
        return per_sample.mean() if self.loss_reduction == "mean" else per_sample.sum()

    def _unreduced(self, *args, **kwargs) -> torch.Tensor:
        if not hasattr(self.criterion, "reduction"):
            raise ValueError("shape= needs a criterion with a 'reduction' attribute (a torch loss module)")
        previous = self.criterion.reduction
        self.criterion.reduction = "none"
        try:
            return self.criterion(*args, **kwargs)
        finally:
            self.criterion.reduction = previous

    def __repr__(self):
        return f"GhostCriterion({self.criterion!r}, loss_reduction={self.loss_reduction!r})"
