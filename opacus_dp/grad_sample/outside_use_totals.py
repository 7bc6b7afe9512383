"""Find a parameter used outside the module that owns it, where autograd's weight gradients are kept.

A use such as ``F.linear(h, emb.weight)`` in a parent's forward (or in the loss) adds to the
gradient ``G_l`` that autograd forms for the parameter in a backward pass, but no per-sample
hook sees it: the private update would silently leave it out. Where the owner's weight
gradients are switched off (``skip_weight_grads``), any accumulated gradient reveals such a use
(:class:`~opacus_dp.grad_sample.bookkeeping.weight_grad_skipping.OutsideUseCheck`). Where they
are kept (the ``hooks``/``functorch`` default, as in Opacus), each pass compares ``G_l`` (a hook
on the leaf, before accumulation) with what the hooks formed, ``Σ_i g_il`` (over ``B`` for the
``mean`` reduction, whose ``1/B`` the hooks undo). Rounding apart, they differ only if another
use contributed: beyond :data:`TOLERANCE` times the pass's largest total entry (of any watched
parameter: a gradient that cancels to rounding noise, such as an attention key's bias, is
judged against the model's scale) the pass is refused, naming the parameter. Layers whose
per-sample gradient is not a share of the batch gradient by definition (embeddings with
``scale_grad_by_freq``) are not watched. A pass whose total arrived in another graph task (a reentrant
checkpoint's recomputation) is not compared.

Non-finite values are checked first: where either side holds a NaN or inf — an overflow (float16
under a loss scale, a squared norm beyond float32) or a NaN input or loss — the two cannot be
compared, and the parameter is not judged in that pass; an overflow is never blamed on an outside
use. The step then drops the samples whose gradients are not finite, or with
``non_finite_samples="refuse"`` names the overflow (:mod:`opacus_dp.optim.nonfinite`); a refusal
here would depend on the batch's data. An outside use shows in the next pass without one.
"""

import math
import threading
from typing import Callable, Dict, List, Set, Tuple

import torch
import torch.nn as nn

from opacus_dp.maths.per_sample import JOINED_CHECK_ELEMENTS, largest_magnitude
from opacus_dp.module_parameters import own_parameters
from opacus_dp.torch_internals import current_graph_task_id

TOLERANCE = {torch.float16: 3e-2, torch.bfloat16: 3e-2}  # also for calls under autocast
DEFAULT_TOLERANCE = 1e-3
JOINED_PER_SAMPLE_ELEMENTS = 1 << 20  # per-sample entries joined into one copy at most (4 MiB in float32)
SEGMENT_DEVICES = ("cpu", "cuda")  # where torch.segment_reduce runs; elsewhere one tensor at a time
OUTSIDE_USE = (
    "parameter {name} received a gradient from a use outside the module that owns it "
    "(e.g. F.linear(h, emb.weight) in a parent's forward or in the loss): that use has no "
    "per-sample gradient and would be left out of the private update. Use the parameter only "
    "through modules, e.g. tie a second module to it (head = nn.Linear(d, vocab, bias=False); "
    "head.weight = emb.weight); for a penalty on the weights in the loss, use the optimizer's "
    "weight_decay instead. (Without such a use, the per-sample gradients of its layer disagree "
    "with autograd's gradient: please report the layer.)"
)


class OutsideUseTotals:
    """Per backward pass, the total gradient of each watched parameter; :meth:`check` compares
    it with the pass's per-sample gradients (module doc)."""

    def __init__(self, names: Dict[int, str], handles: List[object]):
        self._names = names
        self._handles = handles  # the wrapper's hook handles, removed when it is closed
        self._watched: Set[int] = set()
        self._low_precision: Set[int] = set()
        self._totals: Dict[Tuple[int, int], torch.Tensor] = {}
        self._lock = threading.Lock()

    def watch_layer(self, layer: nn.Module, low_precision: bool) -> None:
        """Hook the trainable parameters of ``layer`` not hooked yet (called at each of its
        calls: a tensor unfrozen after wrapping is watched from its next call); a call under
        autocast (``low_precision``) judges them with the half-precision tolerance."""
        if getattr(layer, "scale_grad_by_freq", False):
            return
        for _, param in own_parameters(layer):
            if low_precision:
                self._low_precision.add(id(param))
            if param.requires_grad and id(param) not in self._watched:
                self._watched.add(id(param))
                self._handles.append(param.register_hook(self._recorder(param)))

    def _recorder(self, param: torch.Tensor) -> Callable[[torch.Tensor], None]:
        key = id(param)

        def record(grad: torch.Tensor) -> None:
            task = current_graph_task_id()
            with self._lock:
                previous = self._totals.get((task, key))
                self._totals[(task, key)] = grad if previous is None else previous + grad
        return record

    def check(self, task: int, grads: Dict[torch.Tensor, torch.Tensor], undo_mean: bool) -> None:
        """RuntimeError naming the first parameter whose total of pass ``task`` is not
        ``Σ_i g_i`` within :data:`TOLERANCE` of the pass's largest total entry (module doc)."""
        with self._lock:
            totals = {p: self._totals.pop((task, id(p)), None) for p in grads}
        compared = [(p, t) for p, t in totals.items() if t is not None and grads[p].shape[0] > 0 and t.numel()]
        peaks = _checked_stats([(t, grads[p]) for p, t in compared], undo_mean)
        judged = [(p, peak, gap) for (p, _), (peak, gap) in zip(compared, peaks)
                  if math.isfinite(peak) and math.isfinite(gap)]  # overflow or NaN: not judged
        if not judged:
            return
        scale = max(peak for _, peak, _ in judged)
        for param, _, gap in judged:
            dtype = torch.bfloat16 if id(param) in self._low_precision else grads[param].dtype
            tolerance = TOLERANCE.get(dtype, DEFAULT_TOLERANCE)
            if gap > tolerance * scale:
                raise RuntimeError(OUTSIDE_USE.format(name=self._names.get(id(param), str(tuple(param.shape)))))

    def forget(self, task: int) -> None:
        """Drop the totals of a finished pass that were not compared."""
        with self._lock:
            for key in [k for k in self._totals if k[0] == task]:
                del self._totals[key]


def _checked_stats(pairs: List[Tuple[torch.Tensor, torch.Tensor]], undo_mean: bool) -> List[Tuple[float, float]]:
    """``(max |G|, max |Σ_i g_i − G|)`` of each ``(G, per-sample gradients g)``: totals of at most
    ``JOINED_CHECK_ELEMENTS`` entries of a device (CPU, CUDA) and batch together, in groups of at most
    :data:`JOINED_PER_SAMPLE_ELEMENTS` per-sample entries (:func:`_joined_stats`: a few operations
    for many small tensors, a bounded copy), the others one by one; one transfer per device."""
    stats: List[Tuple[int, torch.Tensor]] = []
    groups: List[List[int]] = []
    sizes: List[int] = []  # per-sample entries of each group
    filling: Dict[tuple, int] = {}  # (device, batch): the group it fills
    for i, (total, grad_sample) in enumerate(pairs):
        if total.numel() > JOINED_CHECK_ELEMENTS or total.device.type not in SEGMENT_DEVICES:
            stats.append((i, _stats(total, _summed(grad_sample, undo_mean))))
            continue
        key = (total.device, grad_sample.shape[0])
        g = filling.get(key)
        if g is None or sizes[g] + grad_sample.numel() > JOINED_PER_SAMPLE_ELEMENTS:
            g = filling[key] = len(groups)
            groups.append([])
            sizes.append(0)
        groups[g].append(i)
        sizes[g] += grad_sample.numel()
    for indices in groups:
        rows = _joined_stats([pairs[i] for i in indices], undo_mean)
        stats.extend(zip(indices, rows.unbind(0)))
    return _transferred(stats, len(pairs))


def _peaks_and_gaps(pairs: List[Tuple[torch.Tensor, torch.Tensor]]) -> List[Tuple[float, float]]:
    """``(max |G|, max |Σ_i g_i − G|)`` of each ``(G, Σ_i g_i)``, in float32, one transfer per
    device. Both are finite exactly when both sides are (a NaN or inf on either side reaches the
    gap), so no separate finiteness pass reads the tensors."""
    return _transferred([(i, _stats(total, expected)) for i, (total, expected) in enumerate(pairs)], len(pairs))


def _stats(total: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    total = total.to(torch.float32)
    return torch.stack([largest_magnitude(total), largest_magnitude(expected - total)])


def _joined_stats(pairs: List[Tuple[torch.Tensor, torch.Tensor]], undo_mean: bool) -> torch.Tensor:
    """``(P, 2)`` stats of ``P`` pairs ``(G, g)`` of one device and batch ``B``: the totals joined
    into one vector and the per-sample gradients into one ``(B, Σ n)`` matrix summed over ``B``
    (float32), each tensor's largest magnitudes taken by segment (a NaN stays in its segment)."""
    batch = pairs[0][1].shape[0]
    total = torch.cat([t.reshape(-1) for t, _ in pairs]).to(torch.float32)
    expected = torch.cat([g.reshape(batch, -1) for _, g in pairs], dim=1).sum(dim=0, dtype=torch.float32)
    if undo_mean:
        expected = expected / batch
    lengths = torch.tensor([t.numel() for t, _ in pairs], device=total.device)
    return torch.stack([torch.segment_reduce(total.abs(), "max", lengths=lengths),
                        torch.segment_reduce((expected - total).abs(), "max", lengths=lengths)], dim=1)


def _transferred(stats: List[Tuple[int, torch.Tensor]], count: int) -> List[Tuple[float, float]]:
    """The ``(peak, gap)`` pairs of ``stats`` (index, 2-element tensor) as floats, in index order,
    one transfer per device."""
    by_device: Dict[torch.device, List[Tuple[int, torch.Tensor]]] = {}
    for i, pair in stats:
        by_device.setdefault(pair.device, []).append((i, pair))
    found: List[Tuple[float, float]] = [(0.0, 0.0)] * count
    for entries in by_device.values():
        for (i, _), (peak, gap) in zip(entries, torch.stack([s for _, s in entries]).tolist()):
            found[i] = (peak, gap)
    return found


def _summed(grad_sample: torch.Tensor, undo_mean: bool) -> torch.Tensor:
    """``Σ_i g_i`` (over ``B`` where the hooks undid the mean's ``1/B``), in float32. A float32
    tensor is summed as the product ``1ᵀ g`` (rows read once at memory speed; a reduction over
    the outer dimension took about twice as long on CPU)."""
    if grad_sample.dtype == torch.float32 and grad_sample.dim() > 1:
        rows = grad_sample.reshape(grad_sample.shape[0], -1)
        total = torch.mv(rows.t(), rows.new_ones(rows.shape[0])).view(grad_sample.shape[1:])
    else:
        total = grad_sample.sum(dim=0, dtype=torch.float32)
    return total / grad_sample.shape[0] if undo_mean else total
