"""Gram products shared by the layer calls of one backward pass that read the same input, or the
same output gradient.

The ghost norm of a ``Linear`` call multiplies, per sample, the Gram matrix of its inputs,
``A_i A_iᵀ`` (``T² d`` multiply-adds), by that of its output gradients
(:mod:`~opacus_dp.grad_sample.bookkeeping.norm_samplers.linear`). Calls on the same tensor — an
attention block's query, key and value projections, a gated MLP's gate and up projections —
have the same ``A``: the first of them to be resolved keeps its input products, the others take
them, and the last one drops them. For a Llama-style block with ghost norms this saves two of
the six Gram products of the q/k/v projections and one of the four of gate/up.

How many hooked calls read an input is counted in the forward pass
(:meth:`SharedInputGrams.expect`, by the input's storage and view: the records are detached views
of it, alive until resolved); a resolution keeps products only while another such call is still
to come. An entry is used only for the very tensor it was computed from: it holds that tensor (so
its memory cannot be reused by another one) and a lookup must match its storage, offset, shape,
strides, dtype, device and version counter. Anything else — a copy in another
dtype under autocast, positions merged from several calls, an input written in place — computes
its own products. Taking an entry changes no number: the products are the same operations on
the same values.

The output-gradient products ``G_i G_iᵀ`` are shared the same way between the two projections of
a recurrent cell that hold one output gradient (:mod:`~opacus_dp.grad_sample.bookkeeping.step_gradients`):
the input projection's resolution keeps them (:meth:`SharedInputGrams.sharing_gradient`), the
step projection's, at the end of the pass, takes them if its merged gradient is that very tensor
(:func:`gradient_products`).
"""

import threading
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from opacus_dp.maths.cpu_products import per_sample_products
from opacus_dp.torch_internals import version_counter

_ACTIVE = threading.local()  # the resolution running on this thread: (SharedInputGrams, key, keep)
_GRADIENT = threading.local()  # the same for a shared output gradient
_NO_SCOPE = nullcontext()  # reusable: what a resolution without shared products enters
Key = tuple  # (data pointer, shape, strides, dtype, device), "gradient" first for an output gradient


@dataclass
class _Entry:
    source: torch.Tensor  # the tensor the products were computed from (held: see the module doc)
    version: int
    bounds: tuple
    products: List[torch.Tensor]

    def matches(self, a: torch.Tensor, bounds: tuple) -> bool:
        s = self.source
        return (bounds == self.bounds and a.device == s.device and a.dtype == s.dtype
                and a.shape == s.shape and a.stride() == s.stride()
                and a.storage_offset() == s.storage_offset()
                and a.untyped_storage().data_ptr() == s.untyped_storage().data_ptr()
                and version_counter(a) == self.version == version_counter(s))


def input_key(call) -> Optional[Key]:
    """Memory and view of the first positional tensor of a call (a ``LayerCall`` or the forward
    ``args``), or None (no such tensor, or one without memory of its own, such as a tensor
    subclass or a tensor traced by the compiler). It only counts calls: an entry is taken after
    :meth:`_Entry.matches` alone."""
    args = getattr(call, "args", call)
    x = args[0] if isinstance(args, (tuple, list)) and args else None
    if type(x) not in (torch.Tensor, torch.nn.Parameter) or x.device.type == "meta":
        return None
    try:
        pointer = x.data_ptr()
    except (RuntimeError, NotImplementedError):  # e.g. functionalised or sparse tensors
        return None
    return pointer, tuple(x.shape), x.stride(), x.dtype, x.device


class SharedInputGrams:
    """Counts the calls per input and keeps input products between their resolutions."""

    def __init__(self):
        self._uses: Dict[Key, int] = {}  # input -> its calls not yet resolved
        self._entries: Dict[Key, _Entry] = {}
        self.taken = 0  # products taken from an entry instead of computed (tests, profiling)

    def expect(self, inputs) -> None:
        """A forward call on ``inputs`` (its positional arguments) awaits its backward pass."""
        key = input_key(inputs)
        if key is not None:
            self._uses[key] = self._uses.get(key, 0) + 1

    def resolving(self, calls: Sequence):
        """Around the resolution of ``calls`` (``Call`` records) of one layer: products of a
        single call's input are kept while another call of that input is still to come (the call
        is counted as resolved here)."""
        key, keep = None, False
        if len(calls) == 1:  # merged calls take nothing (their inputs are concatenated copies)
            key = input_key(calls[0].call)
        if key is not None:
            left = self._uses.get(key, 1) - 1
            keep = left > 0
            if keep:
                self._uses[key] = left
            else:
                self._uses.pop(key, None)
        return self._scope(_ACTIVE, key, keep)

    def sharing_gradient(self, key: Optional[Key], keep: bool):
        """Around the resolution of a layer whose output gradient (``key``: :func:`tensor_key`)
        another layer's resolution reads too: its Gram products are kept for that one (``keep``),
        or taken and dropped."""
        return self._scope(_GRADIENT, key, keep)

    def _scope(self, local: threading.local, key: Optional[Key], keep: bool):
        """``local.scope`` set for the products of ``key`` while the resolution runs; the entry
        dropped after it unless kept for a later one. Nothing to set or drop without a key
        where no scope is set (a layer's usual resolution)."""
        if key is None and getattr(local, "scope", None) is None:
            return _NO_SCOPE
        return self._set_scope(local, key, keep)

    @contextmanager
    def _set_scope(self, local: threading.local, key: Optional[Key], keep: bool) -> Iterator[None]:
        outer = getattr(local, "scope", None)
        local.scope = (self, key, keep) if key is not None else None
        try:
            yield
        finally:
            local.scope = outer
            if key is not None and not keep:
                self._entries.pop(key, None)

    def drop(self, key: Optional[Key]) -> None:
        """Forget the products kept for ``key`` (the layer that would have taken them will not)."""
        self._entries.pop(key, None)

    def end_pass(self) -> None:
        """Drop every kept product and count: none outlives its backward pass (a call whose
        output got no gradient leaves a count that would only keep products for nothing)."""
        self._entries.clear()
        self._uses.clear()

    def _products(self, key: Key, keep: bool, a: torch.Tensor, bounds: tuple):
        """The entry's products (a list, read only) if it was computed from ``a``; else computed,
        as a list kept for a later call if ``keep``, or one block at a time (a generator)."""
        entry = self._entries.get(key)
        if entry is not None and entry.matches(a, bounds):
            self.taken += 1
            return entry.products
        if not keep or a.numel() == 0:
            return _block_products(a, bounds)
        products = list(_block_products(a, bounds))
        self._entries[key] = _Entry(a, version_counter(a), bounds, products)
        return products


def _block_products(a: torch.Tensor, bounds: Sequence[int]) -> Iterator[torch.Tensor]:
    for low, high in zip(bounds[:-1], bounds[1:]):
        yield per_sample_products(a[:, low:high], a[:, low:])


def tensor_key(t: torch.Tensor) -> Optional[Key]:
    """The key of an output gradient's products (as :func:`input_key`, marked apart)."""
    key = input_key((t,))
    return None if key is None else ("gradient", *key)


def gradient_products(g: torch.Tensor, bounds: Sequence[int]) -> Tuple[Iterator[torch.Tensor], bool]:
    """``G[:, lo:hi] G[:, lo:]ᵀ`` for the row blocks ``bounds`` of ``G (B, T, p)``, and whether the
    caller may write them (not when kept for, or taken from, another layer's resolution)."""
    scope = getattr(_GRADIENT, "scope", None)
    if scope is None:
        return _block_products(g, bounds), True
    shared, key, keep = scope
    keep = keep and tensor_key(g) == key  # not for another tensor, e.g. a float32 copy of a bfloat16 one
    products = shared._products(key, keep, g, tuple(bounds))
    return iter(products), not isinstance(products, list)


def input_products(a: torch.Tensor, bounds: Sequence[int]):
    """``A[:, lo:hi] A[:, lo:]ᵀ`` for the row blocks ``bounds`` of ``A (B, T, d)``, in order: taken
    from the entry kept for ``a`` by the resolution running on this thread, else computed (one
    block at a time, unless kept for a later call). The products must not be written to."""
    scope = getattr(_ACTIVE, "scope", None)
    if scope is None:
        return _block_products(a, bounds)
    shared, key, keep = scope
    return shared._products(key, keep, a, tuple(bounds))
