"""DPOptimizer: one private step around any ``torch.optim`` optimizer.

One logical step (``step()``), for the trainable tensors ``l`` of the wrapped optimizer, reads top
to bottom in :meth:`DPOptimizer.pre_step`:

1. gather the per-sample norms ``n_il = ‖g_il‖₂`` (the gradient source) and screen the
   non-finite ones (dropped: :mod:`~opacus_dp.optim.nonfinite`);
2. clip: factors ``f_il`` (the clipper) and ``S_l += Σ_i f_il · g_il``, accumulated over the pieces
   of the logical batch (:mod:`~opacus_dp.optim.logical_batches`);
3. agree across ranks, reduce and noise (the reducer, :mod:`~opacus_dp.optim.reduction`):
   ``S_l + N(0, (σ · sensitivity)²)``, the noise of the mechanism drawn once per logical step;
   a step one rank's checks refuse is refused on every rank in the same collective
   (:mod:`~opacus_dp.optim.step_refusal`);
4. scale: ``mean`` reduction ``p.grad = S / (expected_batch_size · world_size · k)``, ``sum``:
   ``S``; ``k = accumulated_iterations``, the batches merged by ``k`` backward passes before the
   step (Opacus 1.x; the accountant then records ``k·q``); the GradScaler bridge
   (:mod:`~opacus_dp.optim.amp_scaling`);
5. the step event: the step hooks (e.g. the privacy accountant), at the end of ``pre_step``; then
   the wrapped optimizer's own step (in :meth:`DPOptimizer.step`).

The parts — gradient source, clipper, reducer, noise mechanism, batching policy, scaler bridge — are
given to the constructor and never replaced from outside. Parameters of the wrapped optimizer
without ``requires_grad`` get ``p.grad = None`` before the inner step, so it never applies a
gradient that was not clipped and noised.

Half-precision parameters (float16, bfloat16): norms, clip factors, ``S_l`` and the noise are
formed in float32 (:func:`~opacus_dp.maths.per_sample.sum_dtype`) and ``p.grad`` is cast to the
parameter's dtype only after the noise — a cast after the noise is post-processing, while rounding
``S_l`` before it could move the sum by up to a unit in the last place of its own magnitude, beyond
what one clipped sample may change.

Abadi et al. 2016, "Deep Learning with Differential Privacy" (Algorithm 1). Dividing by the
*expected* batch size keeps the sensitivity of the average independent of the sampled
batch (Poisson sampling).
"""

from typing import Callable, List, Optional

import torch

from opacus_dp.maths.per_sample import known_drops, loss_scaled
from opacus_dp.optim.amp_scaling import refuse_attribute_contract, refuse_sums_formed_in_backward, unscaled
from opacus_dp.optim.dp_optimizer_parts import DPOptimizerParts
from opacus_dp.optim.noise import noise_std
from opacus_dp.optim.nonfinite import screen_norms
from opacus_dp.optim.philox_noise import PhiloxGaussianNoise
from opacus_dp.optim.reduction import StepRelease
from opacus_dp.optim.step_refusal import Refusal, StepRefusedError, earlier_piece_failed, refusal_of, with_note


def dp_optimizer_behind(optimizer) -> Optional["DPOptimizer"]:
    """The DPOptimizer ``optimizer`` is (``make_private``'s), or the one a classic engine's
    ``attach`` put behind it; None for any other optimizer."""
    if isinstance(optimizer, DPOptimizer):
        return optimizer
    return getattr(getattr(optimizer, "privacy_engine", None), "_dp_optimizer", None)


class DPOptimizer(DPOptimizerParts):
    """Differentially private wrapper of any ``torch.optim`` optimizer: the step of the module doc
    over the parts and settings of :class:`~opacus_dp.optim.dp_optimizer_parts.DPOptimizerParts`
    (the constructor's arguments are documented there)."""


    # ----------------------------------------------------------------- the private step
    def step(self, closure: Optional[Callable[[], float]] = None, grad_scaler=None):
        """One private step (or only clip + accumulate if a skip was signalled): :meth:`pre_step`,
        then the inner optimizer's update. ``grad_scaler``: the ``torch.amp.GradScaler`` whose
        ``scaler.step(optimizer)`` calls this (:mod:`~opacus_dp.optim.amp_scaling`)."""
        refuse_attribute_contract(self)
        scaled = self.scaler.begin(grad_scaler)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with self.scaler.scaling(scaled):
            stepped = self.pre_step()
        if not self.scaler.finish(scaled, self, self.params, stepped):
            return loss
        result = self._inner_step()
        return loss if loss is not None else result

    def pre_step(self, closure: Optional[Callable[[], float]] = None) -> bool:
        """Everything of :meth:`step` but the inner optimizer's update (Opacus 1.x's name), in the
        order of the module doc. Returns whether the inner optimizer should now step."""
        if closure is not None:
            with torch.enable_grad():
                closure()
        if self.logical_batch.skip_next():  # a piece of the logical batch: clip and accumulate only
            self._accumulate_piece()
            return False
        refusal = self._checked_and_accumulated()  # gather, screen, clip, accumulate; local checks
        count = self.clipper.take_observation()  # adaptive clipping: its unclipped count
        sums = self.logical_batch.take(self.params)
        self.summed_grad_views.show_step_sums(self.params, sums, self.reducer)
        released = self._release(sums, count, refusal)  # agree across ranks, reduce, noise
        self._set_grads(self.scale_grad(released[:len(sums)]))
        if count is not None:  # the bound of the next step, from released values only
            self.clipper.update(float(released[-1]), self._expected_global_batch_size())
        self.steps_taken += 1
        self._run_hooks(self._step_hooks)  # the step event: accountant, budget guard's record
        return True

    def clip_and_accumulate(self) -> None:
        """``S_l += Σ_i f_il · g_il`` for the backward pass(es) not yet consumed: norms ``n_il``
        (divided by the GradScaler's scale ``s`` in a scaled step), screened (a NaN/inf norm is
        dropped with factor 0), factors ``f_il`` (the clipper), clipped sums with ``f_il / s``."""
        params, source, scale = self.params, self.grad_source, self.scaler.scale
        refuse_sums_formed_in_backward(source, scale)
        with loss_scaled(scale is not None):
            norms = source.per_sample_norms(params, self._name)
        norms, dropping = screen_norms(norms, self.non_finite_samples, lambda index: self._name(params[index]))
        norms = unscaled(norms, scale)
        factors = self.clip_factors(params, norms)
        self.clipper.observe(norms)
        with known_drops(dropping):
            clipped_sums = source.clipped_sums(params, unscaled(factors, scale))
        self.logical_batch.add(params, clipped_sums, norms[0].shape[0] if norms else 0)

    def _release(self, sums: List[torch.Tensor], count, refusal: Optional[Refusal]) -> List[torch.Tensor]:
        """The reducer's release of the step (:mod:`~opacus_dp.optim.reduction`); a refusal of
        any rank is raised on every rank, with nothing of the step kept."""
        if count is not None and self.reducer.shards:
            raise RuntimeError("adaptive clipping is not available with a sharding reducer (FSDP2)")
        release = StepRelease(sums, self.params, count, self.add_noise, self._add_count_noise,
                              agreed=self._step_settings() if self._distributed else None,
                              refusal=None if refusal is None else refusal.reason)
        saved = self._noise_snapshot() if refusal is None and self._distributed else None
        try:
            released = self.reducer.reduce(release)
        except StepRefusedError as refused:
            if saved is not None:
                self.noise.restore(saved)
            self.discard_unfinished_batch()
            if refusal is None:
                raise
            raise with_note(refusal.error, refused.refusals) from None
        if refusal is not None:  # nothing was reduced (no tensors): refuse here alone
            raise refusal.error
        return released

    def _noise_snapshot(self):
        """The noise state to restore if the step is refused elsewhere (this rank drew its noise
        before the collective), else None."""
        if not self.reducer.draws_noise or self.reducer.shards:
            return None
        return self.noise.snapshot()

    # -------------------------------------------------------------- the pieces of a step
    def _checked_and_accumulated(self) -> Optional[Refusal]:
        """The checks of the step, then clip and accumulate. One process: raise; several: return
        the refusal (the logical batch is dropped), which the reducer shares with every rank."""
        failed = self.logical_batch.take_failed_piece()
        try:
            self._check_step_allowed()
            self._accumulate_or_discard(check_size=True)
        except Exception as error:
            if not self._distributed:
                raise
            return refusal_of(error)
        if failed is None:
            return None
        self._drop_accumulated()
        return earlier_piece_failed(failed)

    def _check_step_allowed(self) -> None:
        """The checks of a logical step before anything of it is released (merged Poisson
        batches, the pre-step hooks such as the budget guard). A refused step drops its whole
        logical batch: pieces accumulated before it must never join the next batch's step."""
        try:
            self.logical_batch.count_iterations(self.grad_source.pending_passes)
            self._run_hooks(self._pre_step_hooks)  # e.g. budget guard: may refuse the step
        except Exception:
            self.discard_unfinished_batch()
            raise

    def _accumulate_piece(self) -> None:
        """Clip and accumulate a piece before the step (virtual step); with several processes a
        failure marks the logical batch, whose step is then refused on every rank."""
        try:
            self._accumulate_or_discard(check_size=False)
        except Exception as error:
            if self._distributed:
                self.logical_batch.mark_failed(error)
            raise

    def _accumulate_or_discard(self, check_size: bool) -> None:
        """:meth:`clip_and_accumulate`; if it (or the batch size check) fails, the clipped sums
        of the unfinished logical batch are dropped, so they can never join the next one."""
        try:
            self.clip_and_accumulate()
            if check_size:
                self.logical_batch.check_size()
        except Exception:
            self._drop_accumulated()
            raise
        self.summed_grad_views.show(self.params, self.logical_batch.sums)

    def add_noise(self, sums: List[torch.Tensor]) -> List[torch.Tensor]:
        """``S_l + N(0, (σ · sensitivity)²)``, one draw per coordinate: into ``S_l`` itself where no
        ``p.summed_grad`` shows it, else into a new tensor (the same numbers either way). Where
        nothing follows the noise but the mean's division, the Philox noise divides in its own
        pass (bitwise the same as :meth:`scale_grad` after it, which then leaves the tensors)."""
        std = noise_std(self.noise_multiplier, self.clipper)
        if sums:
            self.noise.begin_step(sums[0].device)
        divisor = self._divisor_for_noise()
        self._divided_by_noise = divisor is not None
        if divisor is None:
            return [self.noise.noised(s, std, reuse=not self.summed_grad_views.exposes(s)) for s in sums]
        return [self.noise.noised_divided(s, std, not self.summed_grad_views.exposes(s), divisor) for s in sums]

    def _divisor_for_noise(self) -> Optional[float]:
        """The mean's divisor when the noise may apply it: Philox noise, the ``mean`` reduction,
        nothing added to the noised tensors after the noise (one process, or each rank noising its
        own reduced shards) and this class's own :meth:`add_noise` and :meth:`scale_grad`."""
        if not isinstance(self.noise, PhiloxGaussianNoise) or self.loss_reduction != "mean":
            return None
        if type(self).add_noise is not DPOptimizer.add_noise or type(self).scale_grad is not DPOptimizer.scale_grad:
            return None  # a subclass's own noise or division: two passes, as it wrote them
        reducer = self.reducer
        noise_is_last = reducer.draws_noise and (reducer.world_size == 1 or reducer.shards)
        return self._expected_global_batch_size() if noise_is_last else None

    def _add_count_noise(self, count: torch.Tensor) -> torch.Tensor:
        """``U = count + N(0, σ_u²)`` (after the gradient noise, from the same source)."""
        if not self.params:
            self.noise.begin_step(count.device)
        return count + self.noise.sample(count, self.clipper.unclipped_num_std)

    def scale_grad(self, sums: List[torch.Tensor]) -> List[torch.Tensor]:
        """Apply the ``mean`` reduction: divide by ``expected_batch_size · world_size · k``
        (in place: the sums of a step are the optimizer's own tensors), unless the noise of this
        step already did (:meth:`add_noise`)."""
        divided, self._divided_by_noise = self._divided_by_noise, False
        if self.loss_reduction == "sum" or divided:
            return sums
        divisor = self._expected_global_batch_size()
        return [s.div_(divisor) for s in sums]

    def _expected_global_batch_size(self) -> float:
        """``expected_batch_size · world_size · k``; without an expected size, the samples
        of the step (public only for fixed-size batches, see the class doc)."""
        if self.expected_batch_size is None:
            return max(self.logical_batch.last_num_samples, 1)
        return self.expected_batch_size * self.reducer.world_size * self.accumulated_iterations

    def _set_grads(self, grads: List[torch.Tensor]) -> None:
        for p, g in zip(self.params, grads):
            p.grad = self.reducer.as_grad(p, g)
        for group in self.original_optimizer.param_groups:
            for p in group["params"]:
                if not p.requires_grad:
                    p.grad = None  # e.g. frozen after backward: its gradient is not private

    def _drop_accumulated(self) -> None:
        """Forget the clipped sums (and unclipped count) of an unfinished logical batch."""
        self.logical_batch.drop()
        self.clipper.forget_observations()
        self.summed_grad_views.show(self.params, {})

    # -------------------------------------------------------- logical batches (pieces, skips)
    def virtual_step(self) -> None:
        """Clip and accumulate the current per-sample gradients; no parameter update. Everything
        accumulated until the next ``step()`` is ONE logical batch for the accountant: use it to
        cut a logical batch into pieces, never to merge sampled batches (that under-reports ε).
        Refused with the Poisson batches of ``make_private``: ``BatchMemoryManager`` splits those."""
        self.logical_batch.refuse_merging_poisson_batches("optimizer.virtual_step()")
        self._accumulate_piece()

    def signal_skip_step(self, do_skip: bool = True) -> None:
        """Queue whether the next ``step()`` only accumulates (``True``) or steps (``False``);
        ``True`` is refused with Poisson batches (as :meth:`virtual_step`)."""
        if do_skip:
            self.logical_batch.refuse_merging_poisson_batches("optimizer.signal_skip_step(True)")
        self.logical_batch.signal(do_skip)

    def signal_chunk_step(self, do_skip: bool) -> None:
        """:meth:`signal_skip_step` for the pieces of one sampled batch (``BatchMemoryManager``)."""
        self.logical_batch.signal(do_skip)

    def take_unconsumed_skip_signals(self) -> List[bool]:
        """The signals of :meth:`signal_skip_step` that no ``step()`` consumed (now dropped)."""
        return self.logical_batch.take_signals()

    def discard_unfinished_batch(self) -> int:
        """Drop what a logical batch that never reached its step left behind (clipped sums of its
        earlier pieces, unclipped per-sample state, queued skip signals); nothing of it was
        released. Returns the number of samples whose clipped gradients were dropped."""
        dropped = self.logical_batch.num_samples
        self._drop_accumulated()
        self.logical_batch.take_signals()
        self.grad_source.clear(self.params)
        return dropped

