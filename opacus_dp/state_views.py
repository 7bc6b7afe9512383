"""How a step's per-sample state is shown on the parameters: each Opacus generation's lifecycle.

``p.grad_sample`` holds the per-sample gradients ``g_il`` of the backward passes not yet
stepped on; ``p.summed_grad`` the clipped sum ``S_l = Σ_i f_il g_il`` (before noise and the
``mean`` division). In the hooks and functorch modes ``p.grad`` holds autograd's ordinary,
non-private gradient after ``loss.backward()``; the step replaces it with the private one.

============================  =============================  ==================================
after …                       Opacus 1.x (``make_private``)  Opacus 0.x (``attach``)
============================  =============================  ==================================
wrapping                      ``p.grad_sample = None``,       neither attribute exists
                              ``p.summed_grad = None``
``loss.backward()``           ``p.grad_sample``: ``(B, …)``   the same
``virtual_step()`` / a        ``p.summed_grad``: ``S_l`` so   ``p.summed_grad``: ``S_l`` so far;
skipped ``step()``            far; ``p.grad_sample`` kept     ``p.grad_sample`` deleted
``step()``                    both kept (``summed_grad``:     both deleted
                              the step's ``S_l``)
``zero_grad()``               both None (``summed_grad``      both deleted
                              kept after a skipped step)
============================  =============================  ==================================

A per-sample gradient a step has taken stays readable (1.x) but is marked *consumed*: it is
never taken again (a second ``step()`` without a backward pass is refused) and the next
backward pass replaces it instead of joining it. A leaf module: the optimizer and the
per-sample gradient store both import it.
"""

from dataclasses import dataclass
from typing import List, Optional

import torch

_CONSUMED = "_opacus_dp_consumed"
_PASSES = "_opacus_dp_passes"


def mark_consumed(tensor: torch.Tensor) -> None:
    """Mark a per-sample gradient as taken by a step (it is kept only to be read)."""
    setattr(tensor, _CONSUMED, True)


def is_consumed(value) -> bool:
    """Whether ``value`` is a per-sample gradient a step has already taken."""
    return isinstance(value, torch.Tensor) and getattr(value, _CONSUMED, False)


def mark_passes(tensor: torch.Tensor, passes: int) -> None:
    """Record that ``tensor`` concatenates the per-sample gradients of ``passes`` backward passes."""
    setattr(tensor, _PASSES, passes)


def passes_of(value) -> int:
    """The backward passes (batches) a ``p.grad_sample`` value holds: those recorded by
    :func:`mark_passes`, a list's length (Opacus 1.x), else 1."""
    if isinstance(value, (list, tuple)):
        return len(value)
    return int(getattr(value, _PASSES, 1))


@dataclass(frozen=True)
class StateViews:
    """One generation's lifecycle of ``p.grad_sample`` / ``p.summed_grad`` (module table)."""

    generation: str
    keeps_after_step: bool  # 1.x: the step's state stays readable until zero_grad()
    deletes_absent: bool  # 0.x: an absent value is a missing attribute, not None

    def show(self, param: torch.Tensor, name: str, value: Optional[torch.Tensor]) -> None:
        """``param.<name> = value``; an absent value (None) as this generation shows it."""
        if value is not None:
            setattr(param, name, value)
        elif self.deletes_absent:
            param.__dict__.pop(name, None)
        else:
            setattr(param, name, None)

    def hide(self, param: torch.Tensor, name: str) -> None:
        """Show ``param.<name>`` as absent."""
        self.show(param, name, None)


def remove_views(param_groups: List[dict], name: str) -> None:
    """Delete the attribute ``name`` from every parameter of ``param_groups`` (an optimizer's)."""
    for group in param_groups:
        for param in group["params"]:
            param.__dict__.pop(name, None)


OPACUS_1X = StateViews("1.x", keeps_after_step=True, deletes_absent=False)
OPACUS_0X = StateViews("0.x", keeps_after_step=False, deletes_absent=True)
