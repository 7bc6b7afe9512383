"""Refuse per-sample work on tensors changed in place after they were recorded.

The per-sample machinery keeps references (no copies) to what a layer call saw: its inputs,
from the forward call to its backward (every mode), and in ``bk``/``ghost`` a ghost layer's
inputs and output gradients until ``optimizer.step()``. Autograd's version counter
(``tensor._version``, shared by a tensor, its views and its detached aliases, bumped by every
in-place write) tells whether those values are still the ones the layer saw.

A changed input would be a privacy bug, not just a wrong gradient: the clip factors come from
the norms of the old values, and the clipped sum ``Σ_i f_i g_i`` would be built from the new
ones, so a sample's contribution could exceed the clipping bound. Plain autograd refuses a
changed saved tensor too, but in ``bk``/``ghost`` the layers' weight gradients are not computed
by autograd, which therefore saves no inputs for them and cannot notice.
"""

from typing import Any, List, Optional, Sequence, Tuple

import torch

from opacus_dp.grad_sample.bookkeeping.recomputed_inputs import RecomputedInput
from opacus_dp.torch_internals import version_counter


def versions_of(tensors: Sequence[torch.Tensor]) -> Tuple[int, ...]:
    """The version counters of ``tensors`` now."""
    return tuple(version_counter(t) for t in tensors)


def first_changed(tensors: Sequence[torch.Tensor], versions: Tuple[int, ...]) -> Optional[int]:
    """Index of the first of ``tensors`` written in place since ``versions`` were read."""
    for index, (tensor, version) in enumerate(zip(tensors, versions)):
        if version_counter(tensor) != version:
            return index
    return None


class KeptVersions:
    """The versions of the tensors kept for a layer's clipped sum, to check at the step."""

    __slots__ = ("_tensors", "_versions", "_recomputed")

    def __init__(self, values: Sequence[Any]):
        self._tensors = [v for v in values if isinstance(v, torch.Tensor)]
        self._versions = versions_of(self._tensors)
        self._recomputed: List[RecomputedInput] = [v for v in values if isinstance(v, RecomputedInput)]

    def changed(self) -> bool:
        return first_changed(self._tensors, self._versions) is not None \
            or any(r.source_changed() for r in self._recomputed)


def changed_before_backward(layer_name: str, position: int) -> RuntimeError:
    return RuntimeError(
        f"{layer_name}: its input (tensor argument #{position}) was modified in place after the "
        "layer's forward call and before its backward pass, so the per-sample gradients would "
        "not be those of the values the layer saw. Modify a copy (x = x.clone()) or apply the "
        "in-place operation before the layer"
    )


def changed_before_step(layer_name: str) -> RuntimeError:
    return RuntimeError(
        f"{layer_name}: a tensor this layer was called with was modified in place between "
        "loss.backward() and optimizer.step(). The 'bk' mode (and 'ghost' with a plain "
        "loss.backward()) keeps each layer's input, without a copy, until the step to build the "
        "clipped sum, whose clip factors came from the old values. Call optimizer.step() before "
        "changing the tensor (e.g. before refilling a reused input buffer), or pass the model a "
        "copy; nothing was updated"
    )
