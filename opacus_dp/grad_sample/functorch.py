"""Opacus 1.6's import path ``opacus.grad_sample.functorch`` (re-exports only): its ``torch.func``
functions (:mod:`opacus_dp.grad_sample.functorch_compat`) and opacus_dp's fallback for layers
without a grad sampler (:mod:`opacus_dp.grad_sample.functorch_fallback`)."""

from opacus_dp.grad_sample.functorch_compat import ft_compute_per_sample_gradient, make_functional, prepare_layer
from opacus_dp.grad_sample.functorch_fallback import functorch_grad_sample

__all__ = ["ft_compute_per_sample_gradient", "functorch_grad_sample", "make_functional", "prepare_layer"]
