"""``torch.amp.GradScaler`` with a :class:`~opacus_dp.optim.DPOptimizer` (float16 autocast).

The scaler multiplies the loss by its scale ``s``, so every per-sample gradient the step sees is
``s · g_i``. The optimizer declares ``_step_supports_amp_scaling`` and takes a ``grad_scaler``
keyword: ``scaler.step(optimizer)`` then calls ``optimizer.step(grad_scaler=scaler)`` and leaves
unscaling, the overflow check and the ``found_inf`` that ``scaler.update()`` reads to the
optimizer (torch's ``GradScaler.step``). The step

1. divides the norms by ``s`` before the clip factors and passes ``f_i / s`` to the clipped sums,
   so the contribution ``(f_i / s)(s g_i)`` has norm ≤ ``C`` in the gradient's own units (any
   public ``s`` keeps it ≤ ``C``: the bound never depends on ``s`` being right; ``s`` is a power
   of two by default, and the divisions are then exact);
2. drops a sample whose scaled gradient overflowed (NaN or inf norm, :mod:`.nonfinite`). The
   per-sample gradients ``s · g_i`` themselves do not overflow at torch's default ``s = 2¹⁶``
   (the mean undone, ``× B``, and the products with the layer inputs in float32:
   :func:`~opacus_dp.grad_sample.layer_call.per_sample_output_grads`, and the ``torch.func``
   fallback's power-of-two rescaling); only the model's own float16 backward can;
3. gives back a ``found_inf`` formed from released values only (the noised ``p.grad``) and from
   the public history of ``s``, so the scale's evolution is post-processing.

Torch's own ``found_inf`` would come from the overflow of ``p.grad`` before the step — the
ordinary, non-private gradient in the ``hooks``/``functorch`` modes — and its backoff would skip
a data-dependent step. Here the released gradient is finite (dropped samples add 0, the noise is
finite), so the scaler would never back off and would double ``s`` every ``growth_interval``
steps, making ever more samples overflow and be dropped, silently. Hence the ceiling: the scale
of the first scaled step is the highest used; when the scaler has grown ``s`` above it, the step
reports ``found_inf = 1`` and ``update()`` backs off (``s`` moves between the first scale and
``growth_factor`` times it, once per ``growth_interval`` steps). The parameter update still
happens; only a non-finite released gradient (never expected) skips it, as post-processing.

``scaler.unscale_(optimizer)`` before the step (e.g. for ``clip_grad_norm_``) only touches
``p.grad``, which the private step does not read and then overwrites; its ``found_inf`` is
replaced. Clipped sums formed during the backward pass (per-layer clipping in ``bk``/``ghost``,
the ``ghost`` two-pass ``loss.backward()``) used factors before ``s`` was known: refused.
"""

from contextlib import contextmanager
from typing import Iterator, List, Optional, Sequence

import torch

from opacus_dp.maths.per_sample import all_finite
from opacus_dp.module_parameters import local_part

ATTRIBUTE_CONTRACT = (
    "torch.amp.GradScaler set optimizer.grad_scale / found_inf instead of passing itself as "
    "step(grad_scaler=...): the scaler's update() would then read the overflow of p.grad before "
    "the private step (not private), and the step could not give it a private found_inf. Use a "
    "torch whose GradScaler passes itself to such optimizers (2.14 does), or bfloat16 autocast "
    "without a scaler; nothing was updated")
SUMS_IN_BACKWARD = (
    "torch.amp.GradScaler with clipped sums formed during the backward pass (per-layer clipping "
    "in the 'bk'/'ghost' modes, or the 'ghost' mode's two-pass loss.backward()): their clip "
    "factors came from norms still multiplied by the loss scale, known only at scaler.step(). Use "
    "flat clipping (in 'ghost': scaler.scale(loss.value).backward(), one book-keeping pass), the "
    "'hooks'/'functorch' modes (under FSDP2, where 'hooks' runs as 'bk': 'functorch'), or bfloat16 "
    "autocast without a scaler; nothing was updated")


def refuse_attribute_contract(optimizer) -> None:
    """RuntimeError if a GradScaler handed the step ``grad_scale``/``found_inf`` attributes."""
    if any(getattr(optimizer, name, None) is not None for name in ("grad_scale", "found_inf")):
        raise RuntimeError(ATTRIBUTE_CONTRACT)


def refuse_sums_formed_in_backward(source, scale: Optional[float]) -> None:
    """RuntimeError if in a scaled step (``scale`` not None) ``source`` forms clipped sums during
    the backward pass (the protocol's ``forms_sums_in_backward``; a source that formed some
    otherwise, as the ``ghost`` sums pass, refuses by itself within
    :func:`~opacus_dp.maths.per_sample.loss_scaled`)."""
    if scale is not None and source.forms_sums_in_backward:
        raise RuntimeError(SUMS_IN_BACKWARD)


def unscaled(tensors: Sequence[torch.Tensor], scale: Optional[float]) -> List[torch.Tensor]:
    """``t / s`` for each of ``tensors`` (themselves without a scale)."""
    return list(tensors) if scale is None else [t / scale for t in tensors]


def record_found_inf(grad_scaler, optimizer, found_inf: torch.Tensor) -> None:
    """``grad_scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]`` (private torch
    API): the flags ``scaler.update()`` adds up to decide the backoff. With the ``grad_scaler``
    keyword, ``scaler.step`` sets none itself: the optimizer's step records them."""
    grad_scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = {found_inf.device: found_inf}


def copy_found_inf(grad_scaler, source, target) -> None:
    """Give ``target``'s state in ``grad_scaler`` the ``found_inf`` recorded for ``source`` (the
    classic engine's patched optimizer steps through its DP optimizer)."""
    states = grad_scaler._per_optimizer_states
    states[id(target)]["found_inf_per_device"] = states[id(source)]["found_inf_per_device"]


class ScaledStep:
    """One ``step(grad_scaler=...)``: the scale ``s`` and the ceiling (module doc)."""

    def __init__(self, grad_scaler, ceiling: Optional[float]):
        self.grad_scaler = grad_scaler
        self.scale = float(grad_scaler.get_scale())
        if not self.scale > 0 or self.scale == float("inf"):
            raise ValueError(f"the GradScaler's scale must be positive and finite, got {self.scale}")
        self.ceiling = self.scale if ceiling is None else ceiling

    def give_back(self, optimizer, params: Sequence[torch.Tensor], stepped: bool) -> bool:
        """Record ``found_inf`` for ``scaler.update()``: 1 if the released gradient (``p.grad``
        of ``params`` after a step) is not finite or ``s`` is above the ceiling, else 0. Returns
        whether the inner optimizer may update (the released gradient is finite)."""
        released = [local_part(p.grad) for p in params if p.grad is not None] if stepped else []
        finite = all_finite(released)
        found = not finite or self.scale > self.ceiling
        device = released[0].device if released else torch.device("cpu")
        record_found_inf(self.grad_scaler, optimizer,
                         torch.full((), float(found), dtype=torch.float32, device=device))
        return finite


class ScalerBridge:
    """The optimizer's side of ``torch.amp.GradScaler`` (module doc): the scale of the step that is
    running (``None`` outside a scaled step) and the ceiling, the first scale of a scaled step."""

    def __init__(self):
        self.scale: Optional[float] = None
        self.ceiling: Optional[float] = None

    def begin(self, grad_scaler) -> Optional[ScaledStep]:
        """The scaled step of ``grad_scaler`` (None without one)."""
        return None if grad_scaler is None else ScaledStep(grad_scaler, self.ceiling)

    @contextmanager
    def scaling(self, scaled: Optional[ScaledStep]) -> Iterator[None]:
        """Within: :attr:`scale` is the step's scale."""
        self.scale = None if scaled is None else scaled.scale
        try:
            yield
        finally:
            self.scale = None

    def finish(self, scaled: Optional[ScaledStep], optimizer, params, stepped: bool) -> bool:
        """Give the scaler its ``found_inf``; whether the inner optimizer updates."""
        if scaled is None:
            return stepped
        self.ceiling = scaled.ceiling
        return scaled.give_back(optimizer, params, stepped) and stepped
