"""Refusing a private step on every process at once (distributed DP-SGD).

Some checks of a step run on one rank alone: the budget guard, merged Poisson batches, a step
over ``max_batch_size``, a failed earlier piece of the logical batch, non-finite per-sample
gradients with the ``non_finite_samples = "refuse"`` debugging switch (by default such a sample
is dropped, :mod:`~opacus_dp.optim.nonfinite`). If that rank raised before the step's collective
while the others entered it, its next collective would pair with the others' current one and the
ranks would train one step apart from then on (with different ε at the same step index).

With more than one process the optimizer therefore hands its refusal to the reducer, which
decides it in the step's own collective (no extra one): the refusing rank joins it with zero
sums and the reason code in its row of the settings table
(:class:`~opacus_dp.distributed.reducers.AllReduceReducer`); every rank sees the code and
raises — the refusing rank its own error, the others :class:`StepRefusedError` naming it and
its reason. No rank sets ``p.grad``, steps, records the step or keeps the logical batch, and
the next step pairs as before. One process raises exactly as it always did.

A reason is a type: each refusal error declares ``refusal_reason`` (a
:class:`~opacus_dp.errors.RefusalReason`); any other error of a local check is ``OTHER``.
"""

from typing import Dict, NamedTuple

from opacus_dp.errors import PrivacyBudgetExceededError, RefusalReason

NON_FINITE, BUDGET, POISSON_MERGE, TOO_MANY_SAMPLES, EARLIER_PIECE, OTHER, OUT_OF_STEP = (
    RefusalReason.NON_FINITE, RefusalReason.BUDGET, RefusalReason.POISSON_MERGE, RefusalReason.TOO_MANY_SAMPLES,
    RefusalReason.EARLIER_PIECE, RefusalReason.OTHER, RefusalReason.OUT_OF_STEP)
REASONS = {
    NON_FINITE: "non-finite (NaN or inf) per-sample gradients or norms",
    BUDGET: "the privacy budget (max_epsilon) would be exceeded",
    POISSON_MERGE: "several Poisson batches merged into one step",
    TOO_MANY_SAMPLES: "more samples than one logical batch (max_batch_size)",
    EARLIER_PIECE: "an earlier piece (virtual step) of this logical batch failed",
    OTHER: "a local check failed (see that rank's error)",
    OUT_OF_STEP: "this rank skipped a batch or is in another phase of the step (ranks out of step)",
}


class Refusal(NamedTuple):
    """This rank's refusal of a step: its error and the reason sent to the other ranks."""

    error: Exception
    reason: RefusalReason


class StepRefusedError(RuntimeError):
    """Raised on every rank whose own checks passed when another rank refused the step
    (module doc); ``refusals`` maps each refusing rank to its reason code (:data:`REASONS`)."""

    def __init__(self, message: str, refusals: Dict[int, int]):
        super().__init__(message)
        self.refusals = dict(refusals)


class StepRefusedForBudgetError(StepRefusedError, PrivacyBudgetExceededError):
    """:class:`StepRefusedError` of a step refused by another rank's budget guard (also a
    :class:`~opacus_dp.errors.PrivacyBudgetExceededError`, so every rank stops alike)."""


def reason_code(error: Exception) -> RefusalReason:
    """The reason the type of ``error`` declares (``OTHER`` for an error that declares none)."""
    return getattr(type(error), "refusal_reason", OTHER)


def refusal_of(error: Exception) -> Refusal:
    """``error`` with its declared reason."""
    return Refusal(error, reason_code(error))


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


def earlier_piece_failed(error: Exception) -> Refusal:
    """The refusal, at the step, of a logical batch whose earlier piece failed on this rank."""
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    return Refusal(RuntimeError(
        f"this logical batch was refused on every rank: an earlier piece of it failed on this rank "
        f"({type(error).__name__}: {first}); every rank dropped the batch and nothing was updated"),
        EARLIER_PIECE)
