"""Tensor maths shared by the optimizer (:mod:`opacus_dp.optim`) and the per-sample gradient
code (:mod:`opacus_dp.grad_sample`): per-sample norms, weighted sums, the dtype they are formed
in, and IEEE float32 products. A leaf: it imports nothing else of the package."""
