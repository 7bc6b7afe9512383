"""Output gradients that a recurrent cell's input projection shares with its step projection.

A DP recurrent cell (:mod:`opacus_dp.layers.rnn_cells`) projects a whole sequence with one call of
``ih`` and adds, at step ``t``, position ``t`` of that call's output to the output of ``hh``'s call
of the step: ``z_t = W_ih x_t + W_hh h_{t-1} (+ biases)``. Both terms receive the gradient of
``z_t``, so the output gradient of ``ih``'s call, ``G (B, T, p)``, holds at position ``t`` the
numbers of the output gradient of ``hh``'s call at step ``t``: autograd stacks ``G`` from the
steps' tensors. A cell declares such pairs of its projections in
``_dp_shared_gate_gradients`` (the tanh/ReLU RNN's and the LSTM's cells; not the GRU's, whose
candidate gate multiplies ``hh``'s output by the reset gate first).

``hh``'s calls are recorded first, one per step, in the backward pass's order (the last step
first, or the first step first in a reversed direction). When ``G`` arrives,
:func:`share_step_gradients` checks that every recorded step gradient equals its position of
``G`` value for value and only then makes it a view of ``G``: the steps' own tensors are freed,
``hh``'s calls, reordered by time, merge into ``G`` itself (no concatenated copy,
:func:`~opacus_dp.maths.views.joined`), and ``ih``, which keeps no more than its input besides
``G``, keeps its call for the ghost norm instead of materialising ``B`` per-sample gradients.
Nothing changes but where the same numbers are held (and the order in which ``hh``'s positions
are summed). Any mismatch (a user's hook changed an output, a sequence projected in several
calls, steps not all recorded) leaves every call as recorded.
"""

from typing import Dict, List, Optional

import torch
import torch.nn as nn

from opacus_dp.grad_sample.bookkeeping.passes import Call

EARLY_EXIT_DEVICES = ("cpu",)  # where one comparison per step costs no device synchronisation


def step_projections(model: nn.Module) -> Dict[nn.Module, nn.Module]:
    """``{whole-sequence projection: step projection}`` declared by the model's cells."""
    links = {}
    for module in model.modules():
        for whole, step in getattr(module, "_dp_shared_gate_gradients", ()):
            links[getattr(module, whole)] = getattr(module, step)
    return links


def share_step_gradients(whole: Call, steps: Optional[List[Call]], steps_pending: int) -> bool:
    """Make the recorded output gradients of ``steps`` (the step projection's calls of this pass,
    in recording order; reordered by time in place) views of ``whole``'s output gradient ``G``,
    if each equals its position of ``G``; whether it did (module doc). ``steps_pending``: the step
    projection's calls still awaiting their output gradients (then nothing is shared)."""
    g = whole.backprops[0] if len(whole.backprops) == 1 else None
    if not steps or steps_pending or g is None or g.dim() != 3 or len(steps) != g.shape[1]:
        return False
    parts = [c.backprops[0] if len(c.backprops) == 1 else None for c in steps]
    if any(not _is_step_of(part, g) for part in parts) or any(c.scale != whole.scale for c in steps):
        return False
    count = len(steps)
    for times in (range(count - 1, -1, -1), range(count)):  # recorded backwards, or reversed cell
        if _all_equal(parts, g, times):
            break
    else:
        return False
    for c, t in zip(steps, times):
        c.backprops = [g[:, t]]
    steps[:] = [c for _, c in sorted(zip(times, steps), key=lambda pair: pair[0])]
    return True


def _all_equal(parts: List[torch.Tensor], g: torch.Tensor, times) -> bool:
    """Whether each part equals, value for value, its step ``t`` of ``g`` (``g[:, t]``; a NaN equals
    nothing): one comparison per step where that stops at the first difference (CPU), elsewhere all
    steps compared at once with one read of the result (a read per step would wait for the device
    at every step)."""
    if g.device.type in EARLY_EXIT_DEVICES:
        return all(torch.equal(part, g[:, t]) for part, t in zip(parts, times))
    return bool(torch.stack([torch.eq(part, g[:, t]).all() for part, t in zip(parts, times)]).all())


def _is_step_of(part: Optional[torch.Tensor], g: torch.Tensor) -> bool:
    return (part is not None and part.shape == (g.shape[0], g.shape[2]) and part.dtype == g.dtype
            and part.device == g.device)
