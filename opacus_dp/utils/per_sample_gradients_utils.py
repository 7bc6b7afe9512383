"""Opacus 1.x's import path ``opacus.utils.per_sample_gradients_utils`` (re-exports only; the
micro-batch oracle lives in :mod:`opacus_dp.testing.per_sample_gradients`)."""

from opacus_dp.testing.per_sample_gradients import (
    ModelWithLoss,
    check_per_sample_gradients_are_correct,
    clone_module,
    compute_microbatch_grad_sample,
    compute_opacus_grad_sample,
    get_grad_sample_modes,
    is_batch_empty,
)

__all__ = ["ModelWithLoss", "check_per_sample_gradients_are_correct", "clone_module", "compute_microbatch_grad_sample",
           "compute_opacus_grad_sample", "get_grad_sample_modes", "is_batch_empty"]
