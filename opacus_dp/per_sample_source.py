"""The protocol between :class:`~opacus_dp.optim.DPOptimizer` and its per-sample gradient sources.

A step asks its source, for the trainable tensors ``l`` of the optimizer:

1. ``per_sample_norms(params, name_of)``: ``n_il = ‖g_il‖₂`` over the samples ``i`` of the backward
   passes not yet consumed (one ``(B,)`` tensor per ``l``); the source keeps what step 2 needs;
2. ``clipped_sums(params, factors)``: ``S_l = Σ_i f_il · g_il`` for the clipper's factors
   (None for a tensor no sample reached); this consumes the passes.

Beside these: ``pending_passes()`` (backward passes held, i.e. batches the step merges);
``set_factor_function(fn)``, ``fn(param, norms) -> (B,) factors or None``: a source that can clip
during the backward pass (``bk`` with per-layer clipping) forms each layer's sum at once,
``forms_sums_in_backward`` says whether it does; ``clear(params)`` forgets everything unconsumed.

Sources: :class:`AttributeGradSource` (``p.grad_sample``), :class:`ModuleGradSource` (a
``GradSampleModule``'s ``pop_grad_samples``), and the norms-only
``BookkeepingGradSampleModule`` (``ghost``/``bk``), which is its own source. A per-sample
wrapper declares its source with ``grad_source()`` (:class:`PerSampleWrapper`). A leaf: both
:mod:`opacus_dp.optim` and :mod:`opacus_dp.grad_sample` import it, neither imports the other.
"""

import abc
from typing import Callable, Dict, List, Optional, Protocol, Sequence, runtime_checkable

import torch

from opacus_dp.maths.per_sample import per_sample_norms, sum_dtype, weighted_sum
from opacus_dp.maths.unit_groups import UnitGroups
from opacus_dp.module_parameters import local_part
from opacus_dp.state_views import is_consumed, mark_consumed, passes_of

FactorFunction = Callable[[torch.Tensor, torch.Tensor], Optional[torch.Tensor]]
NameOf = Callable[[torch.Tensor], str]

NO_GRADS = ("no per-sample gradients to process: call loss.backward() on the model before "
            "optimizer.step()/virtual_step() (was step() called twice on the same gradients?)")


@runtime_checkable
class GradSource(Protocol):
    """What a DPOptimizer needs from where its per-sample information comes from (module doc)."""

    @property
    def forms_sums_in_backward(self) -> bool:
        """Whether clipped sums are formed during the backward pass (a factor function is set)."""

    def per_sample_norms(self, params: Sequence[torch.Tensor],
                         name_of: Optional[NameOf] = None) -> List[torch.Tensor]:
        """``‖g_il‖₂``, shape ``(B,)`` per tensor; ``name_of`` names tensors in errors."""

    def clipped_sums(self, params: Sequence[torch.Tensor],
                     factors: Sequence[torch.Tensor]) -> List[Optional[torch.Tensor]]:
        """``Σ_i f_il g_il`` per tensor for the norms just returned; consumes them."""

    def pending_passes(self) -> int:
        """Backward passes (batches) held for the next step."""

    def set_factor_function(self, factor_function: Optional[FactorFunction]) -> None:
        """Factors a source may apply during backward (None: only at the step)."""

    def clear(self, params: Sequence[torch.Tensor]) -> None:
        """Forget every per-sample state not consumed yet."""


@runtime_checkable
class PerSampleWrapper(Protocol):
    """A model wrapper that declares its gradient source (``GradSampleModule`` and subclasses)."""

    def grad_source(self) -> GradSource:
        """The :class:`GradSource` a DPOptimizer reads this wrapper's per-sample state from."""


def grad_source_for(module) -> GradSource:
    """The source ``module`` declares if it is a :class:`PerSampleWrapper`, else ``p.grad_sample``."""
    if isinstance(module, PerSampleWrapper):
        return module.grad_source()
    return AttributeGradSource()


def _as_batch_tensor(value, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return torch.cat(list(value), dim=0)
    raise TypeError(f"per-sample gradient of {name} has unexpected type {type(value).__name__}")


def _shape_name(p: torch.Tensor) -> str:
    return f"<tensor of shape {tuple(p.shape)}>"


def check_grad_samples(params, grad_samples: Dict[torch.Tensor, torch.Tensor], name_of: NameOf) -> int:
    """The batch size the per-sample gradients agree on (0 if there are none); ValueError for a
    wrong shape, a disagreement, or a gradient without per-sample gradient."""
    sizes = {}
    for p in params:
        g = grad_samples.get(p)
        if g is None:
            if p.grad is not None and bool(torch.any(local_part(p.grad) != 0)):
                raise ValueError(
                    f"parameter {name_of(p)} has a gradient but no per-sample gradient: "
                    "its module is not handled by GradSampleModule (or it was not wrapped)"
                )
            continue
        if tuple(g.shape[1:]) != tuple(p.shape):
            raise ValueError(
                f"per-sample gradient of {name_of(p)} has shape {tuple(g.shape)}, "
                f"expected (batch, {', '.join(map(str, p.shape))})"
            )
        sizes[name_of(p)] = g.shape[0]
    if len(set(sizes.values())) > 1:
        raise ValueError(f"per-sample gradients disagree on the batch size: {sizes}")
    return next(iter(sizes.values()), 0)


class _MaterialisedSource(abc.ABC):
    """A :class:`GradSource` over materialised per-sample gradients ``g_il``: the norms take
    them (held until :meth:`clipped_sums`), the sums are ``Σ_i f_il g_il`` at the step."""

    forms_sums_in_backward = False

    def __init__(self):
        self._held: Dict[torch.Tensor, torch.Tensor] = {}
        self._groups: Optional[UnitGroups] = None

    def _unit_groups(self, num_rows: int, passes: int) -> Optional[UnitGroups]:
        """The privacy units of the rows taken (None: every row is its own unit)."""
        return None

    @abc.abstractmethod
    def _take(self, params: Sequence[torch.Tensor]) -> Dict[torch.Tensor, torch.Tensor]:
        """Take (and stop holding) the per-sample gradients of ``params``."""

    @abc.abstractmethod
    def _forget(self, params: Sequence[torch.Tensor]) -> None:
        """Drop the per-sample gradients of ``params`` not taken yet."""

    def per_sample_norms(self, params, name_of: Optional[NameOf] = None) -> List[torch.Tensor]:
        self._held, self._groups = {}, None
        passes = self.pending_passes()
        grads = self._take(params)
        if params and not grads:
            raise RuntimeError(NO_GRADS)
        batch_size = check_grad_samples(params, grads, name_of or _shape_name)
        groups = self._unit_groups(batch_size, passes)
        self._held, self._groups = grads, groups
        if groups is not None:  # ‖Σ_{i∈u} w_i g_i‖ per unit (maths/unit_groups.py)
            return [groups.sq_norms(grads[p].to(sum_dtype(p.dtype))).sqrt() if p in grads else
                    torch.zeros(groups.num_units, device=p.device, dtype=sum_dtype(p.dtype)) for p in params]
        return [per_sample_norms(grads[p]) if p in grads else
                torch.zeros(batch_size, device=p.device, dtype=sum_dtype(p.dtype)) for p in params]

    def clipped_sums(self, params, factors) -> List[Optional[torch.Tensor]]:
        held, self._held = self._held, {}
        groups, self._groups = self._groups, None
        if groups is not None:  # unit factors f_u -> row factors f_{u(i)} w_i
            factors = [groups.row_factors(f) for f in factors]
        sums = []
        for p, factor in zip(params, factors):
            g = held.pop(p, None)  # each one freed once summed
            sums.append(None if g is None else weighted_sum(factor, g.to(sum_dtype(p.dtype))))
        return sums

    def set_factor_function(self, factor_function: Optional[FactorFunction]) -> None:
        """Nothing to do: the sums are formed at the step, from the held gradients."""

    def clear(self, params) -> None:
        self._held, self._groups = {}, None
        self._forget(params)


class AttributeGradSource(_MaterialisedSource):
    """Per-sample gradients stored by hooks in ``p.grad_sample`` (a tensor, or a list of tensors
    concatenated along the batch dimension). As in Opacus 1.x, a step leaves them there, marked
    consumed (:mod:`opacus_dp.state_views`): read, never taken twice."""

    def __init__(self, params: Optional[Callable[[], Sequence[torch.Tensor]]] = None):
        super().__init__()
        self._params = params  # the optimizer's trainable tensors, to count the passes they hold

    def _take(self, params):
        found = {}
        for i, p in enumerate(params):
            value = getattr(p, "grad_sample", None)
            if value is not None and not is_consumed(value):
                found[p] = _as_batch_tensor(value, f"parameter #{i}")
                mark_consumed(found[p])
                p.grad_sample = found[p]
        return found

    def _forget(self, params) -> None:
        for p in params:
            if getattr(p, "grad_sample", None) is not None:
                p.grad_sample = None

    def pending_passes(self) -> int:
        """The most backward passes any unconsumed ``p.grad_sample`` holds (a list's length, or
        as recorded by a ``GradSampleModule``); 1 if unknown."""
        values = [getattr(p, "grad_sample", None) for p in (self._params() if self._params else ())]
        return max([passes_of(v) for v in values if v is not None and not is_consumed(v)], default=1)


class ModuleGradSource(_MaterialisedSource):
    """Per-sample gradients held by a ``GradSampleModule`` (``pop_grad_samples``,
    ``zero_grad_sample``, ``pending_passes``)."""

    def __init__(self, grad_sample_module):
        super().__init__()
        self.module = grad_sample_module

    def _take(self, params):
        popped = self.module.pop_grad_samples()
        wanted = set(params)
        return {p: _as_batch_tensor(g, "a parameter") for p, g in popped.items()
                if p in wanted and g is not None}

    def _forget(self, params) -> None:
        self.module.zero_grad_sample()

    def _unit_groups(self, num_rows: int, passes: int) -> Optional[UnitGroups]:
        channel = self.module.unit_channel
        return None if channel is None else channel.take_rows(num_rows, passes)

    def pending_passes(self) -> int:
        """Backward passes (batches) held by the module, concatenated for the next step."""
        return int(self.module.pending_passes())
