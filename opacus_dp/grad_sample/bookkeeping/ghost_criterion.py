"""The criterion ``make_private(..., grad_sample_mode="ghost")`` returns (Opacus 1.6 API).

As in Opacus 1.6, ghost mode returns ``(model, optimizer, criterion, data_loader)`` and the
criterion's loss has a ``backward()`` that runs two backward passes over the same graph:

1. a *norms pass*: every layer's per-sample gradient norm is computed as soon as its output
   gradient arrives (ghost identity or materialised, per layer) and the output gradients of
   ghost layers are dropped;
2. the clip factors ``f_i`` follow from the norms (the optimizer's clipper, through the
   :class:`StepClipping` callbacks the engine gives: no optimizer attribute is read here);
3. a *sums pass* recomputes the output gradients and turns each ghost layer's into its
   clipped sum ``Σ_i f_i g_i`` at once.

Nothing of the size of the layer outputs is kept between the passes, but the forward graph
is retained for the second one, so the peak memory is close to the ``bk`` mode's; the price is
the second backward. ``optimizer.step()`` then uses the norms and sums as in the ``bk`` mode.
Calling ``backward()`` on a plain tensor instead (or under ``DistributedDataParallel``) runs
one book-keeping pass, which is equally correct; so does per-layer clipping, where each
layer's clipped sum is finished within that one pass (its factors need only its own norms).

``criterion(logits, target, shape=(B, T, V))`` keeps one Opacus feature for token-level losses
of sequence models: the loss of sample ``i`` is the mean over its valid tokens (``target !=
ignore_index``), and the batch loss the mean (or sum, per ``loss_reduction``) of those.
"""

from typing import Callable, List, NamedTuple, Optional, Sequence

import torch

from opacus_dp.grad_sample.bookkeeping.module import BookkeepingGradSampleModule


NOT_A_TENSOR = (
    "the loss of grad_sample_mode='ghost' (GhostLoss) is not a tensor, so it cannot be passed to "
    "scaler.scale() or iterated. Call loss.backward() on it directly (the two-pass backward), or, "
    "with torch.amp.GradScaler, scale its tensor: scaler.scale(loss.value).backward() (one "
    "book-keeping pass, the same update), then scaler.step(optimizer) and scaler.update()")


class StepClipping(NamedTuple):
    """What the two-pass backward needs of the optimizer's clipping, as callables:
    ``params()``, the trainable tensors ``l`` in the optimizer's order, and
    ``clip_factors(params, norms)``, the factors ``f_il`` from the per-sample norms ``n_il``."""

    params: Callable[[], List[torch.Tensor]]
    clip_factors: Callable[[List[torch.Tensor], List[torch.Tensor]], List[torch.Tensor]]


def _backward_keeping_graph(value: torch.Tensor) -> None:
    """``value.backward(retain_graph=True)``, with the way out named when the graph cannot be
    kept (a ``torch.compile``d backward with donated buffers refuses ``retain_graph``)."""
    try:
        value.backward(retain_graph=True)
    except RuntimeError as error:
        if "donated buffer" not in str(error):
            raise
        raise RuntimeError(
            "grad_sample_mode='ghost' runs two backward passes through the same graph "
            "(retain_graph=True), which this torch.compile'd model's backward does not allow "
            "(donated buffers). Compile the private model instead (private_model.compile(): the ghost "
            "loss then runs one pass), use grad_sample_mode='bk' (one backward pass, the same clipped "
            "update), or set torch._functorch.config.donated_buffer = False before compiling"
        ) from error


class GhostLoss:
    """A scalar loss whose :meth:`backward` is the two-pass backward (module doc)."""

    def __init__(self, value: torch.Tensor, module, clipping: Optional[StepClipping]):
        self.value, self.module, self.clipping = value, module, clipping

    def backward(self) -> None:
        """Two passes where they help; one where the source forms the sums during backward
        (per-layer clipping) or cannot run two (module doc)."""
        module, clipping = self.module, self.clipping
        if clipping is None or not isinstance(module, BookkeepingGradSampleModule) \
                or not module.supports_two_passes or module.forms_sums_in_backward:
            self.value.backward()
            return
        params = clipping.params()
        passes = module.num_passes
        with module.norms_pass():
            _backward_keeping_graph(self.value)
        if module.num_passes == passes:
            return  # no layer call reached the loss (an empty batch): nothing to sum
        factors = clipping.clip_factors(params, module.last_per_sample_norms(params))
        with module.sums_pass(params, factors):
            self.value.backward()

    def _new(self, value) -> "GhostLoss":
        return GhostLoss(value, self.module, self.clipping)

    @staticmethod
    def _raw(other):
        return other.value if isinstance(other, GhostLoss) else other

    def __add__(self, other):
        return self._new(self.value + self._raw(other))

    __radd__ = __add__

    def __sub__(self, other):
        return self._new(self.value - self._raw(other))

    def __rsub__(self, other):
        return self._new(self._raw(other) - self.value)

    def __mul__(self, other):
        return self._new(self.value * self._raw(other))

    __rmul__ = __mul__

    def __truediv__(self, other):
        return self._new(self.value / self._raw(other))

    def __neg__(self):
        return self._new(-self.value)

    def detach(self) -> torch.Tensor:
        return self.value.detach()

    def item(self) -> float:
        return self.value.item()

    def __float__(self) -> float:
        return float(self.value)

    def __iter__(self):
        """A scalar loss is not iterable. ``torch.amp.GradScaler.scale`` takes anything that is
        not a tensor for an iterable of tensors and comes here: say what to do instead."""
        raise TypeError(NOT_A_TENSOR)

    def __repr__(self):
        return f"GhostLoss({self.value.item():.4f})"


class GhostCriterion:
    """Callable wrapper of ``criterion`` (any loss module with a ``reduction`` attribute).

    ``module`` (the norms-only wrapper) and ``clipping`` (the optimizer's
    :class:`StepClipping`), both set by ``make_private``, enable the two-pass backward;
    without them the plain loss tensor is returned.
    """

    def __init__(self, criterion, loss_reduction: str = "mean", module=None,
                 clipping: Optional[StepClipping] = None):
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
        self.criterion, self.loss_reduction = criterion, loss_reduction
        self.module, self.clipping = module, clipping

    def __call__(self, *args, shape: Optional[Sequence[int]] = None, **kwargs):
        value = self.criterion(*args, **kwargs) if shape is None else self._per_sequence(shape, args, kwargs)
        if self.module is None or self.clipping is None:
            return value
        return GhostLoss(value, self.module, self.clipping)

    def _per_sequence(self, shape, args, kwargs) -> torch.Tensor:
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
