"""A per-sample-gradient wrapper's forward where the model's code is compiled (``docs/compile.md``):
as dynamo traces it (``torch.compile(wrapper)``), or eager around the compiled model call
(``wrapper.compile(...)``, ``make_private(module=torch.compile(model))``).

Inside a compiled forward the hooked calls are tapped (:mod:`~opacus_dp.grad_sample.traced_taps`):
before the model runs, the wrapper's taps are made (or a forward learns their layout eagerly);
after it, each tapped call is recorded as the layer's eager hook would have recorded it, from the
graph's outputs, its tap standing in for its output. A recurrent layer's steps joined into one
call (:mod:`~opacus_dp.grad_sample.joined_step_calls`) are recorded as such.
"""

import torch

from opacus_dp.grad_sample.traced_taps import IDLE, LEARN, TAPPED, UNTAPPED
from opacus_dp.module_parameters import own_parameters


def tapped_forward(wrapper, args, kwargs):
    """``wrapper``'s forward as dynamo traces it (``torch.compile(wrapper)``), or run eagerly around
    its compiled model call (``wrapper.compile()``): the hooked calls tapped where their layout is
    known."""
    taps, call = wrapper._taps, wrapper._compiled_model_call
    plan = taps.prepare(args, kwargs, wrapper._recording)
    fullgraph = wrapper._compiled_fullgraph and not torch.compiler.is_compiling()
    if plan == LEARN:
        output = taps.learn(wrapper._module, args, kwargs)
        if fullgraph and not taps.tappable(args, kwargs):
            raise _untapped_fullgraph_error()
        return output
    if plan == UNTAPPED and fullgraph:
        taps.end()
        raise _untapped_fullgraph_error()
    _excuse_if_idle(wrapper, plan)
    if call is None or torch.compiler.is_compiling():
        output = wrapper._module(*args, **kwargs)
    else:  # the wrapped model's call compiled (wrapper.compile()), the model-level checks eager
        model, broadcast = wrapper._module, wrapper._broadcast
        output = wrapper._model_checks.around(model, lambda *a, **k: broadcast.around(model, call, a, k), args, kwargs)
    _close(wrapper, plan, completed=True)
    return output


@torch.compiler.disable
def begin_outside_forward(wrapper, args, kwargs) -> str:
    """Before a forward of ``wrapper``'s model that other code runs, compiled (Lightning's compiled
    ``training_step`` calling the model's layers), ``args``/``kwargs`` standing for its inputs:
    what :func:`tapped_forward` does before the model's call. Returns the plan: ``TAPPED`` (the
    taps are made), ``LEARN`` (the caller must run that forward eagerly; its hooked calls are
    noted), ``UNTAPPED`` or ``IDLE``. Then :func:`end_outside_forward`."""
    wrapper._restore_switches()
    plan = wrapper._taps.prepare(args, kwargs, wrapper._recording)
    if plan == LEARN:
        wrapper._taps.begin_learning()
    if plan == TAPPED:  # no broadcast call to size: the model's broadcast hooks do nothing (traced away)
        wrapper._broadcast.begin_compiled_call()
    _excuse_if_idle(wrapper, plan)
    return plan


@torch.compiler.disable
def end_outside_forward(wrapper, plan: str, args, kwargs, completed: bool) -> None:
    """After the forward of :func:`begin_outside_forward`, before its backward pass: the layout
    learned (``LEARN``) or the tapped calls recorded (``TAPPED``), as after the wrapper's own
    forward. ``completed=False`` (the forward failed or gave no loss) keeps neither."""
    wrapper._broadcast.end_compiled_call()
    if plan == LEARN:
        wrapper._taps.end_learning(args, kwargs, completed)
    else:
        _close(wrapper, plan, completed)


def _excuse_if_idle(wrapper, plan: str) -> None:
    """A forward with the hooks disabled: ordinary weight gradients, as eagerly."""
    if plan == IDLE and wrapper.skips_weight_grads and torch.is_grad_enabled():
        _excuse_weight_grads(wrapper)


def _close(wrapper, plan: str, completed: bool) -> None:
    """After a forward that did not learn: its tapped calls recorded (a completed ``TAPPED``
    forward), else the taps dropped."""
    if plan == TAPPED and completed:
        _record_traced_calls(wrapper, wrapper._taps.finish())
    else:
        wrapper._taps.end()


def _untapped_fullgraph_error() -> ValueError:
    return ValueError(
        "compiled with fullgraph=True, but this forward's hooked calls cannot be traced into the graph (a call "
        "with several outputs, in ghost/bk a layer of its own type with buffers, nn.DataParallel or FSDP2 inside "
        "the model, more than 8 input signatures: see docs/compile.md); compile without fullgraph=True "
        "(private_model.compile(...)): the hooks then run outside the graph")


@torch.compiler.disable
def _excuse_weight_grads(wrapper) -> None:
    for layer in wrapper._hooked_layers():
        for _, param in own_parameters(layer):
            wrapper._outside_use.excuse(param)


@torch.compiler.disable
def _record_traced_calls(wrapper, records) -> None:
    """Record the tapped calls of a compiled forward, as their eager hooks would have."""
    for path, args, kwargs, tap, joined in records:
        master = wrapper._taps.layers[path]
        if joined:  # a recurrent layer's steps as one call (the norms-only wrapper's)
            wrapper._record_joined_steps(path, master, args[0], tap, traced=True)
        else:
            wrapper._capture(path, master, master, args, kwargs, tap, traced=True)
        if wrapper.skips_weight_grads:
            for _, param in own_parameters(master):
                wrapper._outside_use.watch(param)
                wrapper._outside_use.note_grad(param)
