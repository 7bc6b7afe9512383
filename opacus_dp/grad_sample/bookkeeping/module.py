"""``BookkeepingGradSampleModule``: per-sample norms and clipped sums, no per-sample gradients.

The same hooks as :class:`~opacus_dp.grad_sample.GradSampleModule` (forward hook keeps a
call's inputs, gradient hook gets its output gradients), but the backward hook only
*records* the call in a :class:`~opacus_dp.grad_sample.bookkeeping.Bookkeeper`; the
optimizer then asks this module (its own
:class:`~opacus_dp.per_sample_source.GradSource`) for

* ``per_sample_norms(params)``: ``‖g_i‖₂`` per parameter, shape ``(B,)``;
* ``clipped_sums(params, factors)``: ``Σ_i f_i g_i`` per parameter,

so one step is: norms → clip factors (the clipper) → clipped sums, for flat and per-layer
clipping alike. No ``p.grad_sample`` is produced. Per layer, the norm comes from the ghost
identity or from materialised per-sample gradients (``layer_rule``, see
:mod:`~opacus_dp.grad_sample.bookkeeping.bookkeeper`); layers without a norm sampler are materialised
transparently.

By default autograd's own weight gradients are not computed (see
:mod:`~opacus_dp.grad_sample.bookkeeping.weight_grad_skipping`), except under
``torch.nn.parallel.DistributedDataParallel``, whose reducer expects every parameter to
receive a gradient. So, while the wrapper's hooks are enabled, ``p.grad`` stays ``None``
after ``loss.backward()`` (the optimizer sets it in ``step()``); call
:meth:`disable_hooks` for an ordinary (non-private) gradient. ``nn.DataParallel`` is not
supported (use ``grad_sample_mode="hooks"``).
"""

import inspect
import weakref
from contextlib import contextmanager
from typing import List, Optional, Sequence

import torch
import torch.nn as nn
from torch.nn.parallel import DataParallel

from opacus_dp.grad_sample.bookkeeping.bookkeeper import Bookkeeper
from opacus_dp.grad_sample.bookkeeping.passes import shared_layers
from opacus_dp.grad_sample.bookkeeping.step_gradients import step_projections
from opacus_dp.grad_sample.attachments import weakly
from opacus_dp.grad_sample.grad_sample_module import GradSampleModule
from opacus_dp.grad_sample.layer_call import batch_first_backprops
from opacus_dp.maths.cpu_products import cpu_products
from opacus_dp.maths.float32_products import ieee_float32_products
from opacus_dp.grad_sample.support import describe
from opacus_dp.maths.per_sample import is_loss_scaled
from opacus_dp.module_parameters import has_trainable_parameters, is_sharded_model, local_part
from opacus_dp.per_sample_source import NO_GRADS, FactorFunction, NameOf


SCALED_SUMS_FROM_BACKWARD = (
    "torch.amp.GradScaler with clipped sums formed during the backward pass (the 'ghost' mode's "
    "two-pass loss.backward(), or per-layer clipping): their clip factors came from norms still "
    "multiplied by the loss scale, known only at scaler.step(). In 'ghost' scale the loss tensor, "
    "scaler.scale(loss.value).backward() (one book-keeping pass); nothing was updated")


def _refuse_data_parallel(module: nn.Module) -> None:
    for path, sub in module.named_modules():
        if isinstance(sub, DataParallel):
            raise ValueError(
                f"{describe(path, sub)}: the norms-only modes ('ghost', 'bk') do not support "
                "nn.DataParallel; use grad_sample_mode='hooks', or DistributedDataParallel"
            )


class BookkeepingGradSampleModule(GradSampleModule):
    """Wraps ``module`` for the ``ghost``/``bk`` modes (see the module doc).

    Args:
        module, batch_first, loss_reduction, strict: as for ``GradSampleModule``.
        layer_rule: ``"mixed"`` (per layer the cheaper of ghost norm and materialised
            per-sample gradients; the ``bk`` and ``ghost`` modes) or ``"ghost"`` (ghost norm
            wherever the layer type has one, as Opacus's ghost clipping; slower for layers
            with many positions, e.g. early convolutions, as its Gram products grow with the
            square of the positions).
        skip_weight_grads: as for ``GradSampleModule`` (default here: True).
        check_sample_independence, public_buffers: as for ``GradSampleModule``.
    """

    _tracks_producers = True  # kept ghost inputs may be held as their activation's input

    def __init__(self, module: nn.Module, batch_first: bool = True, loss_reduction: str = "mean",
                 strict: bool = True, layer_rule: str = "mixed",
                 skip_weight_grads: bool = True, check_sample_independence: bool = True,
                 public_buffers: Sequence[str] = ()):
        if isinstance(module, nn.Module):
            _refuse_data_parallel(module)
        cpu_products()  # an invalid OPACUS_DP_CPU_PRODUCTS is refused here, not at the first step
        # no reference cycle through the wrapper, and none from the store (kept by the
        # wrapper's finalizer) to it: a dropped wrapper is freed (see GradSampleModule)
        self._bookkeeper = Bookkeeper(weakly(self._per_sample_grads), layer_rule)
        super().__init__(module, batch_first=batch_first, loss_reduction=loss_reduction,
                         strict=strict, skip_weight_grads=skip_weight_grads,
                         check_sample_independence=check_sample_independence, public_buffers=public_buffers)
        self._bookkeeper.shared_layers = shared_layers(self._hooked_layers())
        self._bookkeeper.step_layers = step_projections(self._module)
        store, bookkeeper = self._store, weakref.ref(self._bookkeeper)
        self._bookkeeper.other_batches = lambda: store.passes
        store.other_batches = lambda: getattr(bookkeeper(), "num_passes", 0)
        store.counted_elsewhere = lambda task: task in getattr(bookkeeper(), "tasks", ())

    @property
    def layer_rule(self) -> str:
        return self._bookkeeper.layer_rule

    # ------------------------------------------------------------------ hooks
    def _record_joined_steps(self, path: str, hh: nn.Module, inputs: torch.Tensor, gates: torch.Tensor,
                             traced: bool = False) -> None:
        """As the base wrapper's; the call's output gradient is its cell's input projection's,
        which is resolved with it (the bookkeeper's joined calls)."""
        super()._record_joined_steps(path, hh, inputs, gates, traced)
        if self._recording() and torch.is_grad_enabled():
            self._bookkeeper.expect_joined(hh)

    def _capture(self, path, master, layer, args, kwargs, output, traced: bool = False):
        """The forward hook of GradSampleModule, plus: count the call as awaiting its backward
        (counted whenever it may have been hooked; an excess count only delays resolution).
        A call through a copy of the layer (an ``nn.DataParallel`` replica of the wrapper) is
        refused: the book-keeping keys calls by layer, so two replicas' calls on different
        samples would be merged as one sample's calls (clipped together)."""
        if layer is not master and self._recording() and torch.is_grad_enabled() \
                and has_trainable_parameters(master):
            raise ValueError(
                f"{describe(path, master)} was called through a copy of the layer (an "
                "nn.DataParallel replica of the private model?): the norms-only modes ('ghost', "
                "'bk') do not support nn.DataParallel; use grad_sample_mode='hooks', or "
                "DistributedDataParallel")
        replaced = super()._capture(path, master, layer, args, kwargs, output, traced)
        if self._recording() and torch.is_grad_enabled() and has_trainable_parameters(master):
            self._bookkeeper.expect_call(master, args)
        return replaced

    def _open_outer_pass(self, call, layer_name: str) -> None:
        """See :meth:`GradSampleModule._open_outer_pass`."""
        self._bookkeeper.open_pass(call.outer_task, call.batch_size, layer_name)

    def _on_backward(self, path, master, layer, call, hooked, n_outputs, grads, chunk=0) -> None:
        """Record the call (batch-first output gradients, loss-reduction scale) for later."""
        if not self.hooks_enabled:
            return
        backprops = batch_first_backprops(call, hooked, n_outputs, grads)
        if backprops is None:
            return
        if call.released:
            raise RuntimeError(
                f"{describe(path, master)}: a second backward pass through the same graph "
                "(retain_graph=True) is not supported with per-sample gradients (except the "
                "'ghost' mode's own two passes); run a new forward pass for each backward pass"
            )
        call.check_unmodified(describe(path, master))
        scale = float(call.batch_size) if self.loss_reduction == "mean" else 1.0
        self._bookkeeper.record(master, describe(path, master), call, backprops, scale)

    # ------------------------------------------------------------------ grad source
    def grad_source(self) -> "BookkeepingGradSampleModule":
        """This wrapper: it is its own :class:`~opacus_dp.per_sample_source.GradSource`."""
        return self

    def per_sample_norms(self, params: Sequence[torch.Tensor],
                         name_of: Optional[NameOf] = None) -> List[torch.Tensor]:
        """``‖g_i‖₂`` of every param, shape ``(B,)`` (B summed over unconsumed passes), NaN or
        inf included (the optimizer drops those samples, :mod:`opacus_dp.optim.nonfinite`); errors
        name the parameters as the wrapped model does (``name_of`` is not needed)."""
        if self._bookkeeper.num_passes == 0:
            return self._norms_without_passes(params)
        if is_loss_scaled() and self.has_sums_from_backward:
            raise RuntimeError(SCALED_SUMS_FROM_BACKWARD)
        self._check_unrecorded_grads(params)
        self._store.clear()  # empty batches merged into this step add no rows
        return [sq.clamp(min=0).sqrt_() for sq in self._bookkeeper.sq_norms(params)]

    def _param_name(self, p: torch.Tensor) -> str:
        """``p``'s name in the wrapped model (its shape if it is not there), for messages."""
        return next((n for n, q in self._module.named_parameters() if q is p), str(tuple(p.shape)))

    def _norms_without_passes(self, params) -> List[torch.Tensor]:
        """Empty batches leave zero-row ``grad_sample`` views (see GradSampleModule)."""
        empty = self._store.pop_all()
        if params and not empty:
            raise RuntimeError(NO_GRADS)
        return [torch.zeros(0, device=p.device, dtype=p.dtype) for p in params]

    def _check_unrecorded_grads(self, params) -> None:
        recorded = self._bookkeeper.recorded_params()
        for p in params:
            if p not in recorded and p.grad is not None and bool(torch.any(local_part(p.grad) != 0)):
                raise ValueError(
                    f"parameter {self._param_name(p)} has a gradient but no per-sample "
                    "gradient: it is used outside the modules that own it, or its module is not "
                    "handled by the wrapper"
                )

    def clipped_sums(self, params: Sequence[torch.Tensor],
                     factors: Sequence[torch.Tensor]) -> List[Optional[torch.Tensor]]:
        """``Σ_i f_i g_i`` per param for the factors of :meth:`per_sample_norms`; consumes."""
        self._consumed()
        with ieee_float32_products(params[0].device if params else None):  # one switch for all layers
            return self._bookkeeper.clipped_sums(params, factors)

    def set_factor_function(self, factor_function: Optional[FactorFunction]) -> None:
        """``factor_function(param, norms) -> (B,) factors or None`` (the optimizer's clipper):
        where it gives a parameter's factors from its own norms (per-layer clipping), the
        ``bk`` backward pass computes that layer's clipped sum at once and keeps none of its
        inputs or output gradients (memory close to non-private); None restores keeping them.
        A bound method (the optimizer's) is held weakly, so that the optimizer and this wrapper
        form no reference cycle; once its object is gone it gives None."""
        if inspect.ismethod(factor_function):
            factor_function = weakly(factor_function)
        self._bookkeeper.factor_function = factor_function

    @property
    def forms_sums_in_backward(self) -> bool:
        """Whether a factor function is set (:meth:`set_factor_function`) and used (rows are
        not grouped into privacy units of several rows: those norms wait for the step)."""
        return self._bookkeeper.factor_function is not None and self.unit_channel is None

    @property
    def has_sums_from_backward(self) -> bool:
        """Whether an unconsumed pass holds clipped sums formed during its backward pass (with
        factors fixed then: per-layer clipping, or the ``ghost`` mode's sums pass)."""
        return self._bookkeeper.has_sums_from_backward()

    def last_per_sample_norms(self, params: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """``‖g_i‖₂`` of the last finished backward pass only (for the two-pass backward)."""
        return [sq.clamp(min=0).sqrt_() for sq in self._bookkeeper.sq_norms(params, last_only=True)]

    @property
    def num_passes(self) -> int:
        """Finished backward passes whose norms and sums were not consumed yet."""
        return self._bookkeeper.num_passes

    def pending_passes(self) -> int:
        """Batches that the next step combines: the accountant counts each (the ``ghost``
        mode's two passes over one batch are one; a backward pass over an empty batch is one)."""
        return self._bookkeeper.num_passes + self._store.passes

    @property
    def supports_two_passes(self) -> bool:
        """The two-pass backward of the ``ghost`` mode needs no autograd weight gradients (a
        second backward through ``DistributedDataParallel`` would reduce twice) and no FSDP2
        model: there every backward pass is a collective (all-gathers), so a rank whose local
        batch is empty (no second pass needed) would leave the others waiting; one pass is
        equally correct and gathers the shards once. Nor after a compiled forward (traced taps):
        a compiled backward may free ("donate") the buffers a second pass through it needs."""
        return (self.skips_weight_grads and not is_sharded_model(self._module) and self.unit_channel is None
                and not self._taps.compiled_forward)

    @contextmanager
    def norms_pass(self):
        """Backward passes inside keep norms and materialised gradients, not ghost calls."""
        self._bookkeeper.keep_ghost_calls = False
        try:
            yield
        finally:
            self._bookkeeper.keep_ghost_calls = True

    @contextmanager
    def sums_pass(self, params: Sequence[torch.Tensor], factors: Sequence[torch.Tensor]):
        """A backward pass inside recomputes the last pass's output gradients and adds the
        ghost layers' clipped sums with ``factors`` at once."""
        self._bookkeeper.begin_sums(params, factors)
        try:
            yield
        finally:
            self._bookkeeper.end_sums()

    def clear(self, params=None) -> None:
        """Drop all recorded per-sample information (the provider's ``zero_grad``)."""
        self.zero_grad_sample()

    def layer_modes(self):
        """``{layer: "ghost" | "materialised" | "chunked"}`` chosen for the unconsumed passes."""
        return self._bookkeeper.layer_modes()

    def configure_units(self, channel) -> None:
        """Rows grouped into privacy units (see the base class): norms per unit formed at the step
        (:mod:`~opacus_dp.grad_sample.bookkeeping.grouped_units`); one book-keeping pass (no
        two-pass backward)."""
        super().configure_units(channel)
        self._bookkeeper.units = channel

    # ------------------------------------------------------------------ state
    def zero_grad_sample(self) -> None:
        super().zero_grad_sample()
        self._bookkeeper.clear()

    def forbid_grad_accumulation(self) -> None:
        super().forbid_grad_accumulation()
        self._bookkeeper.accumulation_allowed = False

    def allow_grad_accumulation(self) -> None:
        super().allow_grad_accumulation()
        self._bookkeeper.accumulation_allowed = True

    def remove_hooks(self) -> None:
        super().remove_hooks()
        self._bookkeeper.clear()
