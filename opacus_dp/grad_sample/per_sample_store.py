"""Side table ``param -> per-sample gradient`` with backward-pass grouping.

Accumulation rule (documented behaviour of ``GradSampleModule``):

* Within ONE backward pass (one ``loss.backward()`` / ``torch.autograd.grad`` call) the
  per-sample gradients of every call of every layer sharing a parameter are **summed**:
  a layer applied in a loop, RNN cells called per time step, tied weights, or two forward
  passes whose losses are added before one backward. All these calls must have the same
  batch size ``B``; otherwise a ``ValueError`` names the layer and both sizes.
* Each further backward pass (with new activations of a new batch) **concatenates** its
  result along dimension 0, so ``k`` forward/backward pairs of batches
  ``B_1..B_k`` give ``grad_sample`` of shape ``(B_1 + ... + B_k, *p.shape)``
  (virtual steps / gradient accumulation) until the state is cleared.

The end of a backward pass is detected with an autograd engine callback queued by the
first hook of that pass. ``p.grad_sample`` mirrors the table; if a consumer replaces or
clears ``p.grad_sample`` itself, the table adopts that value. What a step leaves there (kept
and marked consumed, or removed) follows the generation's lifecycle
(:mod:`opacus_dp.state_views`): a consumed gradient is never taken again, and the next
backward pass replaces it.
"""

import threading
from typing import Dict, Optional, Set, Tuple

import torch

from opacus_dp.grad_sample.broadcast_inputs import BROADCAST_HINT
from opacus_dp.grad_sample.outside_use_totals import OutsideUseTotals
from opacus_dp.state_views import (OPACUS_1X, StateViews, is_consumed, mark_consumed, mark_passes,
                                   passes_of)
from opacus_dp.torch_internals import current_graph_task_id, queue_end_of_backward_callback

_UNSET = object()


class _Pass:
    """Per-sample gradients summed during one backward pass (one autograd graph task)."""

    def __init__(self):
        # param -> {chunk: summed per-sample gradient}; chunk = nn.DataParallel replica
        # (see opacus_dp.distributed.data_parallel), 0 without replicas.
        self.sums: Dict[torch.Tensor, Dict[int, torch.Tensor]] = {}
        self.batch_size: Dict[int, int] = {}
        self.first_layer: Dict[int, str] = {}
        self.owned: Set[Tuple[int, int]] = set()  # (id(param), chunk): sums this pass allocated
        self.empty_batch = False  # a pass over an empty batch (no sums, still a batch)

    def accumulate(self, param: torch.Tensor, chunk: int, grad_sample: torch.Tensor) -> None:
        """``sums[param][chunk] += grad_sample``: in place once the sum is the pass's own tensor
        (a sampler's result may alias autograd's tensors; a layer called at every time step
        would otherwise allocate a new per-sample gradient per call)."""
        by_chunk = self.sums.setdefault(param, {})
        previous = by_chunk.get(chunk)
        key = (id(param), chunk)
        if previous is None:
            by_chunk[chunk] = grad_sample
        elif key in self.owned and previous.dtype == torch.result_type(previous, grad_sample) \
                and previous.shape == grad_sample.shape:
            previous.add_(grad_sample)
        else:
            by_chunk[chunk] = previous + grad_sample
            self.owned.add(key)

    def concatenated(self, param: torch.Tensor, undo_mean: bool) -> torch.Tensor:
        """The pass's per-sample gradient of ``param``: the chunks in batch (index) order.

        With ``undo_mean``, chunk ``j`` (``B_j`` rows) was scaled by ``B_j`` to undo the
        loss's mean, but the mean ran over all ``B = Σ_j B_j`` rows: it is rescaled by ``B/B_j``.
        """
        chunks = self.sums[param]
        if len(chunks) == 1:
            return next(iter(chunks.values()))
        ordered = [chunks[c] for c in sorted(chunks)]
        if undo_mean:
            total = sum(g.shape[0] for g in ordered)
            ordered = [g * (total / g.shape[0]) for g in ordered]
        return torch.cat(ordered, dim=0)


def second_batch_error() -> ValueError:
    """A backward pass came while another batch's per-sample state waits for its step."""
    return ValueError(
        "A second batch (a backward pass, over an empty batch too) came before the previous "
        "one was consumed, which this configuration forbids (Poisson sampling: two batches in "
        "one step would be recorded as one): call optimizer.step() and optimizer.zero_grad() "
        "after every batch, or use BatchMemoryManager for large logical batches."
    )


class PerSampleGradStore:
    """Holds per-sample gradients keyed by (master) parameter; see module docstring."""

    def __init__(self, batch_first: bool, loss_reduction: str = "mean"):
        self._batch_first = batch_first
        self._undo_mean = loss_reduction == "mean"
        self._done: Dict[torch.Tensor, torch.Tensor] = {}
        self._passes: Dict[int, _Pass] = {}
        self._touched: Dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()
        self.accumulation_allowed = True
        self.passes = 0  # backward passes that added per-sample gradients since the last pop/clear
        self.other_batches = lambda: 0  # batches held elsewhere (the bk mode's passes)
        self.counted_elsewhere = lambda task: False  # a graph task whose pass is held elsewhere
        self.views: StateViews = OPACUS_1X
        self.totals: Optional[OutsideUseTotals] = None  # per-pass totals to compare (outside uses)

    def show_absent(self, params) -> None:
        """Show ``params``' per-sample gradients as absent now (1.x: ``p.grad_sample = None``)."""
        with self._lock:
            for param in params:
                self._publish(param, None)

    # ----------------------------------------------------------------- adding
    def add(self, param: torch.Tensor, grad_sample: torch.Tensor, layer: str, chunk: int = 0,
            task: int = -1) -> None:
        """Add one call's per-sample gradient of ``param`` to the current backward pass (or to
        the pass of graph task ``task``, opened by :meth:`open_pass`).

        ``chunk`` is the index of the ``nn.DataParallel`` replica (batch chunk) that made
        the call; chunks are kept apart and concatenated in index order when the pass ends.
        """
        if task == -1:
            task = current_graph_task_id()
        if task == -1:
            raise RuntimeError("per-sample gradients can only be added during a backward pass")
        with self._lock:
            current = self._pass_of(task)
            self._check_batch_size(current, grad_sample.shape[0], layer, task, chunk)
            current.accumulate(param, chunk, grad_sample)

    def open_pass(self, task: int) -> None:
        """Open the pass of the running graph task ``task`` now (a layer called during it, by a
        reentrant checkpoint's recomputation, adds to it from a nested backward pass)."""
        with self._lock:
            self._pass_of(task)

    def _pass_of(self, task: int) -> _Pass:
        """The pass of ``task``, opened (and closed at the task's end) if needed; call it while
        ``task`` runs."""
        current = self._passes.get(task)
        if current is None:
            current = self._passes[task] = _Pass()
            queue_end_of_backward_callback(lambda: self._close_pass(task))
        return current

    def add_empty(self, param: torch.Tensor) -> None:
        """Make ``param.grad_sample`` exist with 0 rows (a forward pass on an empty batch)."""
        with self._lock:
            if self._synced(param) is None:
                # torch.zeros, not param.new_zeros: an FSDP2 parameter (DTensor) would give a
                # sharded DTensor, whereas per-sample gradients are plain tensors of the full shape
                self._publish(param, torch.zeros((0, *param.shape), dtype=param.dtype, device=param.device))

    def mark_empty_pass(self) -> None:
        """The running backward pass is over an empty batch: it counts as a pass (a batch)."""
        task = current_graph_task_id()
        if task != -1:
            with self._lock:
                self._pass_of(task).empty_batch = True

    def _refuse_second_batch(self) -> None:
        """Raise if a batch is held already and accumulation is forbidden (Poisson batches)."""
        if not self.accumulation_allowed and self.passes + self.other_batches():
            raise second_batch_error()

    def _check_batch_size(self, current: _Pass, size: int, layer: str, task: int, chunk: int) -> None:
        if chunk not in current.batch_size:
            current.batch_size[chunk], current.first_layer[chunk] = size, layer
            return
        if current.batch_size[chunk] != size:
            del self._passes[task]
            raise ValueError(
                f"Inconsistent batch sizes in one forward/backward pass: layer {layer} has "
                f"batch size {size} but layer {current.first_layer[chunk]} has "
                f"{current.batch_size[chunk]}. "
                f"The batch dimension is probably wrong: this GradSampleModule uses "
                f"batch_first={self._batch_first}; check that every layer with parameters "
                f"receives inputs with the batch on that dimension (sequence-first models "
                f"need batch_first=False)." + BROADCAST_HINT
            )

    def _close_pass(self, task: int) -> None:
        with self._lock:
            finished = self._passes.pop(task, None)
            try:
                self._finish(task, finished)
            finally:
                if self.totals is not None:
                    self.totals.forget(task)

    def _finish(self, task: int, finished: Optional[_Pass]) -> None:
        """Add a finished pass's per-sample gradients (checked against the totals, if watched)."""
        if finished is None or not (finished.sums or finished.empty_batch):
            return
        if not finished.sums and self.counted_elsewhere(task):
            return  # a layer called on no rows within a batch that is counted already
        self._refuse_second_batch()
        grads = {param: finished.concatenated(param, self._undo_mean) for param in finished.sums}
        if self.totals is not None:
            self.totals.check(task, grads, self._undo_mean)
        for param, grad_sample in grads.items():
            self._append(param, grad_sample)
        self.passes += 1

    def _append(self, param: torch.Tensor, grad_sample: torch.Tensor) -> None:
        previous = self._synced(param)
        passes = 1 if previous is None else passes_of(previous) + 1
        if previous is not None and previous.shape[0] > 0:
            grad_sample = torch.cat([previous, grad_sample], dim=0)
        mark_passes(grad_sample, passes)  # read by a DPOptimizer not connected to this module
        self._publish(param, grad_sample)

    # --------------------------------------------------------- compatibility view
    def _publish(self, param: torch.Tensor, grad_sample: Optional[torch.Tensor]) -> None:
        self._touched[id(param)] = param
        if grad_sample is None:
            self._done.pop(param, None)
        else:
            self._done[param] = grad_sample
        self.views.show(param, "grad_sample", grad_sample)

    def _synced(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """Current per-sample gradient, adopting any value set on ``param.grad_sample`` (a
        deleted attribute is None); a gradient a step consumed counts as none."""
        view = param.__dict__.get("grad_sample", _UNSET)
        if view is _UNSET and id(param) in self._touched:
            view = None
        stored = self._done.get(param)
        if view is not _UNSET and view is not stored:
            stored = view if isinstance(view, torch.Tensor) else None
        if stored is None or is_consumed(stored):
            self._done.pop(param, None)
            return None
        self._done[param] = stored
        return stored

    # ---------------------------------------------------------------- reading
    def get(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """Per-sample gradient of ``param`` accumulated so far, or None."""
        with self._lock:
            return self._synced(param)

    def pop_all(self) -> Dict[torch.Tensor, torch.Tensor]:
        """All per-sample gradients, marked consumed; ``p.grad_sample`` keeps them (1.x) or is
        cleared (0.x), and the table forgets them."""
        with self._lock:
            result = {}
            for param in list(self._touched.values()):
                grad_sample = self._synced(param)
                self._done.pop(param, None)
                if grad_sample is None or not self.views.keeps_after_step:
                    self.views.hide(param, "grad_sample")
                if grad_sample is not None:
                    mark_consumed(grad_sample)
                    result[param] = grad_sample
            self.passes = 0
            return result

    def clear(self) -> None:
        """Drop all per-sample state (``p.grad_sample`` becomes None)."""
        with self._lock:
            self._passes.clear()
            self.passes = 0
            for param in list(self._touched.values()):
                self._publish(param, None)

    def remove_views(self) -> None:
        """Clear everything and delete the ``grad_sample`` attributes that were added."""
        self.clear()
        with self._lock:
            for param in self._touched.values():
                param.__dict__.pop("grad_sample", None)
            self._touched.clear()
