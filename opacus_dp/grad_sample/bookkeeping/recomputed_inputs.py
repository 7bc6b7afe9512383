"""Hold a kept layer input as the input of the activation function that produced it.

The ``bk`` mode keeps a layer's input ``a`` from the layer's backward until the optimizer step
(the clipped sum ``(f ⊙ G)ᵀ a`` needs the clip factors, known only after the whole backward
pass). When ``a = φ(h)`` for an elementwise activation whose autograd node saves its *input*
``h`` (GELU, SiLU, Mish, LeakyReLU, Hardswish, Softplus, ELU/SELU/CELU), autograd holds ``h``
until ``φ``'s backward anyway, so while it runs ``a`` and ``h`` are both alive — in an MLP block
that is where the backward pass peaks. Holding ``h`` instead of ``a`` (one tensor of the same
size) removes ``a`` from that peak; ``a = φ(h)`` is recomputed in ``h``'s own memory as soon
as φ's backward has released ``h`` (:meth:`RecomputedInput.settle`, called at the next layer
record, while ``h`` is still in cache), or else at the step: one elementwise op per layer. The
recomputation is bit-identical: the same kernel on the same tensor and layout, with autocast
off (the node saved the input the kernel actually received).

It is done only when it is safe and pays: the input is exactly the activation's output (not
a view, not modified in place since), the saved ``h`` is still available and unmodified
(autograd's version check), no one but the record holds ``a``, and no saved-tensor hooks were
active. Activations that save their output (ReLU, tanh, sigmoid) keep ``a`` alive in autograd
anyway and gain nothing.
"""

from contextlib import contextmanager
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from opacus_dp.torch_internals import saved_tensor_hooks_active, saved_value, storage_use_count, version_counter

# autograd node -> (the aten op φ, the node's saved scalars that are φ's arguments)
_RECOMPUTE: Dict[str, Tuple[str, Tuple[str, ...]]] = {
    "GeluBackward0": ("gelu", ("approximate",)),
    "SiluBackward0": ("silu", ()),
    "MishBackward0": ("mish", ()),
    "HardswishBackward0": ("hardswish", ()),
    "LeakyReluBackward0": ("leaky_relu", ("negative_slope",)),
    "SoftplusBackward0": ("softplus", ("beta", "threshold")),
    "EluBackward0": ("elu", ("alpha", "scale", "input_scale")),  # also SELU
    "CeluBackward0": ("celu", ("alpha",)),
}


class RecomputedInput:
    """``φ(h)`` on demand: :meth:`value` is bit-identical to the layer input it replaces."""

    __slots__ = ("_op", "_source", "_version", "_arguments", "_batch_dim", "_threads", "_result")

    def __init__(self, op_name: str, source: torch.Tensor, arguments: Dict[str, object],
                 batch_dim: int, threads: int):
        self._op, self._source, self._arguments = getattr(torch.ops.aten, op_name), source, arguments
        self._version = version_counter(source)
        self._batch_dim, self._threads = batch_dim, threads
        self._result: Optional[torch.Tensor] = None

    def value(self) -> torch.Tensor:
        """``φ(h)`` (batch moved to dim 0), computed once; into ``h``'s own memory when nothing
        else holds ``h``. Bit-identity needs the same iteration as the forward's kernel: the
        same layout (``h`` as saved, moved only afterwards) and, on CPU, the same intra-op
        thread count (the chunks' scalar tails differ from the vector loop in the last bit),
        which is restored for the call if it changed since the forward pass."""
        if not self.settle():
            self._compute(in_place=False)
        return self._result

    def source_changed(self) -> bool:
        """``h`` was written in place by someone else since it was taken (then ``φ(h)`` would
        not be the layer input; once computed, the result is this object's own)."""
        return self._source is not None and version_counter(self._source) != self._version

    def settle(self) -> bool:
        """Compute ``φ(h)`` now if it can be done in ``h``'s memory (autograd has released
        ``h``: the activation's backward has run); True once computed. Called during the
        backward pass, right after that backward, ``h`` is still in cache."""
        if self._result is None and storage_use_count(self._source) == 1:
            self._compute(in_place=True)
        return self._result is not None

    def _compute(self, in_place: bool) -> None:
        source, self._source = self._source, None
        with torch.no_grad(), torch.autocast(source.device.type, enabled=False), \
                _intra_op_threads(self._threads if source.device.type == "cpu" else None):
            if in_place:
                result = self._op.out(source, **self._arguments, out=source)
            else:
                result = self._op.default(source, **self._arguments)
        if self._batch_dim != 0 and result.dim() > self._batch_dim:
            result = result.movedim(self._batch_dim, 0)
        self._result = result


@contextmanager
def _intra_op_threads(threads: Optional[int]):
    previous = torch.get_num_threads()
    if threads is None or threads == previous:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def producer_of(tensor) -> Optional[tuple]:
    """``(node, version, intra-op threads)`` if ``tensor`` is the fresh output of a
    recomputable activation (called in the forward pass, right after the activation); None
    under saved-tensor hooks (activation checkpointing, ``save_on_cpu``): there the saved
    ``h`` is packed, and unpacking it would recompute or copy it."""
    if not isinstance(tensor, torch.Tensor):
        return None
    node = tensor.grad_fn
    if node is None or type(node).__name__ not in _RECOMPUTE or saved_tensor_hooks_active():
        return None
    return node, version_counter(tensor), torch.get_num_threads()


def lean(recorded: torch.Tensor, producer: Optional[tuple], batch_dim: int,
         holders: int) -> Optional[RecomputedInput]:
    """A :class:`RecomputedInput` for the recorded input ``recorded`` (batch moved to dim 0)
    when holding the activation's input is safe and frees memory, else None.

    ``holders``: how many tensors of the caller share ``recorded``'s storage (the record's,
    plus a batch-first view); more means someone else keeps it alive and nothing is gained.
    """
    if producer is None:
        return None
    node, version, threads = producer
    if version_counter(recorded) != version or storage_use_count(recorded) > holders:
        return None  # modified in place since the call, or kept alive elsewhere
    try:
        source = saved_value(node, "self")  # raises once the activation's backward has freed it
    except RuntimeError:
        return None
    if source.shape != recorded.shape or source.dtype != recorded.dtype:
        return None
    op_name, names = _RECOMPUTE[type(node).__name__]
    arguments = {name: saved_value(node, name) for name in names}
    return RecomputedInput(op_name, source.detach(), arguments, batch_dim, threads)


def recomputed_in(values: Sequence) -> List[RecomputedInput]:
    """The :class:`RecomputedInput` entries of ``values``."""
    return [v for v in values if isinstance(v, RecomputedInput)]


def materialise(values: Sequence) -> List:
    """``values`` with every :class:`RecomputedInput` replaced by its value."""
    return [v.value() if isinstance(v, RecomputedInput) else v for v in values]
