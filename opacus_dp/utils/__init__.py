"""Utilities and Opacus-compatible import paths (``opacus_dp.utils.uniform_sampler``, ...)."""
