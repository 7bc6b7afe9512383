"""The ghost norms' rounding checks of a step, read at once before the norms are used.

A Gram-form norm is kept only where its rounding error is provably small, else recomputed from
the materialised per-sample gradient (:mod:`~opacus_dp.grad_sample.bookkeeping.norm_samplers.trust`).
Reading the check is a host read: on a GPU, one per layer stalls the backward pass 3–16 times a
step on the benchmark models. A ``bk`` pass with flat clipping keeps every ghost call's inputs and
output gradients until the step anyway, so its calls' checks are deferred
(:func:`~opacus_dp.grad_sample.bookkeeping.norm_samplers.trust.deferred_checks`): each kept call
carries the masks of its suspect samples, :func:`check_passes` reads all of them in one transfer
per device, and a call with a suspect sample has its norms recomputed from what it kept, checked
at once, as they would have been during the backward pass (the same operations on the same
values: the same norms). No norm of a pass is read before :func:`check_passes` has run on it.
"""

from typing import Dict, List

import torch

from opacus_dp.grad_sample.bookkeeping.passes import Pass, ghost_norms, refuse_changed_kept_calls
from opacus_dp.grad_sample.bookkeeping.recomputed_inputs import materialise
from opacus_dp.grad_sample.registry import PerSampleGrads


def check_passes(passes: List[Pass]) -> None:
    """Resolve the deferred checks of ``passes``: recompute, checked, the norms of every kept call
    with a suspect sample (refused, as at the step, if a tensor kept in such a pass was written in
    place since); afterwards no norm of theirs is unchecked."""
    pending = [(resolved, kept, masks) for resolved in passes for kept, masks in resolved.unchecked]
    if not pending:
        return
    flags = _read_flags([torch.stack([m.any() for m in masks]).any() for _, _, masks in pending])
    flagged = [(resolved, kept) for (resolved, kept, _), suspect in zip(pending, flags) if suspect]
    refuse_changed_kept_calls(list({id(r): r for r, _ in flagged}.values()))  # recomputed from them
    for resolved, kept in flagged:
        _recompute_checked(resolved, kept)
    for resolved in passes:
        resolved.unchecked = []


def _read_flags(flags: List[torch.Tensor]) -> List[bool]:
    """The 0-d boolean ``flags`` as Python booleans: one host transfer per device."""
    by_device: Dict[torch.device, List[int]] = {}
    for i, flag in enumerate(flags):
        by_device.setdefault(flag.device, []).append(i)
    values = [False] * len(flags)
    for indices in by_device.values():
        for i, value in zip(indices, torch.stack([flags[i] for i in indices]).tolist()):
            values[i] = value
    return values


def _recompute_checked(resolved: Pass, kept: tuple) -> None:
    """The kept call's norms recomputed with immediate checks, replacing its unchecked ones (each
    scaled by the loss reduction's ``scale²``, as when it was resolved)."""
    layer, activations, backprops, scale = kept
    for p, result in ghost_norms(layer, materialise(activations), backprops).items():
        if isinstance(result, PerSampleGrads):
            continue  # kept as per-sample gradients: no Gram form, nothing to check
        if p not in resolved.sq_norms or p in resolved.grads:
            raise RuntimeError(f"the ghost norms of a parameter of shape {tuple(p.shape)} could not be "
                               f"checked again: its pass holds no norms of it")
        resolved.sq_norms[p] = result * (scale * scale)
