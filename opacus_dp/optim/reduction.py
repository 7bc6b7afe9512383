"""Reduction of the summed clipped gradients across replicas (seam for distributed training).

A reducer is asked, once per optimizer step, to combine the per-replica sums of clipped
per-sample gradients. It exposes

* ``world_size``: number of replicas contributing samples (the mean divides by
  ``expected_batch_size · world_size``);
* ``adds_noise``: whether *this* replica adds the Gaussian noise before reducing (for an
  all-reduce, exactly one replica — or each with std/√world_size — must do so; the
  distributed reducers decide);
* ``noises_shards``: whether each replica instead noises its own shard *after* the reduction
  (FSDP2: ``reduce(tensors, agreed, refusal, params)`` returns this rank's shards);
* ``reduces_in_place``: whether ``reduce`` overwrites the tensors it is given;
* ``needs_equal_passes``: whether every replica must run the same number of forward/backward
  passes per step (FSDP2; ``BatchMemoryManager`` then cuts every rank's batch alike);
* ``reduce(tensors) -> tensors``: the combined sums, in the same order;
* ``as_grad(param, tensor)``: the reduced tensor laid out as ``param``'s gradient.
"""

from typing import List

import torch


class LocalReducer:
    """Single process, single replica: nothing to combine."""

    world_size = 1
    adds_noise = True
    noises_shards = False
    reduces_in_place = False
    needs_equal_passes = False

    def reduce(self, tensors: List[torch.Tensor], agreed=None) -> List[torch.Tensor]:
        """Identity (``agreed``: the step's settings other processes would have to share)."""
        return tensors

    def close(self) -> None:
        """Remove what the reducer attached to the model (nothing here)."""

    @staticmethod
    def as_grad(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """``value`` in ``param``'s shape and dtype."""
        return value.view_as(param).to(param.dtype)

    def __repr__(self):
        return "LocalReducer()"
