"""Model-level checks of a private forward pass: samples do not mix, buffers are not written.

DP-SGD bounds one sample's influence by clipping its own gradient ``g_i``. That bound holds only
if sample ``i``'s loss depends on no other sample. A per-layer hook sees a layer's inputs, which
may already be mixed by code between layers (``h = h - h.mean(0)`` in a ``forward``, no parameter
there to hook): every layer then gets "per-sample" gradients that carry the other samples, and
one added sample moves the clipped sum by more than ``C``. A buffer written from the batch in the
forward (a running mean) is released by ``state_dict()`` without noise.

**Samples (once).** On the model's first recorded forward in training mode with a batch of
``B >= 2`` samples, before that forward runs, the model is run without autograd graph on the whole
batch, ``Y = f(x)``, and on samples ``0`` and ``B - 1`` alone, ``y_i = f(x_i)``; every
floating-point output with the batch on the wrapper's batch dimension must satisfy::

    max|Y_i - y_i|  <=  rtol * max(max|Y_i|, max|y_i|),   rtol = max(1.6e-4, 16 eps)

with ``eps`` that of the precision really used (TF32, bf16: as the layer check of
:mod:`~opacus_dp.grad_sample.sample_independence`, whose ``max(1e-5, 8 eps)`` a whole model
exceeds by reordering more float reductions). A batch mean moves outputs by their own order, far
above this in float32; in bfloat16 (``rtol = 0.125``) a weak mixing can pass: check in float32.
On a mismatch the module that mixes is found by recording every submodule's calls: the deepest
one whose batched inputs agree with the single sample's while its outputs do not (the model
itself when the mixing happens in its own ``forward``, between submodules).

Randomness: ``nn.Dropout*`` modules are switched to eval for the check (``model.eval()`` would also
change other layers), and every run starts from the same RNG state, forked and restored
(``torch.random.fork_rng``, CPU and the CUDA devices in use): the training run draws the same
random numbers as without the check. Sample 0 is first run alone from two RNG states; if its
outputs differ, the model has randomness of its own (functional dropout, attention dropout) and
the check runs with every module in eval mode (a model random even then is not checked).

State: the check makes no autograd graph (so the wrapper's capture hooks record nothing), and
every buffer is restored (values and identity) after each run. Attributes that are not buffers
(counters) are not restored. Not checked (silently): inputs that cannot be cut into samples (a
tensor whose size on the batch dimension is neither ``B`` nor 1, a ``PackedSequence``, a model
with ``nn.EmbeddingBag``, whose bags are cut by offsets), a forward that fails on one sample
(other than a refusal), models sharded with FSDP2 (:mod:`~opacus_dp.grad_sample.model_checks`).
``B < 2`` waits for a larger batch.
Layout: the model's own ``batch_first`` attribute if it has one, else the wrapper's; a model with
a module whose ``batch_first`` differs from that (a DP RNN keeps its own layout) is tried in both
layouts and refused only if no layout that can be compared agrees.

**Buffers (every recorded forward).** The version counter and identity of every buffer are noted
before the forward and compared after it; a buffer written or replaced (or a new one) is refused,
naming the module and the buffer, unless the user declared it public (``public_buffers``;
:mod:`~opacus_dp.grad_sample.buffer_writes`). A buffer written by the check's batched run is
refused the same way, before any output is compared (the more precise diagnosis).

Cost: one forward of the batch without autograd graph plus four of one sample, once (six for a
model with randomness outside ``nn.Dropout*`` modules); the buffer check reads one integer per
buffer per forward. ``check_sample_independence=False`` (wrapper, ``make_private``, classic
engine) turns both checks off.
"""

from contextlib import contextmanager
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch.nn.modules.dropout import _DropoutNd
from torch.nn.utils.rnn import PackedSequence

from opacus_dp.errors import UnsupportedModuleError
from opacus_dp.grad_sample.buffer_writes import BufferWrittenError, buffer_error, versions, written_buffers  # noqa: F401
from opacus_dp.grad_sample.sample_independence import relative_gap, tolerance
from opacus_dp.grad_sample.support import describe

OPT_OUT = ("pass check_sample_independence=False to make_private (or the wrapper) only if you know "
           "the outputs differ for another reason")


class ModelMixesSamplesError(UnsupportedModuleError):
    """A sample run alone gives other outputs than its row of the batched run."""


class _Uncuttable(Exception):
    """The inputs cannot be cut into samples."""


def _map(obj, fn):
    """``obj`` with every tensor ``t`` replaced by ``fn(t)`` (tuples, lists, mappings)."""
    if isinstance(obj, PackedSequence):
        raise _Uncuttable
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_map(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(v, fn) for v in obj)
    if isinstance(obj, Mapping):
        items = {k: _map(v, fn) for k, v in obj.items()}
        try:
            return type(obj)(items)
        except Exception:  # noqa: BLE001 - a mapping type without a dict constructor
            return items
    return obj


def leaves(obj) -> List[torch.Tensor]:
    """The tensors of ``obj`` in order (tuples, lists, mappings, ``ModelOutput``)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):  # a PackedSequence too: its tensors
        return [t for item in obj for t in leaves(item)]
    return []


def batch_size_of(args, kwargs, batch_dim: int) -> Optional[int]:
    """``B``: the size on ``batch_dim`` of the first input tensor that has that dimension."""
    return next((t.shape[batch_dim] for t in leaves((args, kwargs)) if t.dim() > batch_dim), None)


def one_sample(args, kwargs, batch_dim: int, size: int, index: int):
    """``(args, kwargs)`` of sample ``index`` alone (a batch of one); tensors of size 1 on the
    batch dimension (broadcast) and without it are kept; raises ``_Uncuttable`` otherwise."""
    def cut(t: torch.Tensor) -> torch.Tensor:
        if t.dim() <= batch_dim or t.shape[batch_dim] == 1:
            return t
        if t.shape[batch_dim] != size:
            raise _Uncuttable
        return t.narrow(batch_dim, index, 1)

    return _map(args, cut), _map(kwargs, cut)


def row_gap(full: torch.Tensor, single: torch.Tensor, batch_dim: int, size: int, index: int) -> Optional[float]:
    """Relative gap of ``full``'s row ``index`` and ``single`` (None: not comparable)."""
    if not (full.is_floating_point() and single.is_floating_point()) or full.dim() != single.dim():
        return None
    if full.dim() <= batch_dim or full.shape[batch_dim] != size or single.shape[batch_dim] != 1:
        return None
    if any(a != b for d, (a, b) in enumerate(zip(full.shape, single.shape)) if d != batch_dim):
        return None
    return relative_gap(full.narrow(batch_dim, index, 1), single)


def model_tolerance(t: torch.Tensor) -> float:
    """``max(1.6e-4, 16 eps)``: twice the layer check's ``max(1e-5, 8 eps)``, at least 16 times."""
    return max(1.6e-4, 2 * tolerance(t.dtype, t.device))


def worst_gap(full, single, batch_dim: int, size: int, index: int) -> Tuple[float, float, int]:
    """``(gap, limit, slot)`` of the comparable floating tensor furthest beyond its tolerance
    (slot -1: none comparable)."""
    worst = (-1.0, 1.0, -1)
    for slot, (a, b) in enumerate(zip(leaves(full), leaves(single))):
        gap = row_gap(a, b, batch_dim, size, index)
        if gap is not None and gap / model_tolerance(a) > worst[0] / worst[1]:
            worst = (gap, model_tolerance(a), slot)
    return worst


def _cuda_devices(model: nn.Module, inputs) -> List[int]:
    tensors = list(model.parameters()) + list(model.buffers()) + leaves(inputs)
    return sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})


@contextmanager
def _training_flags(model: nn.Module, switch_off: Callable[[nn.Module], bool]):
    """Modules for which ``switch_off`` holds get ``training=False`` (only the flag), restored."""
    saved = [(m, m.training) for m in model.modules()]
    try:
        for m, _ in saved:
            if switch_off(m):
                m.training = False
        yield
    finally:
        for m, flag in saved:
            m.training = flag


@contextmanager
def _buffers_restored(model: nn.Module):
    """Buffers (identity and values) as before, new ones removed, when the block ends."""
    saved = [(m, dict(m._buffers)) for m in model.modules()]
    values = {id(b): b.detach().clone() for _, bufs in saved for b in bufs.values() if b is not None}
    try:
        yield
    finally:
        with torch.no_grad():
            for m, bufs in saved:
                m._buffers.clear()
                m._buffers.update(bufs)
                for b in bufs.values():
                    if b is not None and not torch.equal(b, values[id(b)]):
                        b.copy_(values[id(b)])


class _Runs:
    """Forward runs of ``model`` without autograd graph, each from the same (forked) RNG state."""

    def __init__(self, model: nn.Module, args, kwargs, batch_dim: int, size: int, public_buffers=()):
        self.model, self.args, self.kwargs = model, args, kwargs
        self.batch_dim, self.size, self.public_buffers = batch_dim, size, public_buffers
        self.devices = _cuda_devices(model, (args, kwargs))

    def run(self, index: Optional[int] = None, reseed: bool = False, record=None):
        """Outputs of the batch (``index`` None) or of sample ``index`` alone, from the buffers and
        RNG state of the real forward (restored after); ``reseed``: start from another RNG state;
        ``record``: a dict filled with every submodule's calls. A buffer written by the batched
        run is refused here (:class:`BufferWrittenError`), before outputs are compared."""
        args, kwargs = (self.args, self.kwargs) if index is None else \
            one_sample(self.args, self.kwargs, self.batch_dim, self.size, index)
        handles = [] if record is None else _recorders(self.model, record)
        try:
            with _buffers_restored(self.model), torch.random.fork_rng(devices=self.devices), torch.no_grad():
                if reseed:
                    torch.rand(1)
                    for device in self.devices:
                        torch.rand(1, device=torch.device("cuda", device))
                before = versions(self.model)
                output = self.model.forward(*args, **kwargs)
                written = written_buffers(self.model, before, self.public_buffers)
                if written and index is None:
                    raise buffer_error(self.model, written[0])
                return output
        finally:
            for handle in handles:
                handle.remove()


def _recorders(model: nn.Module, record: Dict[str, list]) -> list:
    def recorder(path):
        def hook(module, args, kwargs, output):
            record.setdefault(path, []).append((leaves((args, kwargs)), leaves(output)))
        return hook

    return [m.register_forward_hook(recorder(path), with_kwargs=True)
            for path, m in model.named_modules() if m is not model]


def _differs(full: Sequence[torch.Tensor], single: Sequence[torch.Tensor], runs: _Runs, index: int) -> bool:
    gaps = [(row_gap(a, b, runs.batch_dim, runs.size, index), a) for a, b in zip(full, single)]
    return any(gap is not None and gap > model_tolerance(a) for gap, a in gaps)


def culprit(runs: _Runs, index: int) -> str:
    """Path of the deepest submodule whose inputs agree (batched row ``index`` and alone) while its
    outputs do not; ``""`` (the model) if none: the mixing is in the model's own code."""
    full, single = {}, {}
    runs.run(None, record=full)
    runs.run(index, record=single)
    found = []
    for path, calls in full.items():
        for (f_in, f_out), (s_in, s_out) in zip(calls, single.get(path, [])):
            if not _differs(f_in, s_in, runs, index) and _differs(f_out, s_out, runs, index):
                found.append(path)
                break
    deepest = [p for p in found if not any(q.startswith(p + ".") for q in found if q != p)]
    return deepest[0] if deepest else ""


def check_samples_alone(model: nn.Module, args, kwargs, batch_dim: int, public_buffers=()) -> None:
    """Raise :class:`ModelMixesSamplesError` if samples ``0`` and ``B - 1`` run alone give other
    outputs than their rows of the batched run, :class:`BufferWrittenError` if the batched run
    writes a buffer not in ``public_buffers`` (module doc); model state is left as it was."""
    if any(isinstance(m, nn.EmbeddingBag) for m in model.modules()):
        return  # bags are cut by offsets, not rows: slicing would give out-of-range offsets
    results = [_mixing(model, args, kwargs, dim, public_buffers) for dim in layouts(model, batch_dim)]
    mixed = [r for r in results if r]
    if mixed and False not in results:
        _refuse(model, *mixed[0])


def layouts(model: nn.Module, batch_dim: int) -> List[int]:
    """Batch dimensions the inputs may have: the model's own ``batch_first`` if it has one, else
    the wrapper's, and also the other one if a module's ``batch_first`` differs from it (a DP RNN
    keeps its own layout whatever the wrapper's is)."""
    own = getattr(model, "batch_first", None)
    if isinstance(own, bool):
        return [0 if own else 1]
    flags = {m.batch_first for m in model.modules() if isinstance(getattr(m, "batch_first", None), bool)}
    return [batch_dim, 1 - batch_dim] if flags - {batch_dim == 0} else [batch_dim]


def _mixing(model: nn.Module, args, kwargs, batch_dim: int, public_buffers):
    """``(runs, mismatch)`` if samples run alone differ from their batched rows, False if they
    agree, None if this layout cannot be checked (no cut, no comparable output, random)."""
    size = batch_size_of(args, kwargs, batch_dim)
    if size is None or size < 2:
        return None
    try:
        one_sample(args, kwargs, batch_dim, size, 0)
    except _Uncuttable:
        return None
    runs = _Runs(model, args, kwargs, batch_dim, size, public_buffers)
    switch_off = _deterministic_flags(runs)
    if switch_off is None:
        return None
    found = _first_mismatch(runs, switch_off)
    return (runs, found) if found else found


def _deterministic_flags(runs: _Runs) -> Optional[Callable[[nn.Module], bool]]:
    """Which modules to switch to eval for runs that do not depend on the RNG state: the
    ``nn.Dropout*`` ones, or all if sample 0 alone still changes with it; None if even then (or
    if the model fails on one sample)."""
    for switch_off in (lambda m: isinstance(m, _DropoutNd)), (lambda m: True):
        try:
            if not _random(runs, 0, switch_off):
                return switch_off
        except UnsupportedModuleError:
            raise
        except Exception:  # noqa: BLE001 - a model that cannot run one sample alone: not checked
            return None
    return None


def _first_mismatch(runs: _Runs, switch_off):
    """``(index, (gap, limit, slot), context)`` of the first sample that differs, False if all
    agree, None if no output could be compared or the model failed on one sample."""
    context = lambda: _training_flags(runs.model, switch_off)  # noqa: E731
    compared = False
    with context():
        try:
            full = runs.run()
            for index in (0, runs.size - 1):
                gap, limit, slot = worst_gap(full, runs.run(index), runs.batch_dim, runs.size, index)
                compared = compared or slot >= 0
                if gap > limit:
                    return index, (gap, limit, slot), context
        except UnsupportedModuleError:
            raise
        except Exception:  # noqa: BLE001 - a model that cannot run one sample alone: not checked
            return None
    return False if compared else None


def _random(runs: _Runs, index: int, switch_off) -> bool:
    """Whether sample ``index`` alone gives other outputs from another RNG state."""
    with _training_flags(runs.model, switch_off):
        first, again = runs.run(index), runs.run(index, reseed=True)
    gap, limit, _ = worst_gap(first, again, runs.batch_dim, 1, 0)
    return gap > limit


def _refuse(model: nn.Module, runs: _Runs, found) -> None:
    index, (gap, limit, slot), context = found
    with context():
        path = culprit(runs, index)
    where = describe(path, model.get_submodule(path)) if path else \
        f"{describe('', model)} (its own forward, between its submodules)"
    what = "layer" if path else "forward"
    raise ModelMixesSamplesError(
        f"{where}: the model's outputs depend on other samples of the batch (sample {index} run alone "
        f"differs from its row of the batched run in tensor output #{slot} by {gap:.2g} x its largest "
        f"magnitude, above the tolerance {limit:.1g}), so clipping each sample's gradient does not "
        f"bound its influence and the privacy guarantee would not hold. Make the {what} per-sample "
        f"(statistics over each sample's own dimensions, not over the batch dimension), or "
        f"{OPT_OUT}")
