"""Exceptions raised by opacus_dp."""

import enum


class PrivacyBudgetExceededError(RuntimeError):
    """Raised *before* a step whose privacy cost would push ε above the configured budget.

    No parameter, accountant record or sampler state is changed by the refused step; the
    refused logical batch (with any pieces accumulated before it) is dropped, never merged
    into the next step.
    """


class UnsupportedError(ValueError):
    """A component cannot be used privately (Opacus 1.x's base class of the validation errors)."""


class UnsupportedModuleError(UnsupportedError):
    """A module cannot be trained privately as it is (see ``ModuleValidator.fix``)."""


class RefusalReason(enum.IntEnum):
    """Why one process refused a private step: the code its row of the step's all-reduce carries
    to the other processes (:mod:`opacus_dp.optim.step_refusal`). A refusal error declares its
    reason as the class attribute ``refusal_reason``; nothing is read from a message."""

    NON_FINITE = 1
    BUDGET = 2
    POISSON_MERGE = 3
    TOO_MANY_SAMPLES = 4
    EARLIER_PIECE = 5
    OTHER = 6
    OUT_OF_STEP = 7


PrivacyBudgetExceededError.refusal_reason = RefusalReason.BUDGET


class NonFiniteNormError(ValueError):
    """A per-sample gradient norm is NaN or inf and ``non_finite_samples="refuse"`` (no update)."""

    refusal_reason = RefusalReason.NON_FINITE


class PoissonBatchMergeError(ValueError):
    """Two Poisson batches (or pieces that cannot be told from two) would form one step."""

    refusal_reason = RefusalReason.POISSON_MERGE


class LogicalBatchOverflowError(ValueError):
    """A step combines more samples than one logical batch of fixed size holds."""

    refusal_reason = RefusalReason.TOO_MANY_SAMPLES
