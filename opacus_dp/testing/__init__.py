"""Test helpers for code that extends opacus_dp (e.g. a custom grad sampler), at the paths
Opacus's test helpers have under ``opacus.tests`` when :func:`opacus_dp.install_as_opacus` is
active: :mod:`opacus_dp.testing.grad_samples.common` (``GradSampleHooks_test``)."""
