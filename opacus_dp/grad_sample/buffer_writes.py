"""Buffers written during a private forward pass: found by version counter, named in the error.

A buffer written from the batch in ``forward`` (a running mean of the inputs) is released by
``state_dict()`` without noise and used by later steps: outside the privacy guarantee. Before a
recorded forward the identity and version counter (``tensor._version``, incremented by every
in-place write) of each buffer are noted; after it, a buffer written in place, replaced by another
tensor, or added is refused unless its name is declared public. One integer per buffer per forward.
"""

from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.nn as nn

from opacus_dp.errors import UnsupportedModuleError
from opacus_dp.grad_sample.support import describe


class BufferWrittenError(UnsupportedModuleError):
    """A buffer was written during a private forward pass and was not declared public."""


def version(t: torch.Tensor) -> Optional[int]:
    try:
        return t._version
    except RuntimeError:  # an inference-mode tensor has no version counter: identity only
        return None


def written_buffers(model: nn.Module, before: Dict[str, tuple], public: Iterable[str]) -> List[str]:
    """Names of ``model``'s buffers replaced, written in place or added since ``before``."""
    public = set(public)
    return [name for name, b in model.named_buffers() if name not in public and (
        name not in before or before[name][0] is not b or before[name][1] != version(b))]


def buffer_error(model: nn.Module, full_name: str) -> BufferWrittenError:
    path, _, name = full_name.rpartition(".")
    return BufferWrittenError(
        f"{describe(path, model.get_submodule(path))} writes in place (or replaces) its buffer {name!r} "
        f"during a private forward pass: a value computed from the batch is released by state_dict() "
        f"(and used by later steps) without noise, outside the privacy guarantee. Compute it without "
        f"the training data or keep it out of the model; if its value does not depend on the training "
        f"data, declare it public: make_private(..., public_buffers=[{full_name!r}]) "
        f"(check_sample_independence=False turns off every model check)")


def check_public_buffers(model: nn.Module, public_buffers) -> Tuple[str, ...]:
    """``public_buffers`` as a tuple of ``model``'s buffer names, or an error naming the fix."""
    if isinstance(public_buffers, str) or not isinstance(public_buffers, Iterable):
        raise TypeError(f"public_buffers must be a list of buffer names (as in "
                        f"model.named_buffers(), e.g. ['block.stats']), got {public_buffers!r}")
    names = tuple(public_buffers)
    known = dict(model.named_buffers())
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"public_buffers names {unknown}, which are not buffers of the model; "
                         f"its buffers are {sorted(known)}")
    return names


def versions(model: nn.Module) -> Dict[str, tuple]:
    """``{name: (buffer, version)}`` of ``model``'s buffers, for :func:`written_buffers`."""
    return {name: (b, version(b)) for name, b in model.named_buffers()}
