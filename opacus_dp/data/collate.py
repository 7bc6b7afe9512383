"""Collation that turns an empty Poisson batch into a well-formed batch with zero rows.

With Poisson sampling a batch is empty with probability ``(1-q)^N``. Most collate functions
cannot handle ``[]``, yet the step must still be taken (the accountant counts it and the noise
is still added), so the model must see a batch of the right structure with zero examples.

The structure is learned once, when the loader is built, by collating the single example
``dataset[0]``, and ``[dataset[0], dataset[0]]`` to see which dimension (or list) holds the
examples; every tensor of the first result is turned into an empty tensor with the same dtype
and the other dimensions. No value of ``dataset[0]`` ever reaches an empty batch.
"""

from collections.abc import Mapping
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch.utils.data._utils.collate import default_collate

from opacus_dp.data.collate_rows import Layout, check_rows, learn_layout, warn_if_layout_disagrees

_SCALARS = (str, bytes, int, float, complex, bool, type(None))
_UNKNOWN = object()  # no two-example collate to compare with


def _batch_dim(value: torch.Tensor, pair: Any, batch_first: bool) -> int:
    """The dimension that grows from 1 to 2 between the collates of one and two examples; where
    that is unknown or ambiguous, 0 (``batch_first``) or else 1 for tensors of ≥ 2 dims."""
    if torch.is_tensor(pair) and pair.dim() == value.dim():
        grown = [d for d in range(value.dim()) if value.shape[d] == 1 and pair.shape[d] == 2]
        same = all(value.shape[d] == pair.shape[d] for d in range(value.dim()) if d not in grown)
        if len(grown) == 1 and same:
            return grown[0]
    return 0 if batch_first or value.dim() < 2 else 1


def _empty_tensor(value: torch.Tensor, pair: Any, batch_first: bool, where: str) -> torch.Tensor:
    if value.dim() == 0:
        raise TypeError(
            f"collate_fn returned a 0-dim tensor at {where}; an empty batch cannot be built for it. "
            "Make collate_fn return tensors with a batch dimension"
        )
    shape = list(value.shape)
    shape[_batch_dim(value, pair, batch_first)] = 0
    return torch.empty(shape, dtype=value.dtype, device=value.device)


def _is_per_sample_list(value, pair) -> bool:
    """A list emptied as a whole: one entry per example (it grows from 1 to 2 entries with the
    examples), or plain Python scalars (e.g. strings: per-example names, or constant metadata,
    which an empty batch need not carry)."""
    if hasattr(value, "_fields"):
        return False
    if isinstance(pair, (list, tuple)) and len(value) == 1 and len(pair) == 2:
        return True
    return len(value) > 0 and all(isinstance(v, _SCALARS) for v in value)


def _part(pair: Any, key) -> Any:
    """The field ``key`` of the two-example collate, if it has that structure."""
    try:
        return pair[key]
    except (TypeError, KeyError, IndexError):
        return _UNKNOWN


def empty_like_batch(batch: Any, *, batch_first: bool = True, where: str = "batch",
                     pair: Any = None) -> Any:
    """The structure of ``batch`` (the collate of one example) with every per-example field
    emptied (zero rows).

    ``pair``, the collate of two examples, tells where the examples are: the dimension of each
    tensor that grows from 1 to 2 is emptied (targets that stay batch-first in a sequence-first
    model, say), and a list that grows from 1 to 2 entries (one per example, e.g. variable-length
    tensors) becomes empty. Without it, dim 0 is emptied (dim 1 for tensors of ≥ 2 dims when not
    ``batch_first``) and lists of Python scalars (e.g. strings) become empty. Tensors and numpy
    arrays keep dtype and trailing shape; dicts, tuples, named tuples and lists are rebuilt field
    by field. Anything else raises TypeError naming the field (it could carry data of
    ``dataset[0]``).
    """
    pair = _UNKNOWN if pair is None else pair
    if torch.is_tensor(batch):
        return _empty_tensor(batch, pair, batch_first, where)
    if isinstance(batch, np.ndarray):
        pair = torch.from_numpy(pair) if isinstance(pair, np.ndarray) else pair
        return _empty_tensor(torch.from_numpy(batch), pair, batch_first, where).numpy()
    if isinstance(batch, Mapping):
        items = {k: empty_like_batch(v, batch_first=batch_first, where=f"{where}[{k!r}]",
                                     pair=_part(pair, k)) for k, v in batch.items()}
        return items if type(batch) is dict else type(batch)(items)
    if isinstance(batch, (list, tuple)):
        if _is_per_sample_list(batch, pair):
            return type(batch)()
        same_length = isinstance(pair, (list, tuple)) and len(pair) == len(batch)
        fields = [empty_like_batch(v, batch_first=batch_first, where=f"{where}[{i}]",
                                   pair=pair[i] if same_length else _UNKNOWN)
                  for i, v in enumerate(batch)]
        return type(batch)(*fields) if hasattr(batch, "_fields") else type(batch)(fields)
    raise TypeError(
        f"collate_fn returned {type(batch).__name__} at {where}; DPDataLoader can only build empty "
        "batches from tensors, numpy arrays, dicts, tuples and lists. Return one of these from collate_fn"
    )


class EmptyBatchCollate:
    """``collate_fn`` wrapper: non-empty batches go to ``collate_fn``, empty ones get ``empty_batch``.

    A class rather than a closure so that it pickles into DataLoader worker processes.
    """

    def __init__(self, collate_fn: Optional[Callable], empty_batch: Any, layout: Layout = ()):
        self.collate_fn = default_collate if collate_fn is None else collate_fn
        self.empty_batch = empty_batch
        self.layout = list(layout)  # the example dimensions every batch is checked on (collate_rows)

    @classmethod
    def from_dataset(cls, dataset, collate_fn: Optional[Callable], *, batch_first: bool = True):
        """Learn the empty batch and the example dimensions (:mod:`~opacus_dp.data.collate_rows`) by
        collating ``[dataset[0]]`` and ``[dataset[0], dataset[0]]`` (raises ValueError on an empty
        dataset, :class:`~opacus_dp.data.collate_rows.RowsPerExampleError` on a collate that does
        not give one row per example)."""
        if len(dataset) == 0:
            raise ValueError("dataset is empty: there is nothing to sample from")
        fn = default_collate if collate_fn is None else collate_fn
        first = dataset[0]
        try:
            pair = fn([first, first])
        except Exception:  # a collate that refuses a repeated example: fall back to the layout rule
            pair = None
        single = fn([first])
        layout = [] if pair is None else learn_layout(single, pair)
        warn_if_layout_disagrees(layout, batch_first, single)
        return cls(fn, empty_like_batch(single, batch_first=batch_first, pair=pair), layout)

    def __call__(self, samples):
        if len(samples) > 0:
            batch = self.collate_fn(samples)
            check_rows(batch, self.layout, len(samples))
            return batch
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
