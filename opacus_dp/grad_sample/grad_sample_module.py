"""``GradSampleModule``: per-sample gradients for (almost) any ``nn.Module``.

The wrapper registers hooks on the user's own submodules; it never copies them.

* forward hook (with kwargs) of every layer owning parameters: keeps the call's inputs
  (detached) and registers one gradient hook on that call's outputs;
* that gradient hook fires during backward with ``backprops = dLoss/dOutput`` of exactly
  that call, computes the per-sample gradients with the registered sampler of the
  layer's exact type, or the generic ``torch.func`` fallback, and adds them to a side
  table (see :mod:`per_sample_store` for the sum-within / concatenate-across rule).

After ``loss.backward()`` every trainable parameter ``p`` has ``p.grad_sample`` of shape
``(B, *p.shape)``: row ``i`` is the gradient of sample ``i``'s own loss term. For
``loss_reduction="mean"`` the backprops are multiplied by the call's batch size ``B`` to
undo the ``1/B`` of the mean. Gradient hooks are tied to one call's outputs (not to the
module), so in-place operations after a layer (``ReLU(inplace=True)``), calls whose
outputs never reach the loss, and evaluation passes leave no stale state behind
(module-level full backward hooks are not used: torch forbids in-place changes of the
outputs they wrap). A layer called on one sample that is broadcast over the batch (position ids
of shape ``(1, T)``) is called on its inputs expanded to the batch (a view), which makes its
per-sample gradients exact (:mod:`~opacus_dp.grad_sample.broadcast_inputs`).

The hooks on the user's layers refer to their wrapper weakly: a wrapper dropped without ``close()``
is collected while the model lives on, and a finalizer removes all it attached (:class:`_Attachments`).
"""

import threading
import weakref
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn as nn

from opacus_dp.distributed import data_parallel
from opacus_dp.grad_sample.running_statistics import guard_running_statistics
from opacus_dp.grad_sample.functorch_fallback import check_fallback_inputs, explained_fallback_error, functorch_grad_sample
from opacus_dp.grad_sample.attachments import _HOOKED_BY, _Attachments, _owner, weakly
from opacus_dp.grad_sample.broadcast_inputs import BroadcastInputs
from opacus_dp.grad_sample.compiled_modules import adopt_compiled_call, prepare_for_compile
from opacus_dp.grad_sample.grad_sample_api import GradSampleModuleAPI
from opacus_dp.grad_sample.outside_use_totals import OutsideUseTotals
from opacus_dp.grad_sample.layer_call import (LayerCall, batch_first_backprops, call_batch_dim, hook_output_grad,
                                             per_sample_output_grads, refuse_inference_tensors, separate_outputs)
from opacus_dp.grad_sample.replicas import has_data_parallel, has_replicas, master_grad_samples, needs_weight_grads
from opacus_dp.grad_sample.per_sample_store import PerSampleGradStore
from opacus_dp.grad_sample.registry import GRAD_SAMPLERS, SAVED_STATISTICS, find_sampler
from opacus_dp.grad_sample.joined_step_calls import JoinedStepCalls, joinable_cells, own_hook_ids
from opacus_dp.grad_sample.bookkeeping.weight_grad_skipping import OutsideUseCheck, Switches
from opacus_dp.grad_sample.bookkeeping.weight_grad_skipping import skip_weight_grads as install_skipping
from opacus_dp.grad_sample.support import autocast_of, describe, same_autocast, unsupported_modules
from opacus_dp.grad_sample.traced_forward import tapped_forward
from opacus_dp.grad_sample.traced_taps import TracedTaps
from opacus_dp.module_parameters import (has_trainable_parameters, is_fsdp_module, is_sharded_model, own_parameters,
                                         register_canonical_if_sharded, to_canonical)

_RECOMPUTING = threading.local()


class GradSampleModule(GradSampleModuleAPI, nn.Module):
    """Wraps ``module`` so that each trainable parameter gets ``p.grad_sample``.

    Args:
        module: the model; hooks are added to its submodules in place.
        batch_first: inputs have the batch on dimension 0 (else dimension 1, e.g.
            ``(T, B, ...)``). Layer types with ``_dp_batch_dim = 0`` and
            ``nn.EmbeddingBag`` always have it on dimension 0.
        loss_reduction: ``"mean"`` or ``"sum"``, how the loss aggregates the samples.
        strict: raise ``UnsupportedModuleError`` at construction if a submodule with
            trainable parameters cannot get per-sample gradients; otherwise such
            submodules are left without hooks.
        force_functorch: use the ``torch.func`` fallback for every layer but
            ``nn.EmbeddingBag`` (its bags, cut by ``offsets``, are not rows of a tensor).
        skip_weight_grads: do not let autograd compute the hooked layers' own weight gradients
            (see :mod:`~opacus_dp.grad_sample.bookkeeping.weight_grad_skipping`; the DP optimizer forms
            ``p.grad`` from the per-sample gradients): a third less backward arithmetic for
            Linear layers, and a use of a parameter outside its module is refused. ``p.grad``
            then stays None after ``loss.backward()`` (call :meth:`disable_hooks` for an ordinary
            gradient). Never done for models with ``nn.DataParallel`` or
            ``DistributedDataParallel`` inside (replicas, reducer), where it is ignored.
        check_sample_independence, public_buffers: refuse a model whose samples mix, or that writes a
            buffer not named in ``public_buffers`` (:mod:`~opacus_dp.grad_sample.model_checks`).

    Accumulation: per-sample gradients of all calls made for one backward pass (loops,
    RNN time steps, tied weights, several forwards added into one loss) are summed;
    each further forward/backward pair on a new batch is concatenated along dim 0
    (virtual steps) until :meth:`pop_grad_samples`, :meth:`zero_grad_sample` or
    :meth:`zero_grad` clears them (:meth:`pending_passes` counts them). Two backward passes
    over the SAME samples therefore give each sample two rows, each clipped on its own (twice
    the sensitivity): add the losses and call backward once instead. Read them as
    ``p.grad_sample``, or consume them with :meth:`pop_grad_samples`. :meth:`close` removes
    every hook and attribute; so does the collection of a wrapper dropped without it (the
    model does not keep its wrapper alive: keep the wrapper, or the optimizer reading from it,
    for as long as the hooks should record).
    """

    _tracks_producers = False  # LayerCall.capture(track_producers=...): subclasses that keep inputs

    def __init__(
        self,
        module: nn.Module,
        batch_first: bool = True,
        loss_reduction: str = "mean",
        strict: bool = True,
        force_functorch: bool = False,
        skip_weight_grads: bool = False,
        check_sample_independence: bool = True, public_buffers: Sequence[str] = (),
    ):
        super().__init__()
        self._check_arguments(module, batch_first, loss_reduction)
        errors = self.validate(module, strict=strict)
        self._module = module
        sharded = register_canonical_if_sharded(module)  # FSDP2: key by the sharded parameters
        self.batch_first = batch_first
        self.loss_reduction = loss_reduction
        self.force_functorch = force_functorch
        self.hooks_enabled = True
        self.unsupported = [str(e) for e in errors]
        self._store = PerSampleGradStore(batch_first, loss_reduction)
        self._attached = _Attachments(module, self._store, weakref.ref(self))
        self._handles = self._attached.handles
        self._finalizer = weakref.finalize(self, self._attached.detach)
        self._finalizer.atexit = False
        data_parallel.refuse_unsupported_replicas(module, lambda m: self._sampler_for(m) is not None)
        self._broadcast = BroadcastInputs(batch_first, weakly(self._recording, False))
        self.skips_weight_grads = bool(skip_weight_grads) and not needs_weight_grads(module)
        self._taps = TracedTaps(batch_first, self.skips_weight_grads,  # torch.compile: traced_taps
                                enabled=not has_data_parallel(module) and not sharded)
        self._traced: Dict[int, object] = {}
        self._add_hooks()
        self._store.show_absent([p for _, p in self.trainable_parameters()])  # as Opacus 1.x
        self._handles.extend(guard_running_statistics(module, weakly(self._recording, False)))
        if self._handles:
            data_parallel.acquire(self)
        self.configure_model_checks(check_sample_independence, public_buffers)
        if self.skips_weight_grads:
            self._skip_weight_grads()
        elif not has_replicas(module) and not sharded:  # FSDP2 reduces p.grad across ranks
            self._compare_pass_totals()
        prepare_for_compile(self)  # torch.compile: see compiled_modules
        self._join_step_calls()

    def _skip_weight_grads(self) -> None:
        self._outside_use = OutsideUseCheck({id(p): n for n, p in self._module.named_parameters()})
        self._switches = self._attached.switches = Switches()
        for layer in self._hooked_layers():
            handles = install_skipping(layer, weakly(self._recording, False), self._outside_use,
                                       recomputing=lambda: getattr(_RECOMPUTING, "active", False),
                                       switches=self._switches)
            self._traced.update({handle.id: self._taps.passive for handle in handles})
            self._handles.extend(handles)
        self._handles.append(self._outside_use)

    def _join_step_calls(self) -> None:
        """Recurrent cells record their step projection as one call per run where this wrapper
        hooks it (:mod:`~opacus_dp.grad_sample.joined_step_calls`); not under FSDP2,
        nor for the ``torch.func`` recomputation of every layer."""
        self._joined_calls: List[JoinedStepCalls] = []
        if self.force_functorch or is_sharded_model(self._module):
            return
        for path, cell in joinable_cells(self._module):
            hooks = {layer: own_hook_ids(self._handles, layer) for layer in (cell.ih, cell.hh)}
            if all(hooks.values()):
                self._joined_calls.append(JoinedStepCalls(self, path, cell, hooks))
                self._handles.append(self._joined_calls[-1].install())
        self._taps.on_tapped = weakly(self._plan_traced_joins)
        self._taps.on_finished = weakly(self._end_traced_joins)

    def _plan_traced_joins(self) -> None:
        for joined in self._joined_calls:  # before a tapped (compiled) forward
            joined.plan_traced(self)

    def _end_traced_joins(self) -> None:
        for joined in self._joined_calls:
            joined.end_traced()

    def _record_joined_steps(self, path: str, hh: nn.Module, inputs: torch.Tensor, gates: torch.Tensor,
                             traced: bool = False) -> None:
        """One call of ``hh`` on ``inputs`` (its steps' inputs, ``(B, T, H)``) whose output gradient
        is that of ``gates`` (``traced``: the input projection's tap, after a compiled forward)."""
        self._capture(path, hh, hh, (inputs,), {}, gates, traced=traced)

    def _compare_pass_totals(self) -> None:
        """Weight gradients kept: find outside uses from each pass's totals (outside_use_totals)."""
        names = {id(p): n for n, p in self._module.named_parameters()}
        self._store.totals = OutsideUseTotals(names, self._handles)

    def _restore_switches(self) -> None:
        """Parameters left switched off by an interrupted forward get requires_grad back."""
        if self.skips_weight_grads:
            self._switches.restore()

    def _consumed(self) -> None:
        """The optimizer took the per-sample state of the pending batches."""
        if self.skips_weight_grads:
            self._switches.restore()
            self._outside_use.reset()

    def _hooked_layers(self) -> List[nn.Module]:
        return [m for m in self._module.modules() if _owner(m) is self]

    def _recording(self) -> bool:
        """The hooks record this call (not disabled, not a fallback's recomputation)."""
        return self.hooks_enabled and not getattr(_RECOMPUTING, "active", False)

    # ------------------------------------------------------------------ hooks
    def _add_hooks(self) -> None:
        bad = {id(m) for _, m, _ in unsupported_modules(self._module)}
        for path, sub in self._module.named_modules():
            if not own_parameters(sub) or id(sub) in bad:
                continue
            hook = self._make_forward_hook(path, sub)
            broadcast = self._broadcast.attach_to_layer(sub)
            first = not (is_fsdp_module(sub) and self._sampler_for(sub) is None)  # see own_forward.py
            capture = sub.register_forward_hook(hook, with_kwargs=True, prepend=first)
            self._traced[broadcast.id] = self._taps.traced_pre_hook(path, self._broadcast.expand_for_tap)
            self._traced[capture.id] = self._taps.traced_hook(path, sub)
            self._handles.extend([broadcast, capture])
            _HOOKED_BY[sub] = self._attached.token
        if self._handles:  # the model's forward: where broadcast calls learn the batch size
            self._handles.extend(self._broadcast.attach_to_model(self._module, self._traced))

    def _make_forward_hook(self, path: str, master: nn.Module):
        wrapper = self._attached.token  # the model must not keep its wrapper alive

        def forward_hook(layer, args, kwargs, output):
            live = wrapper()
            return None if live is None else live._capture(path, master, layer, args, kwargs, output)

        return forward_hook

    def _capture(self, path, master, layer, args, kwargs, output, traced: bool = False):
        """Forward hook body: record the call and hook its outputs' gradients.

        Returns None (output unchanged) or, for a layer with several differentiable
        outputs, the output with those tensors replaced by clones (see ``separate_outputs``).
        ``traced``: a call of a compiled forward recorded after it (its inputs are the graph's
        outputs, ``output`` its tap: :mod:`~opacus_dp.grad_sample.traced_taps`); its inputs are
        kept as they are and a norm layer's statistics computed again.
        """
        if not self.hooks_enabled or getattr(_RECOMPUTING, "active", False):
            return None
        if not torch.is_grad_enabled() or not has_trainable_parameters(master):
            return None
        replaced, outputs, hooked = separate_outputs(output)
        if not hooked:
            return None
        batch_dim = call_batch_dim(layer, self.batch_first, outputs[hooked[0]])
        self._taps.note(path, master, layer, args, kwargs, outputs, hooked, batch_dim)
        batch_size = self._batch_size(path, master, outputs[hooked[0]], batch_dim)
        if batch_size == 0:  # no per-sample gradients; the backward pass still is a batch
            for _, param in own_parameters(master):
                if param.requires_grad:
                    self._store.add_empty(param)
            hook_output_grad(outputs[hooked[0]], lambda grad: self._store.mark_empty_pass())
            return replaced
        refuse_inference_tensors(args, kwargs, describe(path, master))
        call = LayerCall.capture(args, kwargs, batch_dim, batch_size,
                                  track_producers=self._tracks_producers and not traced)
        if self._store.totals is not None:
            self._store.totals.watch_layer(master, autocast_of(master) is not None)
        call.outer_task = torch._C._current_graph_task_id()
        if call.outer_task != -1:  # recomputed during a backward pass (activation checkpointing)
            self._open_outer_pass(call, describe(path, master))
        reader = None if self.force_functorch or traced else find_sampler(SAVED_STATISTICS, layer)
        if reader is not None:
            call.statistics = reader(layer, output)
        if self._sampler_for(layer) is None:
            check_fallback_inputs(describe(path, master), master, call)
            call.autocast = autocast_of(master)
        chunk = data_parallel.chunk_of(layer, master, describe_layer=describe(path, master),
                                       uses_registered_sampler=self._sampler_for(layer) is not None)

        n_outputs = len(outputs)  # not the outputs themselves: the hook must not keep them alive

        def on_output_grads(grads: "Sequence[Optional[torch.Tensor]]") -> None:  # no typing work per call
            self._on_backward(path, master, layer, call, hooked, n_outputs, grads, chunk)

        if len(hooked) == 1:
            # A plain tensor hook: register_multi_grad_hook's closure refers to the output's
            # autograd node, a cycle the garbage collector frees only one graph node per pass,
            # which kept whole graphs (and the recorded inputs) alive after backward.
            hook_output_grad(outputs[hooked[0]], lambda grad: on_output_grads([grad]))
        else:
            torch.autograd.graph.register_multi_grad_hook(
                [outputs[i] for i in hooked], on_output_grads
            )
        return replaced

    def _open_outer_pass(self, call: LayerCall, layer_name: str) -> None:
        """A call made while a backward pass runs belongs to that pass: a reentrant checkpoint
        (``torch.utils.checkpoint(..., use_reentrant=True)``) recomputes its block there and
        backpropagates through it in a nested backward pass, whose per-sample gradients are
        each sample's share of the same loss (a pass of their own would split every sample into
        two separately clipped rows). The outer pass is opened now, while its task runs."""
        self._store.open_pass(call.outer_task)

    def _batch_size(self, path, master, output: torch.Tensor, batch_dim: int) -> int:
        if output.dim() <= batch_dim:
            raise ValueError(
                f"{describe(path, master)} returned an output of shape {tuple(output.shape)} "
                f"without a batch dimension {batch_dim} (batch_first={self.batch_first}); "
                f"pass batched inputs or set batch_first to match the data layout"
            )
        return output.shape[batch_dim]

    def _sampler_for(self, layer: nn.Module):
        if self.force_functorch and not isinstance(layer, nn.EmbeddingBag):
            return None
        return find_sampler(GRAD_SAMPLERS, layer)

    def _on_backward(self, path, master, layer, call, hooked, n_outputs, grads, chunk=0) -> None:
        """Gradient hook body: per-sample gradients of one call, added to the table."""
        if not self.hooks_enabled:
            return
        scale = call.batch_size if self.loss_reduction == "mean" else None
        grads = per_sample_output_grads(master, grads)  # float16 under autocast: in float32
        backprops = batch_first_backprops(call, hooked, n_outputs, grads, scale)
        if backprops is None:
            return
        layer_name = describe(path, master)
        if call.released:
            raise RuntimeError(
                f"{layer_name}: a second backward pass through the same graph "
                f"(retain_graph=True) is not supported with per-sample gradients; "
                f"run a new forward pass for each backward pass"
            )
        call.check_unmodified(layer_name)
        grad_samples = self._per_sample_grads(layer, call, backprops)
        call.release()
        for param, grad_sample in master_grad_samples(master, layer, grad_samples).items():
            self._store.add(param, grad_sample, layer_name, chunk, task=call.outer_task)

    def _per_sample_grads(self, layer, call: LayerCall, backprops) -> Dict:
        """The single dispatch point: registered sampler, else the torch.func fallback; keyed by
        the layer's canonical tensors (FSDP2: the sharded ones, :mod:`~opacus_dp.module_parameters`)."""
        return to_canonical(layer, self._sampled_grads(layer, call, backprops))

    def _sampled_grads(self, layer, call: LayerCall, backprops) -> Dict:
        sampler = self._sampler_for(layer)
        if sampler is not None:
            if backprops[0] is None:
                return {}
            extra = {} if call.statistics is None else {"statistics": call.statistics}
            return sampler(layer, call.activations(layer), backprops[0], **extra)
        args, kwargs = call.batch_first_inputs()
        _RECOMPUTING.active = True
        try:
            with same_autocast(call.autocast):  # the recomputed forward casts as the call did
                return functorch_grad_sample(layer, list(args), backprops, kwargs, call.batch_dim)
        except RuntimeError as error:
            raise explained_fallback_error(error, self._describe_layer(layer)) from error
        finally:
            _RECOMPUTING.active = False

    def _describe_layer(self, layer: nn.Module) -> str:
        """``layer``'s path for a message (its type alone for a ``DataParallel`` replica)."""
        path = next((p for p, m in self._module.named_modules() if m is layer), None)
        return describe(path, layer) if path is not None else type(layer).__name__

    # ------------------------------------------------------------- public API
    def forward(self, *args, **kwargs):
        self._restore_switches()
        if adopt_compiled_call(self) or torch.compiler.is_compiling() and self._taps.enabled:
            return tapped_forward(self, args, kwargs)
        self._taps.compiled_forward = False
        return self._module(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            wrapped = self.__dict__.get("_modules", {}).get("_module")
            if name == "_module" or wrapped is None:
                raise
            return getattr(wrapped, name)
