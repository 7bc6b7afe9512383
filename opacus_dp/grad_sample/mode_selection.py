"""The one table of ``grad_sample_mode``s: which wrapper each builds, with which options, and
what ``"auto"`` picks. ``make_private``, ``attach`` (:mod:`opacus_dp.engine.model`) and Opacus's
``wrap_model`` / ``get_gsm_class`` (:mod:`opacus_dp.grad_sample.utils`) all read it.

* ``"hooks"`` (and Opacus's ``"ew"``, ExpandedWeights: the same per-sample gradients):
  :class:`GradSampleModule` with the dedicated per-layer samplers; ``p.grad`` holds autograd's
  ordinary gradient after ``loss.backward()``, as in Opacus;
* ``"functorch"``: the same wrapper with the ``torch.func`` fallback for every layer;
* ``"bk"``: :class:`BookkeepingGradSampleModule` with the ``"mixed"`` layer rule — per layer
  the cheaper of the ghost norm and materialised per-sample gradients (Bu et al. 2022), the
  clipped sum assembled from the recorded inputs and output gradients in the same backward
  pass (Bu et al. 2023), autograd's weight gradients skipped;
* ``"ghost"``: the same wrapper and per-layer rule, and, as in Opacus 1.6, ``make_private``
  also returns a criterion whose losses' ``backward()`` runs two passes (norms, then clipped
  sums; :mod:`~opacus_dp.grad_sample.bookkeeping.ghost_criterion`);
* under FSDP2 (``fully_shard``), the engines (:func:`wrap_for_engine`) run ``"hooks"``/``"ew"``
  as ``"bk"``: the same update without ``B`` per-sample copies of every unsharded layer on every
  rank (``p.grad_sample`` is not set), as ``"ghost"`` runs one backward pass there;
  ``"functorch"`` still materialises them, for those who want them;
* ``"auto"``: a rule from the model's structure, no measurement: ``"hooks"`` if the model
  contains ``nn.DataParallel`` (the norms-only modes do not support it), else ``"bk"``, which
  does the least arithmetic (per layer the cheaper computation, no autograd weight gradient, no
  second backward; see ``docs/benchmarks.md``).

``options`` make the mode. ``skip_weight_grads`` (the engines' argument): autograd's own weight
gradient of the hooked layers is not computed, as the DP step forms ``p.grad`` from the
per-sample state anyway (``p.grad`` then stays None after ``loss.backward()``). Default: off
in ``"hooks"``/``"functorch"`` (Opacus's behaviour), on in ``"bk"``/``"ghost"``, which have no
Opacus 0.x counterpart and whose speed comes from it; ``True`` is an opt-in for speed in the
first two, ``False`` gives the ordinary ``p.grad`` in the last two.
"""

from dataclasses import dataclass, field
from typing import Mapping, Optional, Type

import torch.nn as nn
from torch.nn.parallel import DataParallel

from opacus_dp.grad_sample.bookkeeping.module import BookkeepingGradSampleModule
from opacus_dp.grad_sample.grad_sample_module import GradSampleModule
from opacus_dp.grad_sample.grad_sample_module_fast_gradient_clipping import GradSampleModuleFastGradientClipping
from opacus_dp.module_parameters import is_sharded_model


@dataclass(frozen=True)
class Mode:
    """One row of the table: the engines' wrapper class, its options, whether the engines skip
    autograd's weight gradients by default, and the class Opacus's API returns for the mode
    (default: the same)."""

    wrapper: Type[GradSampleModule]
    options: Mapping = field(default_factory=dict)
    skips_weight_grads: bool = False
    opacus_wrapper: Type[GradSampleModule] = None

    def opacus_class(self) -> Type[GradSampleModule]:
        return self.opacus_wrapper or self.wrapper


_HOOKS = Mode(GradSampleModule)
MODES: Mapping[str, Mode] = {
    "hooks": _HOOKS,
    "ew": _HOOKS,
    "functorch": Mode(GradSampleModule, {"force_functorch": True}),
    "ghost": Mode(BookkeepingGradSampleModule, {"layer_rule": "mixed"}, skips_weight_grads=True,
                  opacus_wrapper=GradSampleModuleFastGradientClipping),
    "bk": Mode(BookkeepingGradSampleModule, {"layer_rule": "mixed"}, skips_weight_grads=True),
}
MODE_NAMES = (*MODES, "auto")  # what grad_sample_mode accepts


def choose_mode(module: nn.Module) -> str:
    """The mode ``"auto"`` stands for, for ``module`` (see the module doc)."""
    if any(isinstance(m, DataParallel) for m in module.modules()):
        return "hooks"
    return "bk"


def mode_of(name: str, module: nn.Module) -> Mode:
    """The table's row for ``name`` (``"auto"`` resolved for ``module``)."""
    if name not in MODE_NAMES:
        raise ValueError(f"grad_sample_mode must be one of {', '.join(map(repr, MODE_NAMES))}, got {name!r}")
    return MODES[choose_mode(module) if name == "auto" else name]


def wrap_for_engine(module: nn.Module, name: str, *, batch_first: bool, loss_reduction: str,
                    skip_weight_grads: Optional[bool] = None) -> GradSampleModule:
    """The wrapper ``make_private`` / ``attach`` build for mode ``name`` (strict validation);
    ``skip_weight_grads=None``: the mode's default (module doc)."""
    mode, sharded = mode_of(name, module), is_sharded_model(module)
    if sharded and mode is _HOOKS:  # FSDP2: the norms-only path (module doc)
        mode = MODES["bk"]
    if skip_weight_grads is None:  # FSDP2: no ordinary gradient to reduce-scatter by default
        skip_weight_grads = mode.skips_weight_grads or sharded
    elif not isinstance(skip_weight_grads, bool):
        raise TypeError(f"skip_weight_grads must be a bool or None, got {skip_weight_grads!r}")
    return mode.wrapper(module, batch_first=batch_first, loss_reduction=loss_reduction, strict=True,
                        skip_weight_grads=skip_weight_grads, **mode.options)


def wrap_norms_only(module: nn.Module, name: str, *, batch_first: bool, loss_reduction: str) -> GradSampleModule:
    """:func:`wrap_for_engine` for ``name`` in ``("bk", "ghost", "auto")``."""
    if name not in ("bk", "ghost", "auto"):
        raise ValueError(f"mode must be 'bk', 'ghost' or 'auto', got {name!r}")
    return wrap_for_engine(module, name, batch_first=batch_first, loss_reduction=loss_reduction)
