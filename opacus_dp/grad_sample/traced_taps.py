"""Hooked layers inside the graphs ``torch.compile`` builds: traced taps (``docs/compile.md``).

Eagerly, a hooked layer's forward hook keeps the call's inputs and hooks its output's gradient
(:mod:`~opacus_dp.grad_sample.grad_sample_module`). Neither can happen inside a compiled graph,
whose tensors exist only while it runs: run outside it, each hook is a graph break, and dynamo
runs a function with a graph break inside a loop (``nn.Sequential``, a model's layer loop)
eagerly as a whole. Traced taps keep the hooked calls in the graph:

* before the wrapper's compiled forward runs, the wrapper makes one *tap* ``t`` per hooked call:
  a zero of the call's output shape that requires grad (a stride-0 view of one zero: no memory);
* dynamo traces the hook as ``y + t``, and the call's inputs leave the graph as its outputs
  (copies, as the call used them: code after the call may change them in place).
  ``∂L/∂t = ∂L/∂y``: the compiled backward gives each call's output gradient to autograd as its
  tap's gradient;
* after the compiled forward, the wrapper records each call as its eager hook does, from the
  graph's outputs, the tap standing in for the output; the tap's gradient hook then does what
  the output's does eagerly.
  Where the layers' weight gradients are skipped (``skip_weight_grads``), the traced hook computes
  ``y`` again from detached parameters (:mod:`~opacus_dp.grad_sample.detached_forwards`), which is
  what switching the parameters off does eagerly.

The taps need the calls' output shapes before the graph runs. The first forward of each input
signature (:func:`input_signature`: the inputs' shapes but their batch size, dtypes, devices, the
other arguments) runs eagerly and learns them (:class:`CallLayout`); later forwards of the
signature substitute their batch size. A layer called on one sample broadcast over the batch
(:mod:`~opacus_dp.grad_sample.broadcast_inputs`) is expanded to its tap's batch size by its traced
pre-hook (:meth:`TracedTaps.traced_pre_hook`), as the eager pre-hook expands it. A signature with a
call that cannot be tapped (a ``DataParallel`` replica's call, several outputs, a layer without a
detached forward where weight gradients are skipped) keeps the hooks outside the graph, as before;
so do the signatures past :data:`MAX_SIGNATURES`. A traced call that does not match its layout (an
output shape that depends on more than the batch size) falls back to the eager hook.
"""

import itertools
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from opacus_dp.grad_sample.detached_forwards import detached_forward
from opacus_dp.module_parameters import has_trainable_parameters
from opacus_dp.torch_internals import current_graph_task_id

LEARN, TAPPED, UNTAPPED, IDLE = "learn", "tapped", "untapped", "idle"
MAX_SIGNATURES = 8
_SCALARS = (bool, int, float, str, type(None))

_RUNNING: Dict[int, Dict[str, List[torch.Tensor]]] = {}
"""The taps of each wrapper's running forward, by :class:`TracedTaps` key. Read by the traced
hooks from this global, not from the hooks' own state: dynamo takes a tensor reached through a
module's hooks for a module property, of static shape, and would compile the model again for
each batch size; a tensor read from a global gets a dynamic batch dimension when the inputs' does."""
_KEYS = itertools.count()


@dataclass(frozen=True)
class CallLayout:
    """One hooked call of a learned forward: the layer's path, its output's shape, batch
    dimension, dtype and device."""

    path: str
    shape: Tuple[int, ...]
    batch_dim: int
    dtype: torch.dtype
    device: torch.device

    def tap(self, batch_size: int, zeros: Dict[tuple, torch.Tensor]) -> torch.Tensor:
        """A zero of the output's shape for ``batch_size`` samples (a view of one zero) that
        requires grad (:class:`_Tap`)."""
        shape = list(self.shape)
        shape[self.batch_dim] = batch_size
        key = (self.dtype, self.device)
        if key not in zeros:
            zeros[key] = torch.zeros((), dtype=self.dtype, device=self.device)
        return _Tap.apply(_ANCHOR, zeros[key], tuple(shape))


_ANCHOR = torch.zeros((), requires_grad=True)


class _Tap(torch.autograd.Function):
    """``zero`` expanded to ``shape``, requiring grad through ``anchor``; its backward passes
    nothing on. A leaf would do as well, but autograd would copy each tap's gradient into the
    leaf's layout and keep it as ``.grad``."""

    @staticmethod
    def forward(ctx, anchor, zero, shape):
        return zero.expand(shape)

    @staticmethod
    def backward(ctx, grad):
        return None, None, None


def input_signature(args, kwargs, batch_dim: int) -> Tuple[tuple, Optional[int]]:
    """``(signature, batch size)`` of a forward's arguments: each tensor's shape with its batch
    dimension left out, dtype, device and ``requires_grad``; other scalars by value, other objects
    by type. The batch size is the first tensor's size on ``batch_dim`` (None without one)."""
    leaves, spec = tree_flatten((args, kwargs))
    parts: List[Any] = [str(spec)]
    batch = None
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            shape = list(leaf.shape)
            if leaf.dim() > batch_dim:
                batch = shape[batch_dim] if batch is None else batch
                shape[batch_dim] = None
            parts.append((tuple(shape), leaf.dtype, leaf.device, leaf.requires_grad))
        else:
            parts.append(leaf if isinstance(leaf, _SCALARS) else type(leaf))
    return tuple(parts), batch


def _values(args) -> tuple:
    """``args`` with each tensor copied (:func:`_value`); other arguments as they are."""
    return tuple(_value(a) if isinstance(a, torch.Tensor) else a for a in args)


def _value(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor``: the values the call used, which code after it in the graph may
    change in place (eagerly, the hooks refuse that; here the graph keeps both). A dimension
    broadcast by a stride of 0 (a call on one sample expanded to the batch) stays broadcast: one
    row is copied and expanded again, as the eager hook keeps the expanded view, not ``B`` copies.
    Detached: no gradient flows to a recorded value, and AOT autograd would otherwise hand the
    compiled backward a zero-filled gradient for each (one per differentiable graph output)."""
    tensor = tensor.detach()
    broadcast = [d for d in range(tensor.dim()) if tensor.stride(d) == 0 and tensor.shape[d] != 1]
    if not broadcast:
        return tensor.clone()
    row = tensor
    for dim in broadcast:
        row = row.narrow(dim, 0, 1)
    return row.clone().expand(tensor.shape)


class TracedTaps:
    """The traced taps of one wrapper (module doc). Holds no reference to the wrapper."""

    def __init__(self, batch_first: bool, skips_weight_grads: bool, enabled: bool = True):
        self.batch_dim = 0 if batch_first else 1
        self.skips_weight_grads = skips_weight_grads  # the graph computes tapped calls from detached parameters
        self.enabled = enabled  # False: every forward keeps its hooks outside the graph
        self.layouts: Dict[tuple, Optional[Tuple[CallLayout, ...]]] = {}
        self.forwards: Dict[str, Callable] = {}  # detached forwards, by layer path
        self.layers: Dict[str, nn.Module] = {}  # the hooked layers, by path (traced_hook)
        self._key = next(_KEYS)
        weakref.finalize(self, _RUNNING.pop, self._key, None)
        self.used: Dict[str, int] = {}  # how many of them its calls took
        self.batch_dims: Dict[str, List[int]] = {}  # of the running forward's taps, by layer path
        self.idle = False  # the running forward records nothing (hooks disabled, no grad)
        self.records: List[tuple] = []
        self.last_call: Optional[tuple] = None  # (path, tap) of the traced forward's latest tapped call
        self._learned: Optional[List[Optional[CallLayout]]] = None
        self._zeros: Dict[tuple, torch.Tensor] = {}
        self.compiled_forward = False  # whether the wrapper's last forward ran compiled
        self.on_tapped: Callable[[], None] = lambda: None  # before each tapped forward (joined_step_calls)
        self.on_finished: Callable[[], None] = lambda: None  # after each traced forward

    @property
    def current(self) -> Optional[Dict[str, List[torch.Tensor]]]:
        """The running forward's taps, by layer path (None when no forward is tapped)."""
        return _RUNNING.get(self._key)

    @current.setter
    def current(self, taps: Optional[Dict[str, List[torch.Tensor]]]) -> None:
        if taps is None:
            _RUNNING.pop(self._key, None)
        else:
            _RUNNING[self._key] = taps

    @torch.compiler.disable
    def prepare(self, args, kwargs, recording: Callable[[], bool]) -> str:
        """Before a traced forward: make its taps (``TAPPED``), or ask for a learning forward
        (``LEARN``), or neither (``UNTAPPED``: the hooks stay outside the graph; ``IDLE``: they
        have nothing to do, without grad or ``recording()``, whether the wrapper's hooks record)."""
        self.current, self.used, self.records, self.last_call = None, {}, [], None
        self.compiled_forward = True
        self.idle = not (torch.is_grad_enabled() and recording())
        if self.idle:
            return IDLE
        if not self.enabled or current_graph_task_id() != -1:
            return UNTAPPED
        signature, batch = input_signature(args, kwargs, self.batch_dim)
        if signature not in self.layouts:
            return LEARN if batch is not None and len(self.layouts) < MAX_SIGNATURES else UNTAPPED
        layouts = self.layouts[signature]
        if layouts is None:
            return UNTAPPED
        current: Dict[str, List[torch.Tensor]] = {}
        self.batch_dims = {}
        for layout in layouts:
            current.setdefault(layout.path, []).append(layout.tap(batch, self._zeros))
            self.batch_dims.setdefault(layout.path, []).append(layout.batch_dim)
        self.current = current
        self.on_tapped()
        return TAPPED

    def tappable(self, args, kwargs) -> bool:
        """Whether forwards of these arguments' signature are tapped (their layout is learned)."""
        return self.layouts.get(input_signature(args, kwargs, self.batch_dim)[0]) is not None

    @property
    def learning(self) -> bool:
        """Whether an eager forward is learning a layout now (:meth:`learn`)."""
        return self._learned is not None

    @torch.compiler.disable
    def learn(self, module: nn.Module, args, kwargs):
        """Run ``module`` eagerly (its hooks note each call: :meth:`note`) and keep the layout."""
        self.begin_learning()
        completed = False
        try:
            output = module(*args, **kwargs)
            completed = True
        finally:
            self.end_learning(args, kwargs, completed)
        return output

    def begin_learning(self) -> None:
        """Note the eager hooked calls from now on (:meth:`note`), until :meth:`end_learning`."""
        self._learned = []

    def end_learning(self, args, kwargs, completed: bool = True) -> None:
        """Keep the calls noted since :meth:`begin_learning` as the layout of the forwards of
        ``args``/``kwargs``'s signature (nothing if that forward did not complete)."""
        learned, self._learned = self._learned, None
        if not completed or learned is None:
            return
        signature, batch = input_signature(args, kwargs, self.batch_dim)
        fits = learned and all(c is not None and c.shape[c.batch_dim] == batch for c in learned)
        self.layouts[signature] = tuple(learned) if fits else None

    def note(self, path: str, master: nn.Module, layer: nn.Module, args, kwargs, outputs: list,
             hooked: list, batch_dim: int) -> None:
        """An eager call while a layout is learned (nothing otherwise): its layout, or None if
        it cannot be tapped (module doc)."""
        if self._learned is None:
            return
        forward = detached_forward(master)
        tappable = (layer is master and len(outputs) == 1 and hooked == [0]
                    and (not self.skips_weight_grads or (forward is not None and len(args) == 1 and not kwargs)))
        if not tappable:
            self._learned.append(None)
            return
        if forward is not None:
            self.forwards[path] = forward
        out = outputs[0]
        self._learned.append(CallLayout(path, tuple(out.shape), batch_dim, out.dtype, out.device))

    def traced_call(self, path: str, master: nn.Module, args, kwargs, output, eager: Callable, hook_args):
        """The forward hook as dynamo traces it: ``y + t`` with the layer's next tap where it fits
        the call, else the eager hook (a graph break). Taps are matched by layer, in call order:
        calls that ran eagerly (a function dynamo skips) take none."""
        if self.idle or not torch.is_grad_enabled() or not has_trainable_parameters(master):
            return None  # what the eager hook does: nothing
        taps = None if self.current is None else self.current.get(path)
        used = self.used.get(path, 0)
        if taps is None or used >= len(taps) or not isinstance(output, torch.Tensor) \
                or taps[used].shape != output.shape or taps[used].dtype != output.dtype \
                or (self.skips_weight_grads and (len(args) != 1 or kwargs)):  # as learned (note)
            return eager(*hook_args)
        tap = taps[used]
        self.used[path] = used + 1
        self.records.append((path, _values(args), {k: _values((v,))[0] for k, v in kwargs.items()}, tap, False))
        self.last_call = (path, tap)
        if self.skips_weight_grads:
            output = self.forwards[path](master, args[0])
        return output + tap

    def traced_hook(self, path: str, master: nn.Module) -> Callable[[Callable], Callable]:
        """What dynamo traces of the forward hook of ``master`` (at ``path``), given the disabled
        eager hook: :meth:`traced_call`."""
        self.layers[path] = master

        def traced(eager):
            def hook(layer, args, kwargs, output):
                return self.traced_call(path, master, args, kwargs, output, eager, (layer, args, kwargs, output))
            return hook
        return traced

    def traced_pre_hook(self, path: str, expand: Callable) -> Callable[[Callable], Callable]:
        """What dynamo traces of the broadcast pre-hook of the layer at ``path``, given the disabled
        eager hook: in a tapped forward, a call on one sample expanded to its tap's batch size by
        ``expand(layer, args, kwargs, size)`` (the eager expansion's rule), so that the call and
        its tap match; without grad or recording nothing; in a forward not tapped the eager hook."""
        def traced(eager):
            def hook(layer, args, kwargs):
                if self.idle or not torch.is_grad_enabled():
                    return None
                if self.current is None:
                    return eager(layer, args, kwargs)
                taps, used = self.current.get(path), self.used.get(path, 0)
                if taps is None or used >= len(taps):
                    return None
                return expand(layer, args, kwargs, taps[used].shape[self.batch_dims[path][used]])
            return hook
        return traced

    def passive(self, eager: Callable) -> Callable:
        """A per-layer hook with nothing to do for a tapped call or without grad (the weight-gradient
        switch); otherwise the eager hook."""
        def traced(*hook_args):
            if self.current is not None or self.idle or not torch.is_grad_enabled():
                return None
            return eager(*hook_args)
        return traced

    def last_tap(self, path: str) -> Optional[torch.Tensor]:
        """The tap of the traced forward's latest tapped call if it was a call of ``path``, else None."""
        last = self.last_call
        return last[1] if last is not None and last[0] == path else None

    def add_joined(self, path: str, inputs: torch.Tensor, tap: torch.Tensor) -> None:
        """A step projection's joined call (:mod:`~opacus_dp.grad_sample.joined_step_calls`)
        of the traced forward: its steps' inputs, and the tap of the input projection's call."""
        self.records.append((path, (inputs.detach(),), {}, tap, True))
        self.last_call = None

    @torch.compiler.disable
    def finish(self) -> List[tuple]:
        """After a tapped forward: its traced calls ``(path, args, kwargs, tap, joined)``, in order."""
        records, self.records, self.current, self.last_call = self.records, [], None, None
        self.on_finished()
        return records

    @torch.compiler.disable
    def end(self) -> None:
        """After a forward that was not tapped."""
        self.current, self.idle = None, False
        self.on_finished()
