"""DPOptimizer: one private step around any ``torch.optim`` optimizer.

One logical step (``step()``), for the trainable tensors ``l`` of the wrapped optimizer:

1. per-sample norms ``n_il = ‖g_il‖₂`` → clip factors ``f_il`` (a :mod:`clipping` strategy);
2. ``S_l += Σ_i f_il · g_il``, accumulated over virtual steps / skipped physical batches;
3. if the reducer adds noise: ``S_l += N(0, (σ · sensitivity)²)`` (once per logical step);
4. ``S = reducer.reduce(S)``; with several processes a step refused by one rank's checks is
   refused on every rank in this same all-reduce (:mod:`~opacus_dp.optim.step_refusal`);
5. ``mean`` reduction: ``p.grad = S / (expected_batch_size · world_size · k)``; ``sum``: ``S``;
   ``k = accumulated_iterations``, the batches merged by ``k`` backward passes before the
   step (Opacus 1.x; the accountant then records ``k·q``);
6. the wrapped optimizer's own step, then the step hooks (e.g. the privacy accountant).

Parameters of the wrapped optimizer without ``requires_grad`` get ``p.grad = None`` before
the inner step, so it never applies a gradient that was not clipped and noised.

Half-precision parameters (float16, bfloat16): norms, clip factors, ``S_l`` and the noise are
formed in float32 (:func:`~opacus_dp.optim.clipping.sum_dtype`) and ``p.grad`` is cast to the
parameter's dtype only after the noise — a cast after the noise is post-processing, while rounding ``S_l`` before it could
move the sum by up to a unit in the last place of its own magnitude, beyond what one clipped
sample may change (and per-sample norms rounded to 8 bits could leave a clipped sample up to
a relative 2⁻⁸, about 0.4 %, above the bound).

Abadi et al. 2016, "Deep Learning with Differential Privacy" (Algorithm 1). Dividing by the
*expected* batch size keeps the sensitivity of the average independent of the sampled
batch (Poisson sampling).
"""

from collections import OrderedDict, deque
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch
from torch.optim import Optimizer

from opacus_dp.maths.per_sample import known_drops, loss_scaled, sum_dtype
from opacus_dp.model_wrappers import parameter_names
from opacus_dp.optim.amp_scaling import (ScaledStep, refuse_attribute_contract,
                                         refuse_sums_formed_in_backward, unscaled)
from opacus_dp.optim.clipping import PerLayerClipper, make_clipper
from opacus_dp.optim.dp_optimizer_settings import DPOptimizerSettingsMixin
from opacus_dp.optim.logical_batches import BatchingPolicy, LogicalBatchMixin
from opacus_dp.optim.noise import GaussianNoise, noise_std
from opacus_dp.optim.nonfinite import DROP, screen_norms
from opacus_dp.optim.reduction import LocalReducer
from opacus_dp.optim.step_refusal import CollectiveRefusalMixin
from opacus_dp.optim.wrapped_optimizer import WrappedOptimizerMixin
from opacus_dp.per_sample_source import AttributeGradSource, GradSource, grad_source_for
from opacus_dp.optim.summed_grad_views import SummedGradViewsMixin
from opacus_dp.state_views import OPACUS_1X


def _check_expected_batch_size(expected_batch_size, loss_reduction: str):
    if loss_reduction not in ("mean", "sum"):
        raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
    if expected_batch_size is None:
        return None
    if isinstance(expected_batch_size, bool) or not isinstance(expected_batch_size, (int, float)) \
            or not expected_batch_size > 0:
        raise ValueError(f"expected_batch_size must be > 0, got {expected_batch_size!r}")
    return expected_batch_size


def dp_optimizer_behind(optimizer) -> Optional["DPOptimizer"]:
    """The DPOptimizer ``optimizer`` is (``make_private``'s), or the one a classic engine's
    ``attach`` put behind it; None for any other optimizer."""
    if isinstance(optimizer, DPOptimizer):
        return optimizer
    return getattr(getattr(optimizer, "privacy_engine", None), "_dp_optimizer", None)


class DPOptimizer(DPOptimizerSettingsMixin, LogicalBatchMixin, CollectiveRefusalMixin, SummedGradViewsMixin,
                  WrappedOptimizerMixin, Optimizer):
    """Differentially private wrapper of ``optimizer`` (SGD, Adam, AdamW, RMSprop, ...).

    Args:
        optimizer: the wrapped optimizer; its ``param_groups``/``state`` are shared.
        noise_multiplier: σ ≥ 0, noise std relative to the clipping sensitivity.
        max_grad_norm: C > 0 (a number), or one bound per trainable tensor for
            ``clipping="per_layer"``. ``float("inf")`` disables clipping (only with σ = 0).
        expected_batch_size: divisor of the ``mean`` reduction (``q · N`` under Poisson
            sampling). ``None`` divides by the number of samples actually accumulated
            (Opacus 0.x behaviour; sound only for batches of fixed, public size).
        loss_reduction: "mean" or "sum", as used by the loss.
        generator: ``torch.Generator`` for the noise; default: one seeded from the global RNG.
        secure_mode: OS-seeded noise robust to floating-point attacks (see :mod:`noise`).
        clipping: "flat" or "per_layer".
        reducer: combines replica sums (default :class:`LocalReducer`).
        grad_source: a :class:`~opacus_dp.per_sample_source.GradSource`, where per-sample
            norms and clipped sums come from (default: ``p.grad_sample``).
        param_names: ``{param: name}`` used in error messages.
        batching: the :class:`~opacus_dp.optim.logical_batches.BatchingPolicy` (default: k
            backward passes count as k batches, no size limit, no Poisson batches); its fields
            are readable as ``count_iterations``, ``max_batch_size``, ``poisson_batches``.
    """

    def __init__(self, optimizer: Optimizer, *, noise_multiplier: float,
                 max_grad_norm: Union[float, Sequence[float]], expected_batch_size: Optional[float],
                 loss_reduction: str = "mean", generator: Optional[torch.Generator] = None,
                 secure_mode: bool = False, clipping: Optional[str] = None, reducer=None,
                 grad_source: Optional[GradSource] = None,
                 param_names: Optional[Dict[torch.Tensor, str]] = None,
                 batching: Optional[BatchingPolicy] = None):
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, DPOptimizer):
            raise ValueError("optimizer is already a DPOptimizer: wrap the original optimizer")
        self.original_optimizer = optimizer
        self.noise_multiplier = noise_multiplier  # checked by the setter
        if clipping is None:
            clipping = "per_layer" if isinstance(max_grad_norm, (list, tuple)) else "flat"
        self._set_clipper(make_clipper(clipping, max_grad_norm))
        self._bound_index = {p: i for i, p in enumerate(self.params)}  # per-layer bound of each tensor
        self.loss_reduction = loss_reduction
        self.expected_batch_size = expected_batch_size  # checked by the setter
        self.noise = GaussianNoise(generator=generator, secure_mode=secure_mode)
        self.reducer = reducer if reducer is not None else LocalReducer()
        self.param_names = dict(param_names or {})
        self._use_grad_source(grad_source if grad_source is not None else AttributeGradSource())
        self._inner_step = optimizer.step
        self._inner_zero_grad = optimizer.zero_grad
        self._summed: Dict[torch.Tensor, torch.Tensor] = {}
        self._num_accumulated = 0
        self._last_num_accumulated = 0
        self._skip_signals = deque()
        self._pre_step_hooks: "OrderedDict[int, Callable]" = OrderedDict()
        self._step_hooks: "OrderedDict[int, Callable]" = OrderedDict()
        self.accumulated_iterations = 1
        self.batching = batching if batching is not None else BatchingPolicy()
        self.steps_taken = 0  # private steps released (checkpoints compare it with the history)
        self.use_state_views(OPACUS_1X)

    def _use_grad_source(self, source: GradSource) -> None:
        if not isinstance(source, GradSource):
            raise TypeError(f"grad_source must implement the GradSource protocol "
                            f"(opacus_dp.per_sample_source), got {type(source).__name__}")
        self.grad_source = source
        self._share_factor_function()

    def _share_factor_function(self) -> None:
        """Per-layer clipping: the source may form each layer's clipped sum during the backward
        pass (a tensor's factors need only its own norms); other clippers: only at the step."""
        per_layer = isinstance(self.clipper, PerLayerClipper)
        self.grad_source.set_factor_function(self._own_norm_factors if per_layer else None)

    def connect_grad_source(self, module) -> None:
        """Take per-sample gradients (or norms) from ``module``, a per-sample-gradient wrapper
        of the model this optimizer trains; names its parameters in error messages."""
        self._use_grad_source(grad_source_for(module))
        self.param_names.update(parameter_names(module))

    # ----------------------------------------------------------------- the private step
    # torch.amp.GradScaler passes itself to step(grad_scaler=...) and leaves unscaling and its
    # found_inf to the step (opacus_dp.optim.amp_scaling)
    _step_supports_amp_scaling = True
    non_finite_samples = DROP  # a sample with a NaN/inf norm: "drop" or "refuse" (nonfinite.py)
    _loss_scale: Optional[float] = None  # the GradScaler's scale while step() runs
    _loss_scale_ceiling: Optional[float] = None  # the first scale of a scaled step

    def step(self, closure: Optional[Callable[[], float]] = None, grad_scaler=None):
        """One private step (or only clip + accumulate if a skip was signalled):
        :meth:`pre_step`, then the inner optimizer's update. ``grad_scaler``: the
        ``torch.amp.GradScaler`` whose ``scaler.step(optimizer)`` calls this; norms and clipped
        sums are unscaled by its scale and it gets back a ``found_inf`` formed from released
        values only (:mod:`~opacus_dp.optim.amp_scaling`)."""
        refuse_attribute_contract(self)
        scaled = None if grad_scaler is None else ScaledStep(grad_scaler, self._loss_scale_ceiling)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._loss_scale = None if scaled is None else scaled.scale
        try:
            stepped = self.pre_step()
        finally:
            self._loss_scale = None
        if scaled is not None:
            self._loss_scale_ceiling = scaled.ceiling
            stepped = scaled.give_back(self, self.params, stepped) and stepped
        if not stepped:
            return loss
        result = self._inner_step()
        return loss if loss is not None else result

    def pre_step(self, closure: Optional[Callable[[], float]] = None) -> bool:
        """Everything of :meth:`step` but the inner optimizer's update (Opacus 1.x's name):
        clip and accumulate; unless a skip was signalled, add the noise, reduce across
        processes, set ``p.grad`` and record the step (step hooks: the accountant). Returns
        whether the inner optimizer should now step (for training loops that call it
        themselves)."""
        if closure is not None:
            with torch.enable_grad():
                closure()
        if self._skip_signals and self._skip_signals.popleft():
            self._accumulate_piece()
            return False
        refusal = self._local_refusal()  # several processes: decided in the all-reduce
        count = self.clipper.take_observation()  # adaptive clipping: its unclipped count
        sums = self._take_summed_grads()
        self._show_step_sums(sums)
        reduced = self._release(sums, count, refusal)  # noise, reduce (step_refusal.py)
        self._set_grads(self.scale_grad(reduced[:len(sums)]))
        if count is not None:  # the bound of the next step, from released values only
            self.clipper.update(float(reduced[-1]), self._expected_global_batch_size())
        self.steps_taken += 1
        self._run_hooks(self._step_hooks)
        return True

    def _check_step_allowed(self) -> None:
        """The checks of a logical step before anything of it is released (merged Poisson
        batches, the pre-step hooks such as the budget guard). A refused step drops its whole
        logical batch (:meth:`discard_unfinished_batch`): pieces accumulated before it must
        never join the next batch's step."""
        try:
            self.accumulated_iterations = self._pending_iterations()
            if self.poisson_batches and self.accumulated_iterations > 1:
                self._refuse_merging_poisson_batches(
                    f"one step over {self.accumulated_iterations} backward passes")
            self._run_hooks(self._pre_step_hooks)  # e.g. budget guard: may refuse the step
        except Exception:
            self.discard_unfinished_batch()
            raise

    @property
    def grad_samples(self) -> List[Optional[torch.Tensor]]:
        """``p.grad_sample`` of each parameter (None where there is none, e.g. in the
        norms-only modes), as Opacus's property."""
        return [getattr(p, "grad_sample", None) for p in self.params]

    @property
    def expected_batch_size(self) -> Optional[float]:
        """``E|B|`` (per process), the divisor of the ``mean`` reduction; checked when set."""
        return self._expected_batch_size

    @expected_batch_size.setter
    def expected_batch_size(self, value) -> None:
        self._expected_batch_size = _check_expected_batch_size(value, self.loss_reduction)

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Clear ``p.grad`` (zeros, or None with ``set_to_none``, as Opacus 1.x) and the
        per-sample gradients; clipped sums of virtual steps are kept (and shown as
        ``p.summed_grad`` in the 1.x lifecycle)."""
        self.grad_source.clear(self.params)
        self._show_summed(self._summed if self.state_views.keeps_after_step else {})
        self._inner_zero_grad(set_to_none)

    # -------------------------------------------------------------- the pieces of a step
    def clip_and_accumulate(self) -> None:
        """``S_l += Σ_i f_il · g_il`` for the backward pass(es) not yet consumed, through the
        :class:`~opacus_dp.per_sample_source.GradSource` protocol: norms ``n_il`` (divided by
        the GradScaler's scale ``s`` in a scaled step) → factors ``f_il`` (the clipper; 0 for a
        sample with a NaN/inf norm, whose rows are dropped: :mod:`~opacus_dp.optim.nonfinite`)
        → clipped sums with ``f_il / s``."""
        params, source, scale = self.params, self.grad_source, self._loss_scale
        refuse_sums_formed_in_backward(source, scale)
        with loss_scaled(scale is not None):
            norms = source.per_sample_norms(params, self._name)
        norms, dropping = screen_norms(norms, self.non_finite_samples,
                                       lambda index: self._name(params[index]))
        norms = unscaled(norms, scale)
        factors = self.clip_factors(params, norms)
        self.clipper.observe(norms)
        with known_drops(dropping):
            clipped_sums = source.clipped_sums(params, unscaled(factors, scale))
        for p, clipped in zip(params, clipped_sums):
            if clipped is not None:
                clipped = clipped.to(sum_dtype(p.dtype))
                self._summed[p] = self._summed[p] + clipped if p in self._summed else clipped
        self._num_accumulated += norms[0].shape[0] if norms else 0

    def _own_norm_factors(self, p: torch.Tensor, norms: torch.Tensor) -> Optional[torch.Tensor]:
        """Clip factors of ``p`` from its own per-sample norms where the clipper allows it
        (per-layer clipping), else None: lets a norms-only grad source finish a layer's
        clipped sum during the backward pass instead of keeping its inputs until the step."""
        if not isinstance(self.clipper, PerLayerClipper) or p not in self._bound_index:
            return None
        return self.clipper.factor(self._bound_index[p], norms)

    def clip_factors(self, params: List[torch.Tensor], norms: List[torch.Tensor]) -> List[torch.Tensor]:
        """The clipper's factors ``f_il`` from the norms ``n_il`` of ``params``. Per-layer bounds
        go by tensor, not by position among the tensors trainable now (a tensor frozen since the
        bounds were given keeps its bound unused, and the sensitivity still counts it)."""
        if not isinstance(self.clipper, PerLayerClipper):
            return self.clipper.clip_factors(norms)
        return [self.clipper.factor(self._bound_of(p), n) for p, n in zip(params, norms)]

    def _bound_of(self, p: torch.Tensor) -> int:
        index = self._bound_index.get(p)
        if index is None:
            raise ValueError(
                f"parameter {self._name(p)} has no per-layer clipping bound: it was not trainable "
                "when the bounds were given; set optimizer.max_grad_norms to one bound per "
                "trainable tensor (in the order of optimizer.param_groups); nothing was updated"
            )
        return index

    def _accumulate_or_discard(self, check_size: bool) -> None:
        """:meth:`clip_and_accumulate`; if it (or the batch size check) fails, the clipped sums
        of the unfinished logical batch are dropped, so they can never join the next one."""
        try:
            self.clip_and_accumulate()
            if check_size:
                self._check_max_batch_size()
        except Exception:
            self._drop_accumulated()
            raise
        self._show_summed(self._summed)

    def add_noise(self, sums: List[torch.Tensor]) -> List[torch.Tensor]:
        """``S_l + N(0, (σ · sensitivity)²)``, one draw per coordinate (new tensors)."""
        std = noise_std(self.noise_multiplier, self.clipper)
        if sums:
            self.noise.begin_step(sums[0].device)
        return [self.noise.sample(s, std).add_(s) for s in sums]

    def scale_grad(self, sums: List[torch.Tensor]) -> List[torch.Tensor]:
        """Apply the ``mean`` reduction: divide by ``expected_batch_size · world_size · k``
        (in place: the sums of a step are the optimizer's own tensors)."""
        if self.loss_reduction == "sum":
            return sums
        divisor = self._expected_global_batch_size()
        return [s.div_(divisor) for s in sums]

    def _expected_global_batch_size(self) -> float:
        """``expected_batch_size · world_size · k``; without an expected size, the samples
        of the step (public only for fixed-size batches, see the class doc)."""
        if self.expected_batch_size is None:
            return max(self._last_num_accumulated, 1)
        return self.expected_batch_size * self.reducer.world_size * self.accumulated_iterations

    def _drop_accumulated(self) -> None:
        """Forget the clipped sums (and unclipped count) of an unfinished logical batch."""
        self._summed, self._num_accumulated = {}, 0
        self.clipper.forget_observations()
        self._show_summed({})

    # ---------------------------------------------------------------------- helpers
    def _take_summed_grads(self) -> List[torch.Tensor]:
        sums = [self._summed[p] if p in self._summed else
                torch.zeros(p.shape, dtype=sum_dtype(p.dtype), device=p.device)
                for p in self.params]  # zeros only for parameters no sample reached (full shape)
        self._summed = {}
        self._last_num_accumulated, self._num_accumulated = self._num_accumulated, 0
        return sums

    def _set_grads(self, grads: List[torch.Tensor]) -> None:
        for p, g in zip(self.params, grads):
            p.grad = self.reducer.as_grad(p, g)
        for group in self.original_optimizer.param_groups:
            for p in group["params"]:
                if not p.requires_grad:
                    p.grad = None  # e.g. frozen after backward: its gradient is not private

    def _name(self, p) -> str:
        if p in self.param_names:
            return self.param_names[p]
        for gi, group in enumerate(self.param_groups):
            for pi, q in enumerate(group["params"]):
                if q is p:
                    return f"param_groups[{gi}]['params'][{pi}]"
        return f"<tensor of shape {tuple(p.shape)}>"

    def _run_hooks(self, hooks) -> None:
        for fn in list(hooks.values()):
            fn(self)

    def __repr__(self):
        return (f"DPOptimizer({self.original_optimizer!r}, noise_multiplier={self.noise_multiplier}, "
                f"clipper={self.clipper!r}, loss_reduction={self.loss_reduction!r}, "
                f"expected_batch_size={self.expected_batch_size})")
