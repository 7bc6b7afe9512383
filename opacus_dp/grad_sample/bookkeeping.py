"""Book-keeping for the norms-only modes: per-sample norms now, the clipped sum later.

Bu, Wang, Zha, Karypis 2023, "Differentially Private Optimization on Large Model at Small
Cost" (book-keeping): the per-sample gradient of a layer call is a function of the call's
inputs ``a`` and output gradients ``g``, so keeping ``(a, g)`` gives both the per-sample norms
``‖g_i‖`` (needed for the clip factors ``f_i``) and, once the factors are known, the clipped
sum ``Σ_i f_i g_i`` — without a second backward pass and, for most layers, without ever
forming the ``B`` per-sample gradients.

During a backward pass (one autograd graph task) the hooks :meth:`Bookkeeper.record` every
call of every hooked layer. When the pass ends (an autograd engine callback) each layer is
resolved once:

* **ghost**: its type has a norm sampler and a :class:`GhostLayer` entry, no parameter is
  shared with another layer called in the pass, its calls merge into one (or there is one)
  and the rule holds (``"mixed"``: ``prefers_ghost``, i.e. the cheaper of the two ways, Bu et
  al. 2022; ``"ghost"``: always). Its squared norms come from the norm sampler; the merged
  ``(a, g)`` are kept for ``weighted_grad``.
* **materialised**: per-sample gradients from the layer's grad sampler or the ``torch.func``
  fallback, summed over the calls and over the layers sharing a parameter; only those are kept.

Output gradients are stored as autograd delivered them; the loss-reduction ``scale`` (``B``
for a mean) is applied to the results (norms scale by ``s²``, sums by ``s``). Passes made
before the factors are consumed (virtual steps) are kept apart: their norms are concatenated
along the batch and their clipped sums added.
"""

import threading
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from opacus_dp.grad_sample.layer_call import LayerCall
from opacus_dp.grad_sample.norm_samplers.table import ghost_layer_of
from opacus_dp.grad_sample.registry import NORM_SAMPLERS
from opacus_dp.grad_sample.support import own_parameters

LAYER_RULES = ("mixed", "ghost")


@dataclass
class _Call:
    """One call of a hooked layer as the backward hook saw it (tensors batch-first)."""

    layer: nn.Module
    name: str
    call: LayerCall
    backprops: List[Optional[torch.Tensor]]
    scale: float


@dataclass
class _OpenPass:
    calls: Dict[nn.Module, List[_Call]] = field(default_factory=dict)
    batch_size: Optional[int] = None
    first_layer: str = ""


@dataclass
class ResolvedPass:
    """What one finished backward pass leaves for the optimizer step."""

    batch_size: int
    sq_norms: Dict[torch.Tensor, torch.Tensor]
    ghost_calls: List[Tuple[nn.Module, list, torch.Tensor, float]]
    grads: Dict[torch.Tensor, torch.Tensor]
    modes: Dict[str, str]


def _trainable_params(layer: nn.Module) -> List[torch.Tensor]:
    return [p for _, p in own_parameters(layer) if p.requires_grad]


def _shared_layers(calls: Dict[nn.Module, List[_Call]]) -> set:
    """Layers owning a parameter that another layer of the pass also owns (tied weights)."""
    owners: Dict[torch.Tensor, List[nn.Module]] = {}
    for layer in calls:
        for p in _trainable_params(layer):
            owners.setdefault(p, []).append(layer)
    return {layer for layers in owners.values() if len(layers) > 1 for layer in layers}


class Bookkeeper:
    """Records layer calls per backward pass and turns them into norms and clipped sums.

    Args:
        per_sample_grads: ``(layer, LayerCall, backprops) -> {param: (B, *shape)}``, the
            materialising path (the grad sampler or the ``torch.func`` fallback).
        layer_rule: ``"mixed"`` or ``"ghost"`` (see the module doc).
    """

    def __init__(self, per_sample_grads: Callable, layer_rule: str = "mixed"):
        if layer_rule not in LAYER_RULES:
            raise ValueError(f"layer_rule must be one of {LAYER_RULES}, got {layer_rule!r}")
        self._per_sample_grads = per_sample_grads
        self.layer_rule = layer_rule
        self.accumulation_allowed = True
        self._open: Dict[int, _OpenPass] = {}
        self._resolved: List[ResolvedPass] = []
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ recording
    def record(self, layer: nn.Module, name: str, call: LayerCall,
               backprops: List[Optional[torch.Tensor]], scale: float) -> None:
        """Keep one call of ``layer`` (``name`` for messages) seen by the current backward pass."""
        task = torch._C._current_graph_task_id()
        if task == -1:
            raise RuntimeError("layer calls can only be recorded during a backward pass")
        with self._lock:
            current = self._open.get(task)
            if current is None:
                current = self._open[task] = _OpenPass()
                torch.autograd.Variable._execution_engine.queue_callback(lambda: self._close(task))
            self._check_batch_size(current, call.batch_size, name, task)
            current.calls.setdefault(layer, []).append(_Call(layer, name, call, backprops, scale))

    def _check_batch_size(self, current: _OpenPass, size: int, name: str, task: int) -> None:
        if current.batch_size is None:
            current.batch_size, current.first_layer = size, name
        elif current.batch_size != size:
            del self._open[task]
            raise ValueError(
                f"Inconsistent batch sizes in one forward/backward pass: layer {name} has batch "
                f"size {size} but layer {current.first_layer} has {current.batch_size}. Check that "
                f"every layer with parameters gets its inputs with the batch on the wrapper's "
                f"batch dimension (sequence-first models need batch_first=False)."
            )

    def _close(self, task: int) -> None:
        with self._lock:
            finished = self._open.pop(task, None)
            if finished is None:
                return
            if self._resolved and not self.accumulation_allowed:
                raise ValueError(
                    "A second backward pass recorded per-sample information before the previous "
                    "one was consumed, which this configuration forbids (Poisson sampling): call "
                    "optimizer.step() and optimizer.zero_grad() after every backward pass, or use "
                    "BatchMemoryManager for large logical batches."
                )
            self._resolved.append(self._resolve(finished))

    # ------------------------------------------------------------------ resolving
    def _resolve(self, finished: _OpenPass) -> ResolvedPass:
        resolved = ResolvedPass(finished.batch_size, {}, [], {}, {})
        shared = _shared_layers(finished.calls)
        for layer, calls in finished.calls.items():
            merged = None if layer in shared else self._ghost_call(layer, calls)
            if merged is None:
                self._materialise(resolved, calls)
                resolved.modes[calls[0].name] = "materialised"
            else:
                activations, backprops, scale = merged
                for p, sq in NORM_SAMPLERS[type(layer)](layer, activations, backprops).items():
                    resolved.sq_norms[p] = sq * (scale * scale)
                resolved.ghost_calls.append((layer, activations, backprops, scale))
                resolved.modes[calls[0].name] = "ghost"
        for p, g in resolved.grads.items():
            resolved.sq_norms[p] = g.reshape(g.shape[0], -1).pow(2).sum(dim=1)
        return resolved

    def _ghost_call(self, layer: nn.Module, calls: List[_Call]):
        """``(activations, backprops, scale)`` of the layer's calls as one, if it goes ghost."""
        spec = ghost_layer_of(layer)
        if spec is None or type(layer) not in NORM_SAMPLERS:
            return None
        if any(c.backprops[0] is None or c.scale != calls[0].scale for c in calls):
            return None
        pairs = [(c.call.activations(layer), c.backprops[0]) for c in calls]
        if len(pairs) > 1:
            merged = spec.merge_calls(layer, pairs) if spec.merge_calls is not None else None
            if merged is None:
                return None
            pairs = [merged]
        activations, backprops = pairs[0]
        if self.layer_rule == "mixed" and spec.prefers_ghost is not None \
                and not spec.prefers_ghost(layer, activations):
            return None
        return activations, backprops, calls[0].scale

    def _materialise(self, resolved: ResolvedPass, calls: List[_Call]) -> None:
        for c in calls:
            for p, g in self._per_sample_grads(c.layer, c.call, c.backprops).items():
                if c.scale != 1:
                    g = g * c.scale
                previous = resolved.grads.get(p)
                resolved.grads[p] = g if previous is None else previous + g

    # ------------------------------------------------------------------ consuming
    @property
    def num_passes(self) -> int:
        """Finished backward passes not yet consumed."""
        return len(self._resolved)

    def layer_modes(self) -> Dict[str, str]:
        """``{layer name: "ghost" | "materialised"}`` of the passes not yet consumed."""
        modes: Dict[str, str] = {}
        for resolved in self._resolved:
            modes.update(resolved.modes)
        return modes

    def recorded_params(self) -> set:
        """Parameters with per-sample information in the unconsumed passes."""
        return {p for r in self._resolved for p in r.sq_norms}

    def sq_norms(self, params: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Per-sample squared norms ``(B_1 + ... + B_k,)`` of every param (zeros if unused)."""
        result = []
        for p in params:
            parts = [r.sq_norms.get(p) for r in self._resolved]
            parts = [x if x is not None else torch.zeros(r.batch_size, device=p.device, dtype=p.dtype)
                     for x, r in zip(parts, self._resolved)]
            result.append(torch.cat(parts) if parts else torch.zeros(0, device=p.device, dtype=p.dtype))
        return result

    def clipped_sums(self, params: Sequence[torch.Tensor],
                     factors: Sequence[torch.Tensor]) -> List[Optional[torch.Tensor]]:
        """``Σ_i f_i g_i`` per param (None if it has no gradient); consumes the passes."""
        by_param = dict(zip(params, factors))
        sums: Dict[torch.Tensor, torch.Tensor] = {}
        offset = 0
        for resolved in self._take():
            window = slice(offset, offset + resolved.batch_size)
            offset += resolved.batch_size
            for layer, activations, backprops, scale in resolved.ghost_calls:
                wanted = {p: by_param[p][window] * scale for p in _trainable_params(layer) if p in by_param}
                spec = ghost_layer_of(layer)
                for p, s in spec.weighted_grad(layer, activations, backprops, wanted).items():
                    _add(sums, p, s)
            for p, g in resolved.grads.items():
                if p in by_param:
                    f = by_param[p][window].to(device=g.device, dtype=g.dtype)
                    _add(sums, p, torch.einsum("i,i...->...", f, g))
        return [sums.get(p) for p in params]

    def _take(self) -> List[ResolvedPass]:
        with self._lock:
            taken, self._resolved = self._resolved, []
            return taken

    def clear(self) -> None:
        """Drop every recorded call and unconsumed pass."""
        with self._lock:
            self._open.clear()
            self._resolved = []


def _add(sums: Dict[torch.Tensor, torch.Tensor], p: torch.Tensor, value: torch.Tensor) -> None:
    previous = sums.get(p)
    sums[p] = value if previous is None else previous + value
