"""Opacus 1.x's collate wrappers of ``opacus.data_loader``.

``wrap_collate_with_empty`` / ``CollateFnWithEmpty`` learn the structure of a batch from the first
non-empty one (``DPDataLoader`` instead learns it from ``dataset[0]`` when it is built, so that
even a first empty batch has the right structure).
"""

import copy
import logging
from typing import Any, Callable, List, Optional, Sequence, Tuple, Type, Union

import torch

from opacus_dp.data.collate import empty_like_batch

logger = logging.getLogger("opacus_dp.data_loader")  # the logger of Opacus's module path

__all__ = ["CollateFnWithEmpty", "dtype_safe", "shape_safe", "wrap_collate_with_empty"]


def _random_like_one_sample(batch: Any, batch_first: bool) -> Any:
    """Random 0/1 values in the structure of ``batch`` with one sample (``rand_on_empty``)."""
    if torch.is_tensor(batch):
        shape = list(batch.shape)
        shape[0 if batch_first or batch.dim() < 2 else 1] = 1
        return torch.randint(0, 2, shape, dtype=batch.dtype, device=batch.device)
    if isinstance(batch, dict):
        return {k: _random_like_one_sample(v, batch_first) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_random_like_one_sample(v, batch_first) for v in batch)
    raise TypeError(f"rand_on_empty: cannot build a random {type(batch).__name__}; return tensors, "
                    "dicts, lists or tuples from collate_fn")


class CollateFnWithEmpty:
    """``collate_fn`` wrapper (Opacus 1.x): non-empty batches go to ``collator_fn`` (as they
    are when it is None); an empty one gets the structure of the first non-empty batch with
    zero samples (``rand_on_empty``: one sample of random 0/1 values, which carry no data).
    An empty first batch gives zeros of ``sample_empty_shapes``/``dtypes`` if given, else ``[]``.
    """

    def __init__(self, collator_fn: Optional[Callable], batch_first: bool = True, rand_on_empty: bool = False,
                 sample_empty_shapes: Optional[Sequence[Tuple]] = None,
                 dtypes: Optional[Sequence[Union[torch.dtype, Type]]] = None):
        self.wrapped_collator_fn = collator_fn
        self.batch_first = batch_first
        self.rand_on_empty = rand_on_empty
        self.sample_empty_shapes = sample_empty_shapes
        self.dtypes = dtypes
        self.first_batch = None

    def __call__(self, batch: List[Any]) -> Any:
        if len(batch) > 0:
            output = self.wrapped_collator_fn(batch) if self.wrapped_collator_fn else batch
            if self.first_batch is None:
                self.first_batch = copy.deepcopy(output)
            return output
        if self.first_batch is None:
            logger.warning("First batch is empty, so its structure is unknown: using %s. Use "
                           "opacus_dp.data.DPDataLoader, which learns it from the dataset",
                           "zeros of sample_empty_shapes" if self.sample_empty_shapes is not None
                           and self.dtypes is not None else "an empty list")
            if self.sample_empty_shapes is not None and self.dtypes is not None:
                return [torch.zeros(shape, dtype=dtype) for shape, dtype in zip(self.sample_empty_shapes, self.dtypes)]
            return []
        try:
            if self.rand_on_empty:
                return _random_like_one_sample(self.first_batch, self.batch_first)
            return empty_like_batch(self.first_batch, batch_first=self.batch_first)
        except TypeError as error:  # Opacus's wording
            raise TypeError(f"Unsupported batch type: {error}") from None


def wrap_collate_with_empty(*, collate_fn: Optional[Callable], batch_first: bool = True,
                            rand_on_empty: bool = False, sample_empty_shapes: Optional[Sequence[Tuple]] = None,
                            dtypes: Optional[Sequence[Union[torch.dtype, Type]]] = None) -> CollateFnWithEmpty:
    """``collate_fn`` that also accepts empty batches (see :class:`CollateFnWithEmpty`)."""
    return CollateFnWithEmpty(collate_fn, batch_first=batch_first, rand_on_empty=rand_on_empty,
                              sample_empty_shapes=sample_empty_shapes, dtypes=dtypes)


def shape_safe(x: Any) -> Tuple:
    """``x.shape``, or ``()`` for objects without one."""
    return getattr(x, "shape", ())


def dtype_safe(x: Any) -> Union[torch.dtype, Type]:
    """``x.dtype``, or ``type(x)`` for objects without one."""
    return getattr(x, "dtype", type(x))
