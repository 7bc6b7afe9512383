"""Reduction of the summed clipped gradients across replicas (seam for distributed training).

A reducer is asked, once per optimizer step, to combine the per-replica sums of clipped
per-sample gradients. It exposes

* ``world_size``: number of replicas contributing samples (the mean divides by
  ``expected_batch_size · world_size``);
* ``adds_noise``: whether *this* replica adds the Gaussian noise before reducing (for an
  all-reduce, exactly one replica — or each with std/√world_size — must do so; the
  distributed reducers decide);
* ``reduce(tensors) -> tensors``: the combined sums, in the same order.
"""

from typing import List

import torch


class LocalReducer:
    """Single process, single replica: nothing to combine."""

    world_size = 1
    adds_noise = True

    def reduce(self, tensors: List[torch.Tensor], agreed=None) -> List[torch.Tensor]:
        """Identity (``agreed``: the step's settings other processes would have to share)."""
        return tensors

    def __repr__(self):
        return "LocalReducer()"
