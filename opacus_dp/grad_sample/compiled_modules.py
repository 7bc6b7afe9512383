"""``torch.compile`` and the per-sample-gradient wrappers (see ``docs/compile.md``).

A wrapped model may be compiled (``torch.compile(private_model)``, ``private_model.compile()``),
or passed to ``make_private`` already compiled; either way a step gives the eager step's result.
Three measures make that hold, taken when a wrapper is built:

* :func:`run_hooks_eagerly`: the wrapper's module hooks run outside dynamo (each wrapped in
  ``torch.compiler.disable``): dynamo never traces the bookkeeping, which reads autograd nodes,
  weak references and thread-local state (tracing it can fail, e.g. on a norm layer's saved
  statistics). The per-layer hooks of the traced taps (:mod:`~opacus_dp.grad_sample.traced_taps`)
  are traced instead, where the taps apply; elsewhere each is a graph break.
* :func:`guard_module_hooks`: dynamo guards on module hooks
  (``torch._dynamo.config.skip_nnmodule_hook_guards = False``). By default it does not, so code
  compiled for a module without hooks (this model before it was wrapped, or another instance of
  one of its classes) would be reused and skip them. When the setting changes, the compile caches
  are cleared (``torch.compiler.reset()``) so that no such code is left. Should code without the
  hooks still run, the layers' parameters get ordinary gradients and no per-sample state, and the
  DP optimizer refuses the step: never a silent non-private one.
* :func:`take_compiled` / :func:`compile_like`: a model passed compiled (an ``OptimizedModule``)
  is wrapped uncompiled and the wrapper compiled with the same backend and options (what
  ``wrapper.compile(...)`` does: the wrapped model's call compiled, the wrapper eager around it,
  :class:`EagerAroundCompiledCall`), so names, state-dict keys and checkpoints are the uncompiled
  ones. (``torch.compile(wrapper, fullgraph=True)``, which dynamo cannot trace as one graph, is
  refused at its first call naming ``wrapper.compile(fullgraph=True)``:
  :mod:`~opacus_dp.distributed.data_parallel`'s call hook.) A model compiled in place
  (``model.compile(...)``) is adopted likewise at the wrapper's forward: :func:`adopt_compiled_call`.

The first wrapper of a process loads ``torch._dynamo`` (about a second, once). Private attributes
used here: ``torch._dynamo.config.skip_nnmodule_hook_guards``, ``torch._dynamo.eval_frame.skip_code``,
``OptimizedModule._orig_mod`` and ``.dynamo_ctx`` (its ``fullgraph``), ``nn.Module._call_impl`` and
``._compiled_call_impl``
(tested in ``tests/compile``).
"""

from contextlib import contextmanager
from typing import Callable, Dict, Iterable, Iterator, Optional, Tuple

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from opacus_dp.torch_internals import compiled_fullgraph, fullgraph_original, is_compiled_module


def run_hooks_eagerly(model: nn.Module, handles: Iterable[object],
                      traced: Optional[Dict[int, Callable[[Callable], Callable]]] = None) -> None:
    """Wrap each forward (pre-)hook of ``model``'s modules registered with one of ``handles`` in
    ``torch.compiler.disable`` (in place, same key: removing the handle still removes it).
    ``traced[handle.id](eager)``, where given, is what dynamo traces instead of the disabled hook
    ``eager`` (the traced taps, :mod:`~opacus_dp.grad_sample.traced_taps`); eagerly the hook runs."""
    hook_dicts = {id(d) for m in model.modules() for d in (m._forward_pre_hooks, m._forward_hooks)}
    traced = traced or {}
    for handle in handles:
        if not isinstance(handle, RemovableHandle):
            continue
        hooks = handle.hooks_dict_ref()
        if hooks is None or id(hooks) not in hook_dicts or handle.id not in hooks:
            continue
        hook = hooks[handle.id]
        if getattr(hook, "_torchdynamo_disable", False) or getattr(hook, "_opacus_dp_dispatch", False):
            continue
        eager = torch.compiler.disable(hook)
        hooks[handle.id] = eager if handle.id not in traced else _dispatch(eager, traced[handle.id](eager))


def _dispatch(eager: Callable, traced: Callable) -> Callable:
    """``traced`` while dynamo traces, ``eager`` otherwise. Dynamo inlines the returned hook into
    the graph of the function that calls it, but never compiles it as a frame of its own
    (``skip_code``): a layer called from a function that runs eagerly runs the eager hook."""
    def hook(*args):
        if torch.compiler.is_compiling():
            return traced(*args)
        return eager(*args)

    _skip_as_frame(hook.__code__)
    hook._opacus_dp_dispatch = True
    return hook


def _skip_as_frame(code) -> None:
    """Dynamo runs frames of ``code`` eagerly (the functions they call are compiled as usual)."""
    from torch._dynamo.eval_frame import skip_code  # loaded with torch._dynamo (guard_module_hooks)

    skip_code(code)


def guard_module_hooks() -> None:
    """Make dynamo guard on module hooks; clear the compile caches if it did not (module doc)."""
    config = torch._dynamo.config  # loaded by torch on first access
    if config.skip_nnmodule_hook_guards:
        config.skip_nnmodule_hook_guards = False
        torch.compiler.reset()


def prepare_for_compile(wrapper: nn.Module) -> None:
    """The measures of the module doc for a new ``wrapper`` (its model ``_module``, its hooks'
    ``_handles``, the traced forms ``_traced``: see :func:`run_hooks_eagerly`)."""
    run_hooks_eagerly(wrapper._module, wrapper._handles, wrapper._traced)
    guard_module_hooks()


def adopt_compiled_call(wrapper: nn.Module) -> bool:
    """Whether ``wrapper``'s forward runs a compiled model call (``wrapper.compile(...)``), after
    adopting the model's own: a model compiled in place (``model.compile(...)``, before or after it
    was wrapped) has its compiled call (``torch.compile(model._call_impl, ...)``, what
    ``wrapper.compile(...)`` makes) moved to the wrapper, with its ``fullgraph``, at the wrapper's
    next forward, until :func:`give_back_compiled_call`: the wrapper runs eagerly around it, the
    hooked calls tapped in its graph, and the model's own calls (learning the taps) run eagerly.
    A model trained by calling it, not the wrapper (the 0.x API), keeps its compiled call."""
    call = getattr(wrapper._module, "_compiled_call_impl", None)
    if call is not None and not torch.compiler.is_compiling() and wrapper._finalizer.alive:  # not closed
        wrapper._module._compiled_call_impl = None
        wrapper._adopted_compiled_call = wrapper._compiled_model_call = call
        wrapper._compiled_fullgraph = compiled_fullgraph(call)
    return wrapper._compiled_model_call is not None


def give_back_compiled_call(wrapper: nn.Module) -> None:
    """The model's in-place compiled call taken by :func:`adopt_compiled_call` back on the model
    (unless it was compiled again meanwhile), and off the wrapper (unless ``wrapper.compile()``
    replaced it)."""
    call = wrapper.__dict__.pop("_adopted_compiled_call", None)
    if call is None:
        return
    if wrapper._compiled_model_call is call:
        wrapper._compiled_model_call, wrapper._compiled_fullgraph = None, False
    if getattr(wrapper._module, "_compiled_call_impl", None) is None:
        wrapper._module._compiled_call_impl = call


def take_compiled(module: nn.Module) -> Tuple[nn.Module, Optional[nn.Module]]:
    """``(model, compiled)``: for ``compiled = torch.compile(model)`` the original model and the
    compiled one (see :func:`compile_like`); for any other module ``(module, None)``."""
    if is_compiled_module(module):
        return module._orig_mod, module
    return module, None


def compile_like(wrapper: nn.Module, compiled: nn.Module) -> nn.Module:
    """Compile ``wrapper`` with ``compiled``'s backend and options, as ``wrapper.compile(...)``
    does (the wrapped model's call compiled, the wrapper eager around it); returns ``wrapper``."""
    wrapper._compiled_model_call = compiled.dynamo_ctx(wrapper._module._call_impl)
    wrapper._compiled_fullgraph = fullgraph_original(compiled) is not None
    return wrapper


class EagerAroundCompiledCall:
    """Mixin of a wrapper's hooks on the wrapped model itself (model-level checks, broadcast
    inputs): where the wrapper runs eagerly around the model's compiled call (``wrapper.compile()``),
    it does their work before and after the call (``around``), and within the call
    (:meth:`compiled_call`) the hooks do nothing, traced into its graph or run eagerly by it."""

    _around_compiled_call = False

    def unless_around(self, hook: Callable) -> Callable:
        """``hook`` doing nothing within :meth:`compiled_call`: the form registered on the model, and
        the form dynamo traces (of the eager hook, run outside the graph)."""
        def registered(*hook_args):
            return None if self._around_compiled_call else hook(*hook_args)
        return registered

    @contextmanager
    def compiled_call(self) -> Iterator[None]:
        self.begin_compiled_call()
        try:
            yield
        finally:
            self.end_compiled_call()

    def begin_compiled_call(self) -> None:
        """From now until :meth:`end_compiled_call`, as within :meth:`compiled_call` (for a compiled
        call that other code makes: :func:`~opacus_dp.grad_sample.traced_forward.begin_outside_forward`)."""
        self._around_compiled_call = True

    def end_compiled_call(self) -> None:
        self._around_compiled_call = False
