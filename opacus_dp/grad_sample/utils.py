"""Opacus 1.x's import path ``opacus.grad_sample.utils`` (re-exports only): the sampler
registration decorators, and the wrapper of each ``grad_sample_mode``
(:mod:`opacus_dp.grad_sample.mode_wrappers`)."""

from opacus_dp.grad_sample.mode_wrappers import get_gsm_class, wrap_model
from opacus_dp.grad_sample.registry import register_grad_sampler, register_norm_sampler

__all__ = ["register_grad_sampler", "register_norm_sampler", "get_gsm_class", "wrap_model"]
