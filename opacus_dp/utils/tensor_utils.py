"""Opacus 1.x's import path ``opacus.utils.tensor_utils`` (re-exports only), for custom grad
samplers written against Opacus (:mod:`opacus_dp.compat.tensor_utils`)."""

from opacus_dp.compat.tensor_utils import (
    calc_sample_norms,
    calc_sample_norms_one_layer,
    filter_dilated_rows,
    sum_over_all_but_batch_and_last_n,
    unfold2d,
    unfold3d,
)

__all__ = ["calc_sample_norms", "calc_sample_norms_one_layer", "filter_dilated_rows",
           "sum_over_all_but_batch_and_last_n", "unfold2d", "unfold3d"]
