"""The public methods of ``GradSampleModule`` beyond its hooks (Opacus's API): reading and
consuming the per-sample gradients, their lifecycle, closing, state dicts, validation."""

import copy
import gc
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from opacus_dp.distributed import data_parallel
from opacus_dp.errors import UnsupportedModuleError
from opacus_dp.grad_sample.attachments import _owner, weakly
from opacus_dp.grad_sample.compiled_modules import give_back_compiled_call
from opacus_dp.grad_sample.model_checks import replace_model_checks
from opacus_dp.grad_sample.support import describe, unsupported_modules
from opacus_dp.model_wrappers import unwrap_model
from opacus_dp.per_sample_source import ModuleGradSource
from opacus_dp.state_views import StateViews


class GradSampleModuleAPI:
    """Mixin of :class:`~opacus_dp.grad_sample.grad_sample_module.GradSampleModule` (module doc)."""

    unit_channel = None  # privacy units of the rows (configure_units); None: every row is one
    _compiled_model_call = None  # the wrapped model's call compiled by compile() (docs/compile.md)
    _compiled_fullgraph = False  # ... with fullgraph=True

    @staticmethod
    def _check_arguments(module, batch_first, loss_reduction) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        if isinstance(module, GradSampleModuleAPI):
            raise ValueError("module is already a GradSampleModule; wrap the inner module once")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        if not isinstance(batch_first, bool):
            raise TypeError(f"batch_first must be a bool, got {type(batch_first).__name__}")
        hooked = [(path, sub) for path, sub in module.named_modules() if _owner(sub) is not None]
        if hooked:  # perhaps a dropped wrapper in a reference cycle: collecting it detaches it
            gc.collect()
        for path, sub in hooked:
            if _owner(sub) is not None:
                raise ValueError(
                    f"{describe(path, sub)} already has per-sample gradient hooks of another "
                    f"GradSampleModule; call close() on that one first"
                )

    def __deepcopy__(self, memo):
        """A plain deep copy of the wrapped model, without the hooks and attributes of this wrapper
        (an EMA copy: ordinary ``p.grad``, state-dict keys of the model, no ``_module.``)."""
        copied = copy.deepcopy(self._module, memo)
        memo[id(self)] = copied
        return copied

    def __reduce_ex__(self, protocol):
        raise TypeError(
            f"a {type(self).__name__} cannot be pickled (its per-sample state is not data to save): "
            "save model.state_dict() or a checkpoint, or pickle the plain copy copy.deepcopy(model)")

    def trainable_parameters(self) -> List[Tuple[str, nn.Parameter]]:
        """``(name, param)`` of the wrapped module's parameters with ``requires_grad``."""
        return [(n, p) for n, p in self._module.named_parameters() if p.requires_grad]

    def grad_sample(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """Per-sample gradient of ``param`` accumulated so far (None if there is none)."""
        return self._store.get(param)

    def grad_source(self) -> ModuleGradSource:
        """Its :class:`~opacus_dp.per_sample_source.GradSource` (via :meth:`pop_grad_samples`)."""
        return ModuleGradSource(self)

    def use_state_views(self, views: StateViews) -> None:
        """Show ``p.grad_sample`` with the lifecycle of ``views`` (:mod:`opacus_dp.state_views`):
        Opacus 1.x's (the default) or 0.x's (the classic engine's)."""
        self._store.views = views
        self._store.show_absent([p for _, p in self.trainable_parameters()])

    def pop_grad_samples(self) -> Dict[torch.Tensor, torch.Tensor]:
        """Return ``{param: per-sample gradient}`` and drop them from the wrapper; they stay
        readable as ``p.grad_sample`` where the lifecycle keeps them (marked consumed)."""
        self._consumed()
        return self._store.pop_all()

    def zero_grad_sample(self) -> None:
        """Free all per-sample gradients (``p.grad_sample`` becomes None)."""
        self._restore_switches()
        self._store.clear()

    def pending_passes(self) -> int:
        """Backward passes (batches, empty ones included) whose per-sample gradients are held
        (concatenated) right now."""
        return self._store.passes

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad`` plus :meth:`zero_grad_sample` (always set to None)."""
        super().zero_grad(set_to_none=set_to_none)
        self.zero_grad_sample()

    def set_grad_sample_to_none(self) -> None:
        """Opacus-compatible name of :meth:`zero_grad_sample`."""
        self._store.clear()

    def del_grad_sample(self) -> None:
        """Free per-sample gradients and delete the ``grad_sample`` attributes."""
        self._store.remove_views()

    def forbid_grad_accumulation(self) -> None:
        """Make a second backward pass before the per-sample gradients are consumed raise."""
        self._store.accumulation_allowed = False

    def allow_grad_accumulation(self) -> None:
        self._store.accumulation_allowed = True

    def configure_units(self, channel) -> None:
        """Group the rows of each backward pass into privacy units as the loader delivered them to
        ``channel`` (a :class:`~opacus_dp.maths.unit_groups.UnitChannel`; None: a row is a unit)."""
        self.unit_channel = channel

    def configure_model_checks(self, check_sample_independence: bool = True, public_buffers: Sequence[str] = ()):
        """(Re)set the model-level checks (constructor arguments of the same names)."""
        self._model_checks = replace_model_checks(getattr(self, "_model_checks", None), self._module, self._handles,
                                                  self.batch_first, weakly(self._recording, False),
                                                  check_sample_independence, public_buffers)

    def disable_hooks(self) -> None:
        self.hooks_enabled = False

    def enable_hooks(self) -> None:
        self.hooks_enabled = True

    def remove_hooks(self) -> None:
        """Remove every hook and ``grad_sample`` attribute; the wrapped module is as before."""
        data_parallel.release(self)
        self.hooks_enabled = False
        self._finalizer()  # detaches once; a later collection of the wrapper changes nothing
        self._store.remove_views()  # views published since a first close()
        give_back_compiled_call(self)  # a model compiled in place before it was wrapped

    def close(self) -> None:
        self.remove_hooks()

    _close = close

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict``; a state dict of the user's model itself (keys without
        ``_module.``, as ``save_checkpoint`` writes them) loads into that model, also when it
        sits in a DataParallel/DDP wrapper here."""
        if state_dict and not any(key.startswith("_module.") for key in state_dict):
            return unwrap_model(self._module).load_state_dict(state_dict, strict=strict, assign=assign)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def compile(self, *args, **kwargs) -> None:
        """``torch.compile`` the wrapped model's call with these arguments (``fullgraph=True``
        included); the wrapper's own bookkeeping runs eagerly around it (``docs/compile.md``)."""
        self._compiled_model_call = torch.compile(self._module._call_impl, *args, **kwargs)
        self._compiled_fullgraph = bool(kwargs.get("fullgraph", False))

    def to_standard_module(self) -> nn.Module:
        """Remove all hooks and return the wrapped module."""
        self.close()
        return self._module

    # ------------------------------------------------------------- validation
    @staticmethod
    def validate(module: nn.Module, strict: bool = False) -> List[UnsupportedModuleError]:
        """Errors for submodules that cannot get per-sample gradients; raised if ``strict``."""
        errors = [
            UnsupportedModuleError(f"{describe(path, sub)} cannot be trained privately: {why}")
            for path, sub, why in unsupported_modules(module)
        ]
        if strict and errors:
            raise UnsupportedModuleError("\n".join(str(e) for e in errors))
        return errors

    @classmethod
    def is_supported(cls, module: nn.Module) -> bool:
        """True when every submodule with trainable parameters gets per-sample gradients."""
        return not cls.validate(module, strict=False)
