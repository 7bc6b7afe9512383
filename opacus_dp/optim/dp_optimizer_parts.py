"""The parts of a :class:`~opacus_dp.optim.DPOptimizer` and the settings users change between steps.

The parts — gradient source (:mod:`opacus_dp.per_sample_source`), clipper
(:mod:`~opacus_dp.optim.clipper_registry`), reducer (:mod:`~opacus_dp.optim.reduction`), noise
mechanism (:mod:`opacus_dp.optim.noise_mechanism`), batching policy and logical batch
(:mod:`~opacus_dp.optim.logical_batches`), scaler bridge (:mod:`~opacus_dp.optim.amp_scaling`)
and the ``p.summed_grad`` views — are built or checked by the constructor and never set from
outside afterwards. The settings (σ, the clipping bounds, the expected batch size) are checked
when set, so a step never runs with a σ or bound that could not be noised. The step itself is
:meth:`opacus_dp.optim.dp_optimizer.DPOptimizer.pre_step`.
"""

from collections import OrderedDict
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Union

import torch
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from opacus_dp.optim.noise_mechanism import NoiseMechanism
from opacus_dp.maths.heap_threshold import settle_heap_for
from opacus_dp.model_wrappers import parameter_names
from opacus_dp.optim.amp_scaling import ScalerBridge
from opacus_dp.optim.clipper_registry import make_clipper
from opacus_dp.optim.clipping import Clipper
from opacus_dp.optim.logical_batches import BatchingPolicy, LogicalBatch
from opacus_dp.optim.noise import GaussianNoise, check_noise_multiplier, noise_std
from opacus_dp.optim.nonfinite import DROP
from opacus_dp.optim.reduction import LocalReducer, Reducer
from opacus_dp.optim.summed_grad_views import SummedGradViews
from opacus_dp.optim.wrapped_optimizer import WrappedOptimizer
from opacus_dp.per_sample_source import AttributeGradSource, GradSource, grad_source_for
from opacus_dp.state_views import OPACUS_1X, StateViews

NOISE_NOT_DRAWN_HERE = "noise_not_drawn_on_this_rank"  # noise_state_dict of a rank that draws none

# the settings every process checks at each step (DPOptimizerParts._step_settings)
STEP_SETTINGS = ("noise_multiplier", "max_grad_norm (sensitivity)", "sum of clipping bounds",
                 "batches merged into the step", "steps taken (a checkpoint loaded on every rank?)")


def _check_expected_batch_size(expected_batch_size, loss_reduction: str):
    if loss_reduction not in ("mean", "sum"):
        raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
    if expected_batch_size is None:
        return None
    if isinstance(expected_batch_size, bool) or not isinstance(expected_batch_size, (int, float)) \
            or not expected_batch_size > 0:
        raise ValueError(f"expected_batch_size must be > 0, got {expected_batch_size!r}")
    return expected_batch_size


def _agreeing(clipper: Clipper, max_grad_norm) -> Clipper:
    """``clipper``, if its bounds are ``max_grad_norm`` (a clipper passed as ``clipping`` comes with its own)."""
    given = list(max_grad_norm) if isinstance(max_grad_norm, (list, tuple)) else [max_grad_norm]
    if [float(c) for c in given] != [float(c) for c in clipper.bounds]:
        raise ValueError(f"max_grad_norm={max_grad_norm!r} disagrees with the bounds {clipper.bounds} of "
                         f"clipping={clipper!r}: pass the clipper's own bound(s) as max_grad_norm")
    return clipper


def _checked_part(value, protocol, name: str):
    if not isinstance(value, protocol):
        raise TypeError(f"{name} must implement the {protocol.__name__} protocol, got {type(value).__name__}")
    return value


class DPOptimizerParts(WrappedOptimizer):
    """The parts and settings of a differentially private wrapper of ``optimizer`` (SGD, Adam, ...).

    Args:
        optimizer: the wrapped optimizer; its ``param_groups``/``state`` are shared.
        noise_multiplier: σ ≥ 0, noise std relative to the clipping sensitivity.
        max_grad_norm: C > 0 (a number), or one bound per trainable tensor for
            ``clipping="per_layer"``. ``float("inf")`` disables clipping (only with σ = 0).
        expected_batch_size: divisor of the ``mean`` reduction (``q · N`` under Poisson
            sampling). ``None`` divides by the number of samples actually accumulated
            (Opacus 0.x behaviour; sound only for batches of fixed, public size): with the
            ``mean`` reduction only for an engine that declares ``batching`` (as Opacus 1.x,
            a ``DPOptimizer`` built by hand must be given it).
        loss_reduction: "mean" or "sum", as used by the loss.
        generator: ``torch.Generator`` for the noise; default: one seeded from the global RNG.
        secure_mode: OS-seeded noise robust to floating-point attacks (see :mod:`noise`).
        clipping: a rule of :mod:`~opacus_dp.optim.clipper_registry` ("flat", "per_layer",
            "automatic", "psac") or a :class:`~opacus_dp.optim.clipping.Clipper`.
        reducer: a :class:`~opacus_dp.optim.reduction.Reducer` (default: one process).
        grad_source: a :class:`~opacus_dp.per_sample_source.GradSource`, where per-sample
            norms and clipped sums come from (default: ``p.grad_sample``).
        param_names: ``{param: name}`` used in error messages.
        batching: the :class:`~opacus_dp.optim.logical_batches.BatchingPolicy` (default: k
            backward passes count as k batches, no size limit, no Poisson batches).
        noise: the noise mechanism (:mod:`opacus_dp.optim.noise_mechanism`; default independent
            Gaussian noise from ``generator`` / ``secure_mode``, which it then replaces).
        state_views: the lifecycle of ``p.summed_grad`` (:mod:`opacus_dp.state_views`).
    """

    non_finite_samples = DROP  # a sample with a NaN/inf norm: "drop" or "refuse" (nonfinite.py)
    # torch.amp.GradScaler passes itself to step(grad_scaler=...) (opacus_dp.optim.amp_scaling)
    _step_supports_amp_scaling = True

    def __init__(self, optimizer: Optimizer, *, noise_multiplier: float,
                 max_grad_norm: Union[float, Sequence[float]], expected_batch_size: Optional[float],
                 loss_reduction: str = "mean", generator: Optional[torch.Generator] = None,
                 secure_mode: bool = False, clipping=None, reducer: Optional[Reducer] = None,
                 grad_source: Optional[GradSource] = None, param_names: Optional[Dict[torch.Tensor, str]] = None,
                 batching: Optional[BatchingPolicy] = None, noise=None, state_views: StateViews = OPACUS_1X):
        super().__init__(optimizer)
        self._mean_needs_expected_size = batching is None  # built by hand, as Opacus 1.x's
        settle_heap_for(self.params)  # CPU: the step's large tensors reuse their pages (glibc)
        self.noise_multiplier = noise_multiplier  # checked by the setter
        if clipping is None:
            clipping = "per_layer" if isinstance(max_grad_norm, (list, tuple)) else "flat"
        self.clipper = self._checked_clipper(_agreeing(make_clipper(clipping, max_grad_norm), max_grad_norm))
        self._bound_index = {p: i for i, p in enumerate(self.params)}  # per-layer bound of each tensor
        self.loss_reduction = loss_reduction
        self.expected_batch_size = expected_batch_size  # checked by the setter
        if noise is not None and (generator is not None or secure_mode):
            raise ValueError("pass generator/secure_mode to the noise mechanism, not beside noise=")
        self.noise = _checked_part(noise if noise is not None else GaussianNoise(generator=generator,
                                                                                  secure_mode=secure_mode),
                                   NoiseMechanism, "noise")
        self.reducer = _checked_part(reducer if reducer is not None else LocalReducer(), Reducer, "reducer")
        self.param_names = dict(param_names or {})
        self._use_source(grad_source or AttributeGradSource(lambda: self.params))
        self.batching = batching if batching is not None else BatchingPolicy()
        self.logical_batch = LogicalBatch(self.batching)
        self.scaler = ScalerBridge()
        self.summed_grad_views = SummedGradViews(state_views, self, optimizer.param_groups)
        self._pre_step_hooks: "OrderedDict[int, Callable]" = OrderedDict()
        self._step_hooks: "OrderedDict[int, Callable]" = OrderedDict()
        self.steps_taken = 0  # private steps released (checkpoints compare it with the history)
        self._divided_by_noise = False  # the noise of the current step applied the mean's division
        self.summed_grad_views.show(self.params, {})

    @property
    def accumulated_iterations(self) -> int:
        """``k``, the batches merged into the current (or last) step."""
        return self.logical_batch.iterations

    count_iterations = property(lambda self: self.batching.count_iterations)
    max_batch_size = property(lambda self: self.batching.max_batch_size)
    poisson_batches = property(lambda self: self.batching.poisson_batches)

    @property
    def _distributed(self) -> bool:
        return self.reducer.world_size > 1

    def clip_factors(self, params: List[torch.Tensor], norms: List[torch.Tensor]) -> List[torch.Tensor]:
        """The clipper's factors ``f_il`` from the norms ``n_il`` of ``params``. Per-tensor bounds
        go by tensor, not by position among the tensors trainable now (a tensor frozen since the
        bounds were given keeps its bound unused, and the sensitivity still counts it)."""
        if not self.clipper.per_tensor:
            return self.clipper.clip_factors(norms)
        return [self.clipper.factor_of(self._bound_of(p), n) for p, n in zip(params, norms)]

    def _own_norm_factors(self, p: torch.Tensor, norms: torch.Tensor) -> Optional[torch.Tensor]:
        """Factors of ``p`` from its own norms where the clipper allows it (per-tensor bounds),
        else None: a norms-only source may then finish a layer's clipped sum during backward."""
        if not self.clipper.per_tensor or p not in self._bound_index:
            return None
        return self.clipper.factor_of(self._bound_index[p], norms)

    def _bound_of(self, p: torch.Tensor) -> int:
        index = self._bound_index.get(p)
        if index is None:
            raise ValueError(
                f"parameter {self._name(p)} has no per-layer clipping bound: it was not trainable "
                "when the bounds were given; set optimizer.max_grad_norms to one bound per "
                "trainable tensor (in the order of optimizer.param_groups); nothing was updated")
        return index

    # ---------------------------------------------------------------- other sources
    def connect_grad_source(self, module) -> None:
        """Take per-sample gradients (or norms) from ``module``, the per-sample-gradient wrapper
        of the model this optimizer trains (Opacus 1.6's fast-gradient-clipping API connects
        the two after building them); names its parameters in error messages."""
        self._use_source(grad_source_for(module))
        self.param_names.update(parameter_names(module))

    @contextmanager
    def reading_from(self, source: GradSource) -> Iterator[None]:
        """Within: per-sample information comes from ``source`` (e.g. a step over no samples)."""
        kept = self.grad_source
        self._use_source(source)
        try:
            yield
        finally:
            self._use_source(kept)

    def _use_source(self, source: GradSource) -> None:
        self.grad_source = _checked_part(source, GradSource, "grad_source")
        self.grad_source.set_factor_function(self._own_norm_factors if self.clipper.per_tensor else None)

    # ------------------------------------------------------------------ settings
    @property
    def params(self) -> List[torch.Tensor]:
        """Trainable tensors of the wrapped optimizer, in ``param_groups`` order."""
        return [p for g in self.original_optimizer.param_groups for p in g["params"] if p.requires_grad]

    @property
    def grad_samples(self) -> List[Optional[torch.Tensor]]:
        """``p.grad_sample`` of each parameter (None where there is none), as Opacus's property."""
        return [getattr(p, "grad_sample", None) for p in self.params]

    @property
    def noise_multiplier(self) -> float:
        """σ, read at every step (noise std σ · the clipper's sensitivity; the accountant records
        the σ of each step). Checked when set, as a scheduler may change it."""
        return self._noise_multiplier

    @noise_multiplier.setter
    def noise_multiplier(self, value) -> None:
        value = check_noise_multiplier(value)
        if hasattr(self, "clipper"):
            noise_std(value, self.clipper)
        self._noise_multiplier = value

    @property
    def max_grad_norm(self) -> float:
        """C for flat clipping; ‖(C_l)‖₂ for per-layer clipping (a scheduler may set it)."""
        return self.clipper.sensitivity

    @max_grad_norm.setter
    def max_grad_norm(self, value: float) -> None:
        self.clipper = self._checked_clipper(self.clipper.with_bound(value))

    @property
    def max_grad_norms(self) -> List[float]:
        """Per-layer bounds (per-layer clipping) or ``[C]``; setting them clips per layer."""
        return list(self.clipper.bounds)

    @max_grad_norms.setter
    def max_grad_norms(self, values: Sequence[float]) -> None:
        self.clipper = self._checked_clipper(self.clipper.with_bounds(values))
        self._bound_index = {p: i for i, p in enumerate(self.params)}
        self._use_source(self.grad_source)  # per-layer now: sums may be formed during backward

    def _checked_clipper(self, clipper: Clipper) -> Clipper:
        clipper.check_num_params(len(self.params))
        noise_std(self.noise_multiplier, clipper)  # an infinite bound cannot be noised
        return clipper

    @property
    def expected_batch_size(self) -> Optional[float]:
        """``E|B|`` (per process), the divisor of the ``mean`` reduction; checked when set."""
        return self._expected_batch_size

    @expected_batch_size.setter
    def expected_batch_size(self, value) -> None:
        if value is None and self.loss_reduction == "mean" and self._mean_needs_expected_size:
            raise ValueError(
                "expected_batch_size=None with loss_reduction='mean': pass expected_batch_size, the "
                "expected batch size that divides the sum of clipped gradients (q * len(dataset) for "
                "Poisson batches, e.g. a DPDataLoader's sample_rate * len(dataset); the batch size for "
                "fixed batches), or use loss_reduction='sum'")
        self._expected_batch_size = _check_expected_batch_size(value, self.loss_reduction)

    @property
    def secure_mode(self) -> bool:
        return self.noise.secure_mode

    @property
    def generator(self) -> Optional[torch.Generator]:
        return self.noise.generator

    @property
    def state_views(self) -> StateViews:
        return self.summed_grad_views.views

    def _step_settings(self) -> Dict[str, float]:
        """The settings every process must share at each step (a scheduler may change σ or the
        bounds between steps): checked in the step's own collective (a distributed reducer)."""
        values = (self.noise_multiplier, self.clipper.sensitivity, float(sum(self.max_grad_norms)),
                  float(self.accumulated_iterations), float(self.steps_taken))
        return dict(zip(STEP_SETTINGS, values))

    def settings_ranks_share(self) -> Dict[str, Optional[float]]:
        """Every setting all processes must share: the step's and those fixed for the run
        (checked once, collectively, when the distributed reduction is set up)."""
        return {**self._step_settings(),
                "expected_batch_size": self.expected_batch_size,
                "loss_reduction(mean=1)": float(self.loss_reduction == "mean"),
                "poisson_sampling(yes=1)": float(self.poisson_batches),
                **self.clipper.shared_settings()}

    # ------------------------------------------------------------------ hooks and state
    def attach_step_hook(self, fn: Callable[[object], None]) -> RemovableHandle:
        """Call ``fn(optimizer)`` after every (non-skipped) step; returns a removable handle."""
        handle = RemovableHandle(self._step_hooks)
        self._step_hooks[handle.id] = fn
        return handle

    def attach_pre_step_hook(self, fn: Callable[[object], None]) -> RemovableHandle:
        """Call ``fn(optimizer)`` before a (non-skipped) step changes anything; may raise."""
        handle = RemovableHandle(self._pre_step_hooks)
        self._pre_step_hooks[handle.id] = fn
        return handle

    def _run_hooks(self, hooks) -> None:
        for fn in list(hooks.values()):
            fn(self)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear ``p.grad`` (None, as ``torch.optim`` since PyTorch 2.0; zeros with
        ``set_to_none=False``, Opacus 1.x's default: a tensor of the parameters' size then stays
        allocated through the next forward and backward pass) and the per-sample gradients;
        clipped sums of virtual steps are kept (and shown as ``p.summed_grad`` in the 1.x
        lifecycle)."""
        self.grad_source.clear(self.params)
        self.summed_grad_views.show_kept(self.params, self.logical_batch.sums)
        self._inner_zero_grad(set_to_none)

    def clipping_state_dict(self) -> dict:
        """What the clipper learned (the current adaptive bound; empty for fixed bounds)."""
        return self.clipper.state_dict()

    def load_clipping_state_dict(self, state: dict) -> None:
        self.clipper.load_state_dict(state)

    def noise_state_dict(self) -> dict:
        """State of the noise generator, for reproducible resumption. A rank that draws no noise
        (under DDP every rank but 0) has a generator that never advanced: it gives a marker
        instead, which a rank that draws the noise refuses to resume from (:meth:`load_noise_state_dict`)."""
        if not self.reducer.draws_noise:
            return {NOISE_NOT_DRAWN_HERE: True}
        params = self.params
        if params and not self.noise.secure_mode:
            self.noise.generator_for(params[0].device)  # materialise it where the noise is drawn
        return self.noise.state_dict()

    def load_noise_state_dict(self, state: dict) -> None:
        """Restore :meth:`noise_state_dict`; a marker (saved by a rank that draws no noise) changes
        nothing, and is refused by a rank that draws the noise once steps were taken: resuming
        from a generator that never advanced would draw the released steps' noise again."""
        if not state.get(NOISE_NOT_DRAWN_HERE, False):
            self.noise.load_state_dict(state)
        elif self.reducer.draws_noise and self.steps_taken > 0:
            raise ValueError(
                f"the checkpoint's noise state was saved by a rank that draws no noise (under DDP only rank 0 "
                f"draws it), so it is the generator's state before any step; resuming this run, which has "
                f"released {self.steps_taken} steps, from it would add the noise of its first steps again "
                "(differences of updates would then be noise-free). Save the checkpoint on rank 0 "
                "(if dist.get_rank() == 0: save_checkpoint(...)) and load it on every rank")

    def _name(self, p) -> str:
        if p in self.param_names:
            return self.param_names[p]
        for gi, group in enumerate(self.param_groups):
            for pi, q in enumerate(group["params"]):
                if q is p:
                    return f"param_groups[{gi}]['params'][{pi}]"
        return f"<tensor of shape {tuple(p.shape)}>"

    def __repr__(self):
        return (f"DPOptimizer({self.original_optimizer!r}, noise_multiplier={self.noise_multiplier}, "
                f"clipper={self.clipper!r}, loss_reduction={self.loss_reduction!r}, "
                f"expected_batch_size={self.expected_batch_size})")
