"""Book-keeping for the norms-only modes: per-sample norms now, the clipped sum later.

Bu, Wang, Zha, Karypis 2023, "Differentially Private Optimization on Large Model at Small
Cost" (book-keeping): the per-sample gradient of a layer call is a function of the call's
inputs ``a`` and output gradients ``g``, so keeping ``(a, g)`` gives both the per-sample norms
``‖g_i‖`` (needed for the clip factors ``f_i``) and, once the factors are known, the clipped
sum ``Σ_i f_i g_i`` — without a second backward pass and, for most layers, without ever
forming the ``B`` per-sample gradients.

During a backward pass (one autograd graph task) the hooks :meth:`Bookkeeper.record` every
call of every hooked layer. A call is resolved as soon as it is known to be the layer's only
call in the pass (no other call of it is still awaiting its backward, see
:meth:`Bookkeeper.expect_call`, and it shares no parameter with another layer); otherwise
all calls of the layer are resolved together when the pass ends (an autograd engine
callback). A call whose output never receives a gradient leaves its layer's count raised, so
that layer's later calls wait for the end of their pass (correct, only less memory-lean); a
layer resolved twice in one pass raises instead of computing a wrong norm. Resolving a layer:

* **ghost**: its type has a norm sampler and a :class:`~opacus_dp.grad_sample.bookkeeping.norm_rules.NormRule` with a ghost path, its calls merge
  into one (or there is one) and the rule holds (``"mixed"``: ``prefers_ghost``, the cheaper
  of the two ways, Bu et al. 2022, and, where the call would be kept, not
  ``materialise_if_kept``; ``"ghost"``: always). Squared norms from the norm sampler; the
  call's ``(a, g)`` are kept for ``weighted_grad`` (unless ``keep_ghost_calls`` is off, in a
  norms-only pass); an input ``a = φ(h)`` of an activation that saved ``h`` is held as ``h``
  and recomputed in place once the activation's backward has run
  (:mod:`~opacus_dp.grad_sample.bookkeeping.recomputed_inputs`), so that ``a`` and ``h`` are never both
  alive at the backward pass's peak;
* **materialised**: per-sample gradients from the layer's grad sampler or the ``torch.func``
  fallback, summed over calls and over layers sharing a parameter; only those are kept.
* **chunked** (per-layer clipping on CPU, where the layer type prefers it): per-sample
  gradients a few samples at a time in a reused buffer, clipped and summed at once
  (:mod:`~opacus_dp.grad_sample.bookkeeping.chunked_sums`); only the norms and sums are kept.

A *sums pass* (:meth:`Bookkeeper.begin_sums`) is a second backward pass over the same graph
after a norms-only pass: the clip factors are known, so each ghost layer's weighted gradient
is computed from the fresh ``g`` at once and nothing is stored (the ``ghost`` mode's
two-pass backward, :mod:`~opacus_dp.grad_sample.bookkeeping.ghost_criterion`).

Output gradients are stored as autograd delivered them; the loss-reduction ``scale`` (``B``
for a mean) is applied to the results (norms scale by ``s²``, sums by ``s``). Passes made
before the factors are consumed (virtual steps) are kept apart: their norms are concatenated
along the batch and their clipped sums added.
"""

import threading
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.nn as nn

from opacus_dp.grad_sample.bookkeeping.passes import (
    LAYER_RULES, Call, Pass, add_to, ghost_weighted_grad, refuse_changed_kept_calls, resolve_calls)
from opacus_dp.grad_sample.bookkeeping.chunked_sums import ChunkBuffer
from opacus_dp.grad_sample.bookkeeping.deferred_checks import check_passes
from opacus_dp.grad_sample.bookkeeping.grouped_units import grouped_sq_norms, resolve_grouped
from opacus_dp.grad_sample.broadcast_inputs import BROADCAST_HINT
from opacus_dp.grad_sample.per_sample_store import second_batch_error
from opacus_dp.grad_sample.bookkeeping.norm_rules import norm_rule_of
from opacus_dp.grad_sample.bookkeeping.pass_sums import owned_factors, passes_clipped_sums
from opacus_dp.grad_sample.bookkeeping.shared_input_grams import SharedInputGrams, tensor_key
from opacus_dp.grad_sample.bookkeeping.step_gradients import share_step_gradients
from opacus_dp.maths.per_sample import any_dropped, finite_factors
from opacus_dp.torch_internals import current_graph_task_id, queue_end_of_backward_callback, version_counter


@dataclass
class _SumsPass:
    """The pass whose clipped sums a second backward pass is computing."""

    target: Pass
    factors: Dict[torch.Tensor, torch.Tensor]
    drops: bool  # some factor is 0: rows of dropped samples are zeroed


class Bookkeeper:
    """Records layer calls per backward pass and turns them into norms and clipped sums.

    Args:
        per_sample_grads: ``(layer, LayerCall, backprops) -> {param: (B, *shape)}``, the
            materialising path (the grad sampler or the ``torch.func`` fallback).
        layer_rule: ``"mixed"`` or ``"ghost"`` (see the module doc).
        shared_layers: layers owning a parameter that another hooked layer also owns; they
            are always materialised (their per-sample gradients add up across layers).
    """

    def __init__(self, per_sample_grads: Callable, layer_rule: str = "mixed",
                 shared_layers: Optional[Set[nn.Module]] = None):
        if layer_rule not in LAYER_RULES:
            raise ValueError(f"layer_rule must be one of {LAYER_RULES}, got {layer_rule!r}")
        self._per_sample_grads = per_sample_grads
        self.layer_rule = layer_rule
        self.shared_layers = set(shared_layers or ())
        self.step_layers: Dict[nn.Module, nn.Module] = {}  # see step_gradients.step_projections
        self.accumulation_allowed = True
        self.other_batches = lambda: 0  # batches held elsewhere (empty batches)
        self.keep_ghost_calls = True
        self.factor_function: Optional[Callable] = None
        self._pending: Dict[nn.Module, int] = {}
        self._joined: Dict[nn.Module, int] = {}  # step projections' joined calls awaiting gradients
        self._open: Dict[int, Pass] = {}
        self._resolved: List[Pass] = []
        self.tasks: Set[int] = set()  # graph tasks that opened a pass since the last take/clear
        self._summing: Optional[_SumsPass] = None
        self.units = None  # UnitChannel: rows grouped into privacy units (norms formed at the step)
        self._chunk_buffer = ChunkBuffer()  # per-layer clipping's chunked sums (under the lock)
        self._input_grams = SharedInputGrams()  # Gram products of inputs several calls read
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ recording
    def expect_call(self, layer: nn.Module, inputs=()) -> None:
        """A forward call of ``layer`` on ``inputs`` (its positional arguments) now awaits its
        output gradients (counted, so that a call known to be the last pending one can be
        resolved at once, and calls reading the same input share its Gram products)."""
        with self._lock:
            self._pending[layer] = self._pending.get(layer, 0) + 1
            rule = norm_rule_of(layer)
            if rule is not None and rule.shares_input_products:
                self._input_grams.expect(inputs)

    def expect_joined(self, step_layer: nn.Module) -> None:
        """The call of ``step_layer`` just expected (:meth:`expect_call`) joins a recurrent run's
        steps (:mod:`~opacus_dp.grad_sample.joined_step_calls`): its output gradient
        is its cell's input projection's, which waits for it to be resolved with it."""
        with self._lock:
            self._joined[step_layer] = self._joined.get(step_layer, 0) + 1

    def record(self, layer: nn.Module, name: str, call, backprops: List[Optional[torch.Tensor]],
               scale: float) -> None:
        """Keep (or resolve) one call of ``layer`` (``name`` for messages) seen by the current
        backward pass. An input projection whose step projection has a joined call coming waits
        for it (the two hooks of one tensor, called one after the other)."""
        task = call.outer_task if call.outer_task != -1 else current_graph_task_id()
        if task == -1:
            raise RuntimeError("layer calls can only be recorded during a backward pass")
        with self._lock:
            pending = max(self._pending.get(layer, 0) - 1, 0)
            self._pending[layer] = pending
            if self._joined.get(layer):
                self._joined[layer] -= 1
            entry = Call(layer, name, call, backprops, scale)
            if self._summing is not None:
                self._add_sums(task, entry)
                return
            current = self._open_pass(task, call.batch_size, name)
            _settle(current)
            awaits_joined = self._joined.get(self.step_layers.get(layer), 0) > 0
            if pending == 0 and layer not in current.deferred and layer not in self.shared_layers \
                    and not awaits_joined:
                self._resolve_single(current, entry)
                self._release([entry])
            else:
                current.deferred.setdefault(layer, []).append(entry)

    def open_pass(self, task: int, batch_size: int, name: str) -> None:
        """Open the pass of the running graph task ``task`` now, for calls recorded into it from
        a nested backward pass (reentrant checkpointing); not during a sums pass, which adds to
        the pass it recomputes."""
        with self._lock:
            if self._summing is None:
                self._open_pass(task, batch_size, name)

    def _open_pass(self, task: int, batch_size: int, name: str) -> Pass:
        current = self._open.get(task)
        if current is None:
            current = self._open[task] = Pass(batch_size, name)
            self.tasks.add(task)
            queue_end_of_backward_callback(lambda: self._close(task))
        elif current.batch_size != batch_size:
            del self._open[task]
            raise ValueError(
                f"Inconsistent batch sizes in one forward/backward pass: layer {name} has batch "
                f"size {batch_size} but layer {current.first_layer} has {current.batch_size}. "
                f"Check that every layer with parameters gets its inputs with the batch on the "
                f"wrapper's batch dimension (sequence-first models need batch_first=False)."
                + BROADCAST_HINT
            )
        return current

    def _release(self, calls: List[Call]) -> None:
        """Drop the recorded inputs of resolved calls (what is still needed was kept by the
        resolution), so that they do not live until the end of the backward pass; not in a
        norms-only pass, whose second backward pass reads them again."""
        if self.keep_ghost_calls:
            for entry in calls:
                entry.call.release()

    def _resolve_single(self, current: Pass, entry: Call) -> None:
        """Resolve a layer's only call of the pass. A recurrent cell's input projection first lends
        its output gradient to the step projection's recorded calls; if it keeps that gradient for
        the step, keeping the step projection's calls costs only their inputs
        (:mod:`~opacus_dp.grad_sample.bookkeeping.step_gradients`)."""
        if self._resolve_joined(current, entry):
            return
        step_layer = self.step_layers.get(entry.layer)
        shared = step_layer is not None and step_layer not in self.shared_layers and share_step_gradients(
            entry, current.deferred.get(step_layer), self._pending.get(step_layer, 0))
        key = tensor_key(entry.backprops[0]) if shared else None
        self._resolve(current, entry.layer, [entry], gradient=(key, True) if shared else None)
        if shared and any(kept[0] is entry.layer for kept in current.ghost_calls):
            current.gradient_shared[step_layer] = key
        else:
            self._input_grams.drop(key)

    def _resolve_joined(self, current: Pass, entry: Call) -> bool:
        """Resolve a step projection's joined call with the input projection's call that waits
        for it, if that one received the same output gradient ``G`` (one tensor): the input projection
        keeps ``G``'s Gram products for the step projection; whether it did."""
        whole = next((w for w, s in self.step_layers.items() if s is entry.layer), None)
        waiting = current.deferred.get(whole) if whole is not None else None
        if not waiting or len(waiting) != 1 or whole in self.shared_layers:
            return False
        other = waiting[0]
        if len(other.backprops) != 1 or len(entry.backprops) != 1 or other.scale != entry.scale:
            return False
        key = tensor_key(entry.backprops[0])  # the same memory, view and version: the same tensor
        mine, theirs = entry.backprops[0], other.backprops[0]
        if key is None or key != tensor_key(theirs) or version_counter(mine) != version_counter(theirs):
            return False
        del current.deferred[whole]
        self._resolve(current, whole, [other], gradient=(key, True))
        self._release([other])
        if any(kept[0] is whole for kept in current.ghost_calls):
            self._resolve(current, entry.layer, [entry], gradient=(key, False))
        else:
            self._input_grams.drop(key)
            self._resolve(current, entry.layer, [entry])
        return True

    def _resolve(self, current: Pass, layer: nn.Module, calls: List[Call],
                 gradient: Optional[Tuple[object, bool]] = None) -> None:
        """Privacy units of several rows need the norms of sums over rows, formed at the step
        (:mod:`~opacus_dp.grad_sample.bookkeeping.grouped_units`). ``gradient``: ``(key, keep)`` of
        an output gradient shared with another layer, whose Gram products this resolution keeps for
        it or takes from it (:mod:`~opacus_dp.grad_sample.bookkeeping.shared_input_grams`)."""
        key, keep = gradient or (None, False)
        with self._input_grams.resolving(calls), self._input_grams.sharing_gradient(key, keep):
            if self.units is not None:
                resolve_grouped(current, layer, calls, per_sample_grads=self._per_sample_grads,
                                layer_rule=self.layer_rule, shared=layer in self.shared_layers)
                return
            resolve_calls(current, layer, calls, per_sample_grads=self._per_sample_grads,
                          layer_rule=self.layer_rule, shared=layer in self.shared_layers,
                          keep_ghost_calls=self.keep_ghost_calls,
                          factor_function=self.factor_function if self.keep_ghost_calls else None,
                          chunk_buffer=self._chunk_buffer, gradient_shared=gradient is not None)

    def _close(self, task: int) -> None:
        with self._lock:
            self._joined.clear()  # a joined call not seen by its pass will not come (its forward was not used)
            finished = self._open.pop(task, None)
            if finished is None or not (finished.deferred or finished.modes):
                return  # no call recorded (a pass opened for a recomputation that was not used)
            if (self._resolved or self.other_batches()) and not self.accumulation_allowed:
                raise second_batch_error()
            for layer, calls in list(finished.deferred.items()):
                shared = layer in finished.gradient_shared
                self._resolve(finished, layer, calls,
                              gradient=(finished.gradient_shared[layer], False) if shared else None)
                self._release(calls)
            finished.deferred.clear()
            self._input_grams.end_pass()
            _settle(finished)
            self._resolved.append(finished)

    # ------------------------------------------------------------------ sums pass
    def begin_sums(self, params: Sequence[torch.Tensor], factors: Sequence[torch.Tensor]) -> None:
        """The next backward pass recomputes the output gradients of the last pass; its ghost
        layers' clipped sums are computed at once with ``factors`` (one ``(B,)`` per param)."""
        factors = [finite_factors(f) for f in factors]  # a NaN norm's factor: 0, dropped
        with self._lock:
            if not self._resolved:
                raise RuntimeError("begin_sums needs a finished norms pass")
            self._summing = _SumsPass(self._resolved[-1], dict(zip(params, factors)), any_dropped(factors))
            self._summing.target.factors = self._summing.factors

    def end_sums(self) -> None:
        with self._lock:
            self._summing = None

    def _add_sums(self, task: int, entry: Call) -> None:
        target = self._summing.target
        if entry.call.batch_size != target.batch_size:
            raise ValueError("the second backward pass saw a different batch than the first one")
        if entry.layer not in target.ghost_layers:
            return  # materialised in the norms pass: its per-sample gradients are kept
        wanted = owned_factors(entry.layer, self._summing.factors, entry.scale, target)
        for p, s in ghost_weighted_grad(entry.layer, entry.call.activations(entry.layer),
                                        entry.backprops[0], wanted, drops=self._summing.drops).items():
            add_to(target.sums, p, s)

    # ------------------------------------------------------------------ consuming
    @property
    def num_passes(self) -> int:
        """Finished backward passes not yet consumed."""
        return len(self._resolved)

    def layer_modes(self) -> Dict[str, str]:
        """``{layer name: "ghost" | "materialised" | "chunked"}`` of the passes not yet consumed."""
        modes: Dict[str, str] = {}
        for resolved in self._resolved:
            modes.update(resolved.modes)
        return modes

    def has_sums_from_backward(self) -> bool:
        """Whether an unconsumed pass holds clipped sums formed with factors fixed during the
        backward pass (the factors it used are recorded for the step's check)."""
        return any(r.factors is not None for r in self._resolved)

    def recorded_params(self) -> set:
        """Parameters with per-sample information in the unconsumed passes."""
        return {p for r in self._resolved for p in (*r.sq_norms, *r.grouped_params)}

    def sq_norms(self, params: Sequence[torch.Tensor], last_only: bool = False) -> List[torch.Tensor]:
        """Per-sample squared norms ``(B_1 + ... + B_k,)`` of every param (zeros if unused);
        with ``last_only`` those of the last finished pass (a pass's own tensor: read only)."""
        passes = self._resolved[-1:] if last_only else self._resolved
        check_passes(passes)
        if self.units is not None:
            return grouped_sq_norms(passes, params, self.units)
        result = []
        for p in params:
            parts = [r.sq_norms.get(p) for r in passes]
            parts = [x if x is not None else torch.zeros(r.batch_size, device=p.device, dtype=p.dtype)
                     for x, r in zip(parts, passes)]
            result.append(parts[0] if len(parts) == 1 else torch.cat(parts) if parts
                          else torch.zeros(0, device=p.device, dtype=p.dtype))
        return result

    def check_kept_calls(self) -> None:
        """Raise (consuming nothing) if a tensor kept for a clipped sum was written in place
        since its backward pass (see :mod:`~opacus_dp.grad_sample.modification_guard`)."""
        refuse_changed_kept_calls(self._resolved)

    def clipped_sums(self, params: Sequence[torch.Tensor],
                     factors: Sequence[torch.Tensor]) -> List[Optional[torch.Tensor]]:
        """``Σ_i f_i g_i`` per param (None if it has no gradient); consumes the passes."""
        self.check_kept_calls()
        return passes_clipped_sums(self._take(), params, factors)

    def _take(self) -> List[Pass]:
        with self._lock:
            taken, self._resolved = self._resolved, []
            self.tasks.clear()
            self._input_grams.end_pass()
            return taken

    def clear(self) -> None:
        """Drop every recorded call and unconsumed pass (pending-call counts are kept)."""
        with self._lock:
            self._open.clear()
            self._resolved = []
            self.tasks.clear()
            self._summing = None
            self._input_grams.end_pass()


def _settle(current: Pass) -> None:
    """Recompute kept inputs whose activation's backward has run (see ``RecomputedInput.settle``):
    in place, while the activation's input is still in cache, instead of at the step."""
    if current.unsettled:
        current.unsettled = [r for r in current.unsettled if not r.settle()]
