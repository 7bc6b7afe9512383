"""Every private PyTorch API the package uses, in one place.

A torch upgrade that renames or changes one of these fails here, and in the test of the same
name in ``tests/architecture/test_torch_internals.py``, not deep inside a hook. Each function
names the private API it wraps and what the package relies on.
"""

import sys
from typing import Any, Callable, ContextManager, Dict, Optional

import torch


def current_graph_task_id() -> int:
    """``torch._C._current_graph_task_id()``: an id of the backward pass now running in this
    thread (the same for every hook of one ``backward()``), ``-1`` outside a backward pass."""
    return torch._C._current_graph_task_id()


def queue_end_of_backward_callback(callback: Callable[[], None]) -> None:
    """``Variable._execution_engine.queue_callback``: run ``callback`` when the backward pass now
    running finishes (only valid inside a backward pass)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def saved_tensor_hooks_active() -> bool:
    """``torch._C._autograd._top_saved_tensors_default_hooks``: True when saved-tensor hooks
    (activation checkpointing, ``save_on_cpu``) may be packing what autograd saves, so its saved
    tensors must not be read directly (unknown: assume they may)."""
    top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top_hooks is None or top_hooks(False) is not None


def saved_value(node: Any, name: str) -> Any:
    """``node._saved_<name>``: what an autograd node saved for its backward (``self``,
    ``result1``, ``negative_slope``, ...); raises RuntimeError once the backward freed it."""
    return getattr(node, "_saved_" + name)


def storage_use_count(tensor: torch.Tensor) -> int:
    """``torch._C._storage_Use_Count``: tensors (and other holders) sharing ``tensor``'s storage,
    less the temporary storage object of this call."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata) - 1


def version_counter(tensor: torch.Tensor) -> int:
    """``tensor._version``: bumped by every in-place change of the tensor, its views and its
    detached aliases (they share the counter)."""
    return tensor._version


def view_base(tensor: torch.Tensor) -> Optional[torch.Tensor]:
    """``tensor._base`` if ``tensor`` is a view (``_is_view()``), else None."""
    return tensor._base if tensor._is_view() else None


def reparametrized(module: torch.nn.Module, tensors: Dict[str, torch.Tensor]) -> ContextManager:
    """``torch.nn.utils.stateless._reparametrize_module``: within the context, ``module``'s
    parameters (and buffers) named in ``tensors`` are those tensors (what
    ``torch.func.functional_call`` does around a call); restored on exit."""
    from torch.nn.utils.stateless import _reparametrize_module

    return _reparametrize_module(module, tensors)


def global_module_hook_ids() -> set:
    """The handle ids of the global module hooks (``torch.nn.modules.module._global_*_hooks``:
    what ``register_module_forward_pre_hook`` and its siblings add), which every module call
    runs."""
    from torch.nn.modules import module

    tables = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
              "_global_backward_hooks")
    return {key for name in tables for key in getattr(module, name)}


def is_compiled_module(module: object) -> bool:
    """Whether ``module`` is what ``torch.compile(model)`` returns (an ``OptimizedModule``)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # none compiled if not loaded
    optimized = getattr(eval_frame, "OptimizedModule", None)
    return optimized is not None and isinstance(module, optimized)


def fullgraph_original(module: object) -> Optional[torch.nn.Module]:
    """The model ``module = torch.compile(model, fullgraph=True)`` compiles (``_orig_mod``); None for
    any other module (torch versions whose ``dynamo_ctx`` has no ``fullgraph``: None)."""
    if not is_compiled_module(module) or not getattr(module.dynamo_ctx, "fullgraph", False):
        return None
    return module._orig_mod


def compiled_fullgraph(compiled: Callable) -> bool:
    """Whether the function ``compiled = torch.compile(fn, fullgraph=True)`` was compiled with
    ``fullgraph=True`` (read from the dynamo context its wrapper closes over, ``self``); False where
    that is not found (other torch versions: dynamo then raises its own error on a graph break)."""
    code = getattr(compiled, "__code__", None)
    cells = dict(zip(code.co_freevars, compiled.__closure__ or ())) if code is not None else {}
    context = cells["self"].cell_contents if "self" in cells else None
    return bool(getattr(context, "fullgraph", False))


def dynamo_compiling() -> bool:
    """Whether dynamo is compiling in this thread: tracing (``torch.compiler.is_compiling``), or
    its backend or guard building at work (``torch._guards.CompileContext.try_get()``, set for the
    whole compilation of a frame). Python code that runs meanwhile (a garbage collector's
    finalizer) must not change what the guards being built read, such as the global module hooks."""
    if torch.compiler.is_compiling():
        return True
    guards = sys.modules.get("torch._guards")  # nothing compiles before dynamo is loaded
    context = getattr(guards, "CompileContext", None)
    return context is not None and context.try_get() is not None
