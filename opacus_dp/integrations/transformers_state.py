"""The private state of a :class:`~opacus_dp.integrations.transformers.DPTrainer` run in the Trainer's
checkpoint directories.

Beside the Trainer's own files (weights, ``optimizer.pt``, scheduler, RNG states) each
``checkpoint-N/`` gets ``private_state.pt`` (``private_state-rank{r}.pt`` on rank ``r > 0``): the
accountant's history, the private steps released, the noise stream and the Poisson sampler's
generator (not saved in secure mode), the adaptive clipping bound. It is written by
:func:`opacus_dp.checkpoints.single_file.save` (atomic, only entries ``weights_only=True`` reads) without the
model weights, which the Trainer saves, and read back with the same checks (a history shorter than
the steps taken, a malformed field, an unfinished logical batch: refused, nothing changed).

Resuming without it is refused: the run would count ε from zero for a model that already used
the data.
"""

import os

import torch.nn as nn

from opacus_dp.checkpoints import single_file

STATE_NAME = "private_state.pt"


def state_path(directory: str, rank: int) -> str:
    name = STATE_NAME if rank == 0 else f"private_state-rank{rank}.pt"
    return os.path.join(directory, name)


def save_private_state(directory: str, *, rank: int, optimizer, accountant, data_loader, secure_mode: bool) -> None:
    """Write the private state of this rank into the checkpoint ``directory``."""
    os.makedirs(directory, exist_ok=True)
    single_file.save(state_path(directory, rank), module=nn.Module(), optimizer=optimizer, accountant=accountant,
                       data_loader=data_loader, secure_mode=secure_mode)


def load_private_state(directory: str, *, rank: int, optimizer, accountant, data_loader, secure_mode: bool) -> None:
    """Restore what :func:`save_private_state` wrote; refuse a checkpoint without it."""
    path = state_path(directory, rank)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"DPTrainer: resume_from_checkpoint={directory!r} has no {os.path.basename(path)} (the privacy "
            "accountant, noise and sampler states): resuming would count epsilon from zero for a model that "
            "already used the data. Resume from a checkpoint written by DPTrainer")
    single_file.load(path, module=nn.Module(), optimizer=optimizer, accountant=accountant,
                       data_loader=data_loader, secure_mode=secure_mode)
