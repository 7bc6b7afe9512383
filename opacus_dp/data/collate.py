"""Collation that turns an empty Poisson batch into a well-formed batch with zero rows.

With Poisson sampling a batch is empty with probability ``(1-q)^N``. Most collate functions
cannot handle ``[]``, yet the step must still be taken (the accountant counts it and the noise
is still added), so the model must see a batch of the right structure with zero examples.

The structure is learned once, when the loader is built, by collating the single example
``dataset[0]``; every tensor of that result is turned into an empty tensor with the same
dtype and trailing shape. No value of ``dataset[0]`` ever reaches an empty batch.
"""

from collections.abc import Mapping
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch.utils.data._utils.collate import default_collate

_SCALARS = (str, bytes, int, float, complex, bool, type(None))


def _empty_tensor(value: torch.Tensor, batch_first: bool, where: str) -> torch.Tensor:
    if value.dim() == 0:
        raise TypeError(
            f"collate_fn returned a 0-dim tensor at {where}; an empty batch cannot be built for it. "
            "Make collate_fn return tensors with a batch dimension"
        )
    batch_dim = 0 if batch_first or value.dim() < 2 else 1
    shape = list(value.shape)
    shape[batch_dim] = 0
    return torch.empty(shape, dtype=value.dtype, device=value.device)


def _is_per_sample_list(value) -> bool:
    """A list/tuple of plain Python scalars: one entry per example (e.g. collated strings)."""
    return all(isinstance(v, _SCALARS) for v in value)


def empty_like_batch(batch: Any, *, batch_first: bool = True, where: str = "batch") -> Any:
    """The structure of ``batch`` with every per-example field emptied (zero rows).

    Tensors and numpy arrays keep dtype and trailing shape; dicts, tuples, named tuples and
    lists are rebuilt field by field; lists of Python scalars (e.g. strings) become empty.
    Anything else raises TypeError naming the field (it could carry data of ``dataset[0]``).
    """
    if torch.is_tensor(batch):
        return _empty_tensor(batch, batch_first, where)
    if isinstance(batch, np.ndarray):
        return _empty_tensor(torch.from_numpy(batch), batch_first, where).numpy()
    if isinstance(batch, Mapping):
        items = {
            k: empty_like_batch(v, batch_first=batch_first, where=f"{where}[{k!r}]") for k, v in batch.items()
        }
        return items if type(batch) is dict else type(batch)(items)
    if isinstance(batch, (list, tuple)):
        if not hasattr(batch, "_fields") and len(batch) > 0 and _is_per_sample_list(batch):
            return type(batch)()
        fields = [
            empty_like_batch(v, batch_first=batch_first, where=f"{where}[{i}]") for i, v in enumerate(batch)
        ]
        return type(batch)(*fields) if hasattr(batch, "_fields") else type(batch)(fields)
    raise TypeError(
        f"collate_fn returned {type(batch).__name__} at {where}; DPDataLoader can only build empty "
        "batches from tensors, numpy arrays, dicts, tuples and lists. Return one of these from collate_fn"
    )


class EmptyBatchCollate:
    """``collate_fn`` wrapper: non-empty batches go to ``collate_fn``, empty ones get ``empty_batch``.

    A class rather than a closure so that it pickles into DataLoader worker processes.
    """

    def __init__(self, collate_fn: Optional[Callable], empty_batch: Any):
        self.collate_fn = default_collate if collate_fn is None else collate_fn
        self.empty_batch = empty_batch

    @classmethod
    def from_dataset(cls, dataset, collate_fn: Optional[Callable], *, batch_first: bool = True):
        """Learn the empty batch by collating ``[dataset[0]]`` (raises ValueError on an empty dataset)."""
        if len(dataset) == 0:
            raise ValueError("dataset is empty: there is nothing to sample from")
        fn = default_collate if collate_fn is None else collate_fn
        empty = empty_like_batch(fn([dataset[0]]), batch_first=batch_first)
        return cls(fn, empty)

    def __call__(self, samples):
        if len(samples) > 0:
            return self.collate_fn(samples)
        return _fresh_copy(self.empty_batch)


def _fresh_copy(batch):
    """A new instance of the empty batch, so callers may mutate what they receive."""
    if torch.is_tensor(batch):
        return batch.clone()
    if isinstance(batch, np.ndarray):
        return batch.copy()
    if isinstance(batch, Mapping):
        items = {k: _fresh_copy(v) for k, v in batch.items()}
        return items if type(batch) is dict else type(batch)(items)
    if isinstance(batch, (list, tuple)):
        fields = [_fresh_copy(v) for v in batch]
        return type(batch)(*fields) if hasattr(batch, "_fields") else type(batch)(fields)
    return batch


def unwrap_collate(collate_fn: Optional[Callable]) -> Optional[Callable]:
    """The user's collate function behind an ``EmptyBatchCollate`` (or ``collate_fn`` itself)."""
    return collate_fn.collate_fn if isinstance(collate_fn, EmptyBatchCollate) else collate_fn
