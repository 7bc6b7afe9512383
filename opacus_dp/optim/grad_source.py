"""Where the optimizer takes per-sample gradients from.

A *source* has ``pop(params) -> {param: Tensor(B, *param.shape)}`` (taking ownership: the
source forgets what it returned) and ``clear(params)`` (drop everything not yet popped).

* :class:`AttributeGradSource` reads the documented compatibility view ``p.grad_sample``
  (a tensor, or a list of tensors concatenated along the batch dimension).
* :class:`ModuleGradSource` asks a ``GradSampleModule`` via ``pop_grad_samples()`` /
  ``zero_grad_sample()``.
"""

from typing import Dict, List

import torch


def _as_batch_tensor(value, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return torch.cat(list(value), dim=0)
    raise TypeError(f"per-sample gradient of {name} has unexpected type {type(value).__name__}")


class AttributeGradSource:
    """Per-sample gradients stored by hooks in ``p.grad_sample``."""

    def pop(self, params: List[torch.Tensor]) -> Dict[torch.Tensor, torch.Tensor]:
        found = {}
        for i, p in enumerate(params):
            value = getattr(p, "grad_sample", None)
            if value is not None:
                found[p] = _as_batch_tensor(value, f"parameter #{i}")
                p.grad_sample = None
        return found

    def clear(self, params: List[torch.Tensor]) -> None:
        for p in params:
            if getattr(p, "grad_sample", None) is not None:
                p.grad_sample = None


class ModuleGradSource:
    """Per-sample gradients held by a ``GradSampleModule``."""

    def __init__(self, grad_sample_module):
        self.module = grad_sample_module

    def pop(self, params: List[torch.Tensor]) -> Dict[torch.Tensor, torch.Tensor]:
        popped = self.module.pop_grad_samples()
        wanted = set(params)
        return {p: _as_batch_tensor(g, "a parameter") for p, g in popped.items()
                if p in wanted and g is not None}

    def clear(self, params: List[torch.Tensor]) -> None:
        self.module.zero_grad_sample()

    def pending_passes(self) -> int:
        """Backward passes (batches) held by the module, concatenated for the next step."""
        count = getattr(self.module, "pending_passes", None)
        return int(count()) if count is not None else 1


def grad_source_for(module) -> object:
    """The best source for ``module``: the module itself if it is a norm provider
    (``per_sample_norms``/``clipped_sums``, the ghost/bk modes), else its
    ``pop_grad_samples`` if it has one."""
    if module is not None and hasattr(module, "clipped_sums"):
        return module
    if module is not None and hasattr(module, "pop_grad_samples"):
        return ModuleGradSource(module)
    return AttributeGradSource()
