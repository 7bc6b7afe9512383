"""A per-sample-gradient wrapper's forward as dynamo traces it (``docs/compile.md``).

Inside a compiled forward the hooked calls are tapped (:mod:`~opacus_dp.grad_sample.traced_taps`):
before the model runs, the wrapper's taps are made (or a forward learns their layout eagerly);
after it, each tapped call is recorded as the layer's eager hook would have recorded it, from the
graph's outputs, its tap standing in for its output. A recurrent layer's steps joined into one
call (:mod:`~opacus_dp.grad_sample.joined_step_calls`) are recorded as such.
"""

import torch

from opacus_dp.grad_sample.traced_taps import IDLE, LEARN, TAPPED
from opacus_dp.module_parameters import own_parameters


def tapped_forward(wrapper, args, kwargs):
    """``wrapper``'s forward as dynamo traces it: the hooked calls tapped where their layout is
    known."""
    plan = wrapper._taps.prepare(args, kwargs, wrapper._recording)
    if plan == LEARN:
        return wrapper._taps.learn(wrapper._module, args, kwargs)
    if plan == IDLE and wrapper.skips_weight_grads and torch.is_grad_enabled():
        _excuse_weight_grads(wrapper)  # hooks disabled: ordinary gradients, as eagerly
    output = wrapper._module(*args, **kwargs)
    if plan == TAPPED:
        _record_traced_calls(wrapper, wrapper._taps.finish())
    else:
        wrapper._taps.end()
    return output


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
