"""Per-sample gradient test helpers (:mod:`opacus_dp.testing.grad_samples.common`)."""
