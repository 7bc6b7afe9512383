"""Opacus 1.6's fast-gradient-clipping API, on the ``ghost`` mode (compatibility path).

Opacus users write, instead of ``make_private(..., grad_sample_mode="ghost")``::

    model = GradSampleModuleFastGradientClipping(model, max_grad_norm=C, use_ghost_clipping=True)
    optimizer = DPOptimizerFastGradientClipping(optimizer, noise_multiplier=σ, max_grad_norm=C,
                                                expected_batch_size=B)
    criterion = DPLossFastGradientClipping(model, optimizer, criterion)
    criterion(model(x), y).backward(); optimizer.step()

Here the module is the ``ghost`` mode's wrapper (per layer the cheaper of the ghost norm and the
materialised per-sample gradient, whatever ``use_ghost_clipping`` says: the clipped sums are the
same), the loss wrapper is the ``ghost`` criterion, and it connects the optimizer to the
module's norms. Opacus keeps two clipping bounds, the module's (clipping) and the optimizer's
(noise), and calibrates the noise to the second whatever the first is; here the loss wrapper
refuses a pair that disagrees, so the noise always matches the bound the samples are clipped to.
"""

import torch.nn as nn

from opacus_dp.grad_sample.bookkeeping.module import BookkeepingGradSampleModule
from opacus_dp.optim.clipping import check_max_grad_norm


class GradSampleModuleFastGradientClipping(BookkeepingGradSampleModule):
    """The ``ghost`` mode's wrapper with Opacus 1.6's constructor (module doc)."""

    def __init__(self, m: nn.Module, *, batch_first: bool = True, loss_reduction: str = "mean",
                 strict: bool = True, force_functorch: bool = False, max_grad_norm: float = 1.0,
                 use_ghost_clipping: bool = True):
        if force_functorch:
            raise ValueError("force_functorch=True is not available with fast gradient clipping: the "
                             "ghost mode picks each layer's norm itself (layers without a dedicated one "
                             "use the torch.func fallback anyway)")
        super().__init__(m, batch_first=batch_first, loss_reduction=loss_reduction, strict=strict)
        self.max_grad_norm = check_max_grad_norm(max_grad_norm)
        self.use_ghost_clipping = bool(use_ghost_clipping)
