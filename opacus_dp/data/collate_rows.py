"""One row per example: what a DP loader's ``collate_fn`` must keep.

Per-sample clipping bounds each *row* of a batch by ``C``. The accountant assumes that adding or
removing one example moves the clipped sum by at most ``C``, which holds only when every example
is one row: an example spread over ``k`` rows (several views, sequence-first tensors read on the
wrong dimension) moves it by up to ``k·C``, and examples packed into one row (sequence packing)
are clipped together, so one of them moves it by up to ``2C``.

The layout is learned when the loader is built, from the collates of one and of two copies of
``dataset[0]``: a tensor's *example dimension* is one that grows from 1 to 2. A tensor whose
shape changes otherwise (``(1, L) → (1, 2L)``: packing; ``(2, d) → (4, d)``: two rows per
example) is refused then, naming the field. Every non-empty batch is then checked: no example
dimension may have more rows than the batch has examples (fewer is allowed: a collate may drop
examples, e.g. unreadable ones). Tensors whose shape does not change with the number of examples
(per-batch constants) are not checked.
"""

import warnings
from collections.abc import Mapping
from typing import Any, List, Tuple

import numpy as np
import torch

Path = Tuple[Any, ...]
Layout = List[Tuple[Path, Tuple[int, ...]]]  # (where in the batch, its example dimensions)


class RowsPerExampleError(ValueError):
    """A collate function that does not give one row per example (module doc)."""


class BatchLayoutWarning(UserWarning):
    """The loader's batches hold their examples on another dimension than ``batch_first`` says
    the per-sample layers take them from."""


def _shape(value):
    if torch.is_tensor(value) or isinstance(value, np.ndarray):
        return tuple(value.shape)
    return None


def _where(path: Path) -> str:
    return "batch" + "".join(f"[{key!r}]" for key in path)


def learn_layout(single: Any, pair: Any, path: Path = ()) -> Layout:
    """The example dimensions of every tensor of ``single`` (the collate of one example) that
    ``pair`` (the collate of two) shows; raises :class:`RowsPerExampleError` for a tensor whose
    shape changes without a dimension growing from 1 to 2."""
    one, two = _shape(single), _shape(pair)
    if one is not None:
        if two is None or one == two or len(one) != len(two):  # a constant, or a collate that squeezes
            return []
        grown = tuple(d for d in range(len(one)) if one[d] == 1 and two[d] == 2)
        return [(path, grown)] if grown else _not_one_row(path, one, two)
    if isinstance(single, Mapping) and isinstance(pair, Mapping):
        return [entry for key in single if key in pair for entry in learn_layout(single[key], pair[key], path + (key,))]
    if isinstance(single, (list, tuple)) and isinstance(pair, (list, tuple)) and len(single) == len(pair):
        return [entry for i, (a, b) in enumerate(zip(single, pair)) for entry in learn_layout(a, b, path + (i,))]
    return []


def _not_one_row(path: Path, one, two) -> Layout:
    raise RowsPerExampleError(
        f"collate_fn does not give one row per example: {_where(path)} has shape {one} for one example "
        f"and {two} for two (no dimension grows from 1 to 2). Per-sample clipping bounds each row by "
        "max_grad_norm, so examples packed into one row (sequence packing, e.g. transformers' "
        "DataCollatorWithFlattening) or one example spread over several rows (several views or crops "
        "stacked as rows) would not each be bounded, and the reported epsilon would not hold. Make "
        "collate_fn return one row per example (pad instead of packing; give each view its own "
        "field, or use augmentation_multiplicity)")


def warn_if_layout_disagrees(layout: Layout, batch_first: bool, single: Any) -> None:
    """Warn (:class:`BatchLayoutWarning`) when no tensor of 2 or more dimensions holds its
    examples on the dimension the per-sample layers read them from (0 if ``batch_first``, else
    1): e.g. sequence-first ``(T, n, d)`` batches with ``batch_first=True``, where every layer
    would take the ``T`` positions for examples and clip each example once per position."""
    wanted = 0 if batch_first else 1
    wide = [(path, dims) for path, dims in layout if len(_shape(_at(single, path)) or ()) >= 2]
    if not wide or any(wanted in dims for _, dims in wide):
        return
    path, dims = wide[0]
    warnings.warn(
        f"the loader's batches hold their examples on dimension {dims[0]} of {_where(path)} (shape "
        f"{_shape(_at(single, path))} for one example), but batch_first={batch_first}: the per-sample layers take "
        f"dimension {wanted} as the examples. If the layers receive these tensors as they are, each example "
        "would be spread over several rows and clipped once per row (its contribution no longer bounded by "
        f"max_grad_norm): pass batch_first={not batch_first}, or collate the examples on dimension {wanted}. "
        "Ignore this warning only if the model moves the examples to that dimension before its first layer",
        BatchLayoutWarning, stacklevel=4)


def check_keeps_order(collate_fn, first: Any, second: Any) -> None:
    """Refuse (:class:`RowsPerExampleError`) a collate that does not keep its examples' order,
    seen on two different examples: ``collate([a, b]) == collate([b, a])`` (a collate that sorts
    its rows, e.g. by length for ``pack_padded_sequence``). Privacy units group the rows by their
    positions, so reordered rows would be clipped with another unit's."""
    try:
        forward, backward = collate_fn([first, second]), collate_fn([second, first])
        distinct = not _same(collate_fn([first]), collate_fn([second]))
    except Exception:  # a collate that cannot take these two: nothing is learned here
        return
    if distinct and _same(forward, backward):
        raise RowsPerExampleError(
            "collate_fn returns the same batch for two examples in either order, so it reorders its rows "
            "(e.g. sorts them by length): with privacy units (privacy_unit='user', augmentation_multiplicity) "
            "the rows are grouped into units by their positions, and reordered rows would be clipped with "
            "another unit's. Keep the examples' order in collate_fn (pack_padded_sequence(..., "
            "enforce_sorted=False) sorts inside the model instead)")


def _same(a: Any, b: Any) -> bool:
    """Equal structure and values (tensors and arrays: same shape and elements)."""
    if _shape(a) is not None or _shape(b) is not None:
        return _shape(a) == _shape(b) and bool((torch.as_tensor(a) == torch.as_tensor(b)).all())
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def check_rows(batch: Any, layout: Layout, examples: int) -> None:
    """Raise :class:`RowsPerExampleError` if an example dimension of ``batch`` (a collate of
    ``examples`` examples) has more rows than that."""
    for path, dims in layout:
        shape = _shape(_at(batch, path))
        if shape is None:
            continue
        for d in dims:
            if d < len(shape) and shape[d] > examples:
                raise RowsPerExampleError(
                    f"collate_fn returned {shape[d]} rows in dimension {d} of {_where(path)} for a batch of "
                    f"{examples} examples: an example spread over several rows is clipped once per row, so "
                    "its contribution is no longer bounded by max_grad_norm. Make collate_fn return one row "
                    "per example (it may drop examples, never add rows)")


def _at(batch: Any, path: Path) -> Any:
    for key in path:
        try:
            batch = batch[key]
        except (TypeError, KeyError, IndexError):
            return None
    return batch
