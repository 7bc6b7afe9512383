"""Refusing a private step on every process at once (distributed DP-SGD).

Some checks of a step run on one rank alone: the budget guard, merged Poisson batches, a step
over ``max_batch_size``, a failed earlier piece of the logical batch, non-finite per-sample
gradients with the ``non_finite_samples = "refuse"`` debugging switch (by default such a sample
is dropped, :mod:`~opacus_dp.optim.nonfinite`). If that rank raised before the step's all-reduce while the others entered it,
its next all-reduce would pair with the others' current one and the ranks would train one step
apart from then on (with different ε at the same step index).

With more than one process, :class:`CollectiveRefusalMixin` therefore decides these refusals in
the step's own all-reduce (no extra collective): the refusing rank joins it with zero sums and
a refusal code in its row of the settings table
(:class:`~opacus_dp.distributed.reducers.AllReduceReducer`); every rank sees the code and
raises — the refusing rank its own error, the others :class:`StepRefusedError` naming it and
its reason. No rank sets ``p.grad``, steps, records the step or keeps the logical batch, and
the next step pairs as before. One process raises exactly as it always did.
"""

from typing import Dict, List, Optional, Tuple

import torch

from opacus_dp.errors import PrivacyBudgetExceededError

NON_FINITE, BUDGET, POISSON_MERGE, TOO_MANY_SAMPLES, EARLIER_PIECE, OTHER, OUT_OF_STEP = 1, 2, 3, 4, 5, 6, 7
REASONS = {
    NON_FINITE: "non-finite (NaN or inf) per-sample gradients or norms",
    BUDGET: "the privacy budget (max_epsilon) would be exceeded",
    POISSON_MERGE: "several Poisson batches merged into one step",
    TOO_MANY_SAMPLES: "more samples than one logical batch (max_batch_size)",
    EARLIER_PIECE: "an earlier piece (virtual step) of this logical batch failed",
    OTHER: "a local check failed (see that rank's error)",
    OUT_OF_STEP: "this rank skipped a batch or is in another phase of the step (ranks out of step)",
}
# words of the messages of dp_optimizer.py and clipping.py that tell the reason
_MARKS = ((NON_FINITE, "non-finite"), (POISSON_MERGE, "with Poisson sampling"),
          (TOO_MANY_SAMPLES, "more than one logical batch"))

Refusal = Tuple[Exception, int]  # this rank's error and its reason code


class StepRefusedError(RuntimeError):
    """Raised on every rank whose own checks passed when another rank refused the step
    (module doc); ``refusals`` maps each refusing rank to its reason code (:data:`REASONS`)."""

    def __init__(self, message: str, refusals: Dict[int, int]):
        super().__init__(message)
        self.refusals = dict(refusals)


class StepRefusedForBudgetError(StepRefusedError, PrivacyBudgetExceededError):
    """:class:`StepRefusedError` of a step refused by another rank's budget guard (also a
    :class:`~opacus_dp.errors.PrivacyBudgetExceededError`, so every rank stops alike)."""


def reason_code(error: Exception) -> int:
    """The reason code of a local check's ``error``."""
    if isinstance(error, PrivacyBudgetExceededError):
        return BUDGET
    text = str(error)
    return next((code for code, mark in _MARKS if mark in text), OTHER)


def _describe(refusals: Dict[int, int]) -> str:
    return "; ".join(f"rank {rank}: {REASONS.get(code, REASONS[OTHER])}" for rank, code in sorted(refusals.items()))


def refused_elsewhere(refusals: Dict[int, int]) -> StepRefusedError:
    """The error of a rank whose own checks passed (``refusals``: rank → reason code)."""
    ranks = ", ".join(str(r) for r in sorted(refusals))
    cls = StepRefusedForBudgetError if BUDGET in refusals.values() else StepRefusedError
    return cls(
        f"rank{'s' if len(refusals) > 1 else ''} {ranks} refused this step ({_describe(refusals)}): "
        "the step was refused on every rank — no parameter update, noise or accountant record, "
        "and every rank dropped this logical batch. The ranks are still in step: training may go "
        "on with the next batch on every rank (the refusing rank's error tells the details)",
        refusals)


def with_note(error: Exception, refusals: Dict[int, int]) -> Exception:
    """``error`` (a refusing rank's own) with a note that every rank refused the step."""
    if hasattr(error, "add_note"):
        error.add_note(f"distributed step refused on every rank ({_describe(refusals)}); "
                       "nothing was updated anywhere and the ranks are still in step")
    return error


def earlier_piece_failed(error: Exception) -> RuntimeError:
    """The refusing rank's error at the step of a logical batch whose earlier piece failed."""
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    return RuntimeError(
        f"this logical batch was refused on every rank: an earlier piece of it failed on this rank "
        f"({type(error).__name__}: {first}); every rank dropped the batch and nothing was updated")


def noise_state(noise) -> Tuple[Optional[torch.Generator], Optional[torch.Tensor]]:
    """The noise generator and its state, restored if the step is refused elsewhere."""
    generator = noise.generator
    return generator, None if generator is None else generator.get_state()


def restore_noise(noise, saved) -> None:
    generator, state = saved
    noise.discard_step()
    noise.generator = generator
    if state is not None:
        generator.set_state(state)


class CollectiveRefusalMixin:
    """The local checks of a step and their collective decision (module doc), for ``DPOptimizer``."""

    _failed_piece: Optional[Exception] = None

    @property
    def _distributed(self) -> bool:
        return self.reducer.world_size > 1

    def _accumulate_piece(self) -> None:
        """Clip and accumulate a piece before the step (virtual step); with several processes a
        failure marks the logical batch, whose step is then refused on every rank."""
        try:
            self._accumulate_or_discard(check_size=False)
        except Exception as error:
            if self._distributed and self._failed_piece is None:
                self._failed_piece = error
            raise

    def _local_refusal(self) -> Optional[Refusal]:
        """The checks of the step, then clip and accumulate. One process: raise; several:
        return the error and its code (the logical batch is dropped) for the all-reduce."""
        failed, self._failed_piece = self._failed_piece, None
        try:
            self._check_step_allowed()
            self._accumulate_or_discard(check_size=True)
        except Exception as error:
            if not self._distributed:
                raise
            return error, reason_code(error)
        if failed is None:
            return None
        self._drop_accumulated()
        return earlier_piece_failed(failed), EARLIER_PIECE

    def _release(self, sums: List[torch.Tensor], count, refusal: Optional[Refusal]) -> List[torch.Tensor]:
        """Noise (where the reducer adds it) and reduce; with several processes also decide
        the refusals: raise on every rank if one refused."""
        if self.reducer.noises_shards:
            return self._release_shards(sums, count, refusal)
        if not self._distributed:
            return self.reducer.reduce(self._noised_bucket(sums, count), agreed=None)
        saved = noise_state(self.noise) if refusal is None and self.reducer.adds_noise else None
        bucket = self._noised_bucket(sums, count) if refusal is None else \
            sums + self._as_bucket_entry(count, sums)
        try:
            reduced = self.reducer.reduce(bucket, agreed=self._step_settings(),
                                          refusal=None if refusal is None else refusal[1])
        except StepRefusedError as refused:
            if saved is not None:
                restore_noise(self.noise, saved)
            self.discard_unfinished_batch()
            if refusal is None:
                raise
            raise with_note(refusal[0], refused.refusals) from None
        if refusal is not None:  # nothing was reduced (no tensors): refuse here alone
            raise refusal[0]
        return reduced

    def _release_shards(self, sums: List[torch.Tensor], count, refusal: Optional[Refusal]) -> List[torch.Tensor]:
        """Reduce-scatter (the refusals decided first, on every rank), then noise this rank's
        shards (:mod:`~opacus_dp.distributed.reduce_scatter`)."""
        if count is not None:
            raise RuntimeError("adaptive clipping is not available with a sharding reducer (FSDP2)")
        agreed = self._step_settings() if self._distributed else None
        try:
            shards = self.reducer.reduce(sums, agreed=agreed, refusal=None if refusal is None else refusal[1],
                                         params=self.params)
        except StepRefusedError as refused:
            self.discard_unfinished_batch()
            if refusal is None:
                raise
            raise with_note(refusal[0], refused.refusals) from None
        if refusal is not None:
            raise refusal[0]
        return self.add_noise(shards)

    def _noised_bucket(self, sums: List[torch.Tensor], count) -> List[torch.Tensor]:
        """What this rank sends: the sums (and count), noised where the reducer adds noise."""
        if self.reducer.adds_noise:
            sums = self.add_noise(sums)
            count = self._add_count_noise(count)
        return sums + self._as_bucket_entry(count, sums)

    # -------------------------------------------- adaptive clipping: the unclipped count
    def _add_count_noise(self, count: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """``U = count + N(0, σ_u²)`` (after the gradient noise, from the same source)."""
        if count is None:
            return None
        if not self.params:
            self.noise.begin_step(count.device)
        return count + self.noise.sample(count, self.clipper.unclipped_num_std)

    @staticmethod
    def _as_bucket_entry(count: Optional[torch.Tensor], sums: List[torch.Tensor]) -> List[torch.Tensor]:
        """The count as a one-element tensor beside the sums (same dtype and device as the
        first, so a distributed reducer sends it in the same all-reduce)."""
        if count is None:
            return []
        like = sums[0] if sums else count
        return [count.reshape(1).to(device=like.device, dtype=like.dtype)]
