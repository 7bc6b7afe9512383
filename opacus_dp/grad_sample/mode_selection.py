"""Which per-sample machinery a ``grad_sample_mode`` name builds, and what ``"auto"`` picks.

* ``"bk"``: :class:`BookkeepingGradSampleModule` with the ``"mixed"`` layer rule — per layer
  the cheaper of the ghost norm and materialised per-sample gradients (Bu et al. 2022), the
  clipped sum assembled from the recorded inputs and output gradients in the same backward
  pass (Bu et al. 2023), autograd's weight gradients skipped;
* ``"ghost"``: the same wrapper and per-layer rule, and, as in Opacus 1.6, ``make_private``
  also returns a criterion whose losses' ``backward()`` runs two passes (norms, then clipped
  sums; :mod:`~opacus_dp.grad_sample.bookkeeping.ghost_criterion`): no output gradient is stored between
  them, but the graph is retained for the second pass, which also costs time;
* ``"auto"``: a rule from the model's structure, no measurement: ``"hooks"`` if the model
  contains ``nn.DataParallel`` (the norms-only modes do not support it), else ``"bk"``. The
  reason: per layer ``bk`` does the cheaper of the two computations ``hooks`` can only do one
  way (materialising), and it skips autograd's weight gradient and the second backward of
  ``ghost``, so it does the least arithmetic (``scripts/benchmark.py`` measures this on five
  models). On those five models ``bk`` also has the lower peak memory (its kept layer inputs
  are held as the activation's input where that is smaller at the peak); ``"ghost"`` is for
  code written against Opacus's ghost-clipping criterion.
"""

import torch.nn as nn
from torch.nn.parallel import DataParallel

NORMS_ONLY_RULES = {"bk": "mixed", "ghost": "mixed"}


def choose_mode(module: nn.Module) -> str:
    """The mode ``"auto"`` stands for, for ``module`` (see the module doc)."""
    if any(isinstance(m, DataParallel) for m in module.modules()):
        return "hooks"
    return "bk"


def wrap_norms_only(module: nn.Module, mode: str, *, batch_first: bool, loss_reduction: str) -> nn.Module:
    """The wrapper of ``mode`` in ``("bk", "ghost", "auto")`` around ``module``."""
    from opacus_dp.grad_sample import BookkeepingGradSampleModule, GradSampleModule

    if mode == "auto":
        mode = choose_mode(module)
    if mode == "hooks":
        return GradSampleModule(module, batch_first=batch_first, loss_reduction=loss_reduction, strict=True)
    if mode not in NORMS_ONLY_RULES:
        raise ValueError(f"mode must be 'bk', 'ghost' or 'auto', got {mode!r}")
    return BookkeepingGradSampleModule(module, batch_first=batch_first, loss_reduction=loss_reduction,
                                       strict=True, layer_rule=NORMS_ONLY_RULES[mode])
