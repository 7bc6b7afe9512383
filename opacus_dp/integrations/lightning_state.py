"""The private state of a :class:`~opacus_dp.integrations.lightning.DPCallback` run inside a Lightning
checkpoint.

Lightning saves the weights, the (inner) optimizer's state and its loops; the callback adds one entry,
``checkpoint["opacus_dp_private_state"]``, with the fields :func:`opacus_dp.checkpoints.single_file.save` writes
under the same names: the accountant's history, the private steps released, the noise generator,
the adaptive clipping bound and the Poisson sampler's generator (the generators are not saved in
secure mode). Every value is a tensor, number, string, list, tuple or dict, so ``weights_only=True``
loads it.

Restoring checks the fields first (:func:`~opacus_dp.checkpoints.consistency.check_history_agrees`: a
malformed field, or a history shorter than the steps released, is refused before anything changes).
A checkpoint without the entry is refused: resuming from it would count ε from zero for a model that
already used the data.
"""

from typing import Optional

import torch

from opacus_dp.checkpoints.consistency import ACCOUNTANT_ENTRY, STEPS_ENTRY, check_history_agrees
from opacus_dp.distributed.noise_streams import own_stream_per_rank

STATE_KEY = "opacus_dp_private_state"
NOISE_ENTRY = "noise_generator_state"
SAMPLER_ENTRY = "sampler_generator_state"
CLIPPING_ENTRY = "clipping_state"
WHERE = "Lightning checkpoint"


def private_state(*, optimizer, accountant, sampler_generator: Optional[torch.Generator],
                  secure_mode: bool) -> dict:
    """The entry :class:`DPCallback` adds to a Lightning checkpoint (module doc)."""
    state = {ACCOUNTANT_ENTRY: accountant.state_dict(), STEPS_ENTRY: int(optimizer.steps_taken)}
    if not secure_mode:  # generator states would reveal the batches and the noise
        state[NOISE_ENTRY] = optimizer.noise_state_dict()
        if sampler_generator is not None:
            state[SAMPLER_ENTRY] = sampler_generator.get_state()
    clipping = optimizer.clipping_state_dict()
    if clipping:
        state[CLIPPING_ENTRY] = clipping
    return state


def check_private_state(checkpoint: dict) -> dict:
    """The callback's entry of a Lightning ``checkpoint``, checked; refuse a checkpoint without it."""
    state = checkpoint.get(STATE_KEY)
    if not isinstance(state, dict):
        raise ValueError(
            f"DPCallback: the checkpoint has no {STATE_KEY!r} entry (the privacy accountant, noise and "
            "sampler states): resuming from it would count epsilon from zero for a model that already "
            "used the data. Resume from a checkpoint written by a Trainer with DPCallback")
    check_history_agrees(WHERE, state, require_steps=True)
    return state


def restore_private_state(state: dict, *, optimizer, accountant, sampler_generator: Optional[torch.Generator],
                          secure_mode: bool) -> None:
    """Load what :func:`private_state` saved (checked by :func:`check_private_state`)."""
    if len(accountant) > 0 or optimizer.steps_taken:
        raise RuntimeError("DPCallback: the private state can only be restored before the first step")
    accountant.load_state_dict(state[ACCOUNTANT_ENTRY])
    optimizer.steps_taken = state[STEPS_ENTRY]
    if not secure_mode and NOISE_ENTRY in state:
        optimizer.load_noise_state_dict(state[NOISE_ENTRY])  # rank 0's, loaded on every rank:
        own_stream_per_rank(optimizer)  # a sharded model's ranks each continue a stream of their own
    if not secure_mode and SAMPLER_ENTRY in state and sampler_generator is not None:
        sampler_generator.set_state(state[SAMPLER_ENTRY])
    if CLIPPING_ENTRY in state and optimizer.clipping_state_dict():
        optimizer.load_clipping_state_dict(state[CLIPPING_ENTRY])
