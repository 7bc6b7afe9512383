"""Checkpoints of a private run on a model sharded with FSDP2: a directory, resumed bit-exactly.

``PrivacyEngine.save_checkpoint(path=..., module=..., optimizer=...)`` on a ``fully_shard`` model
writes the directory ``path``:

* ``sharded/`` — model and optimizer state as torch's distributed checkpoint (DCP) writes them:
  ``get_state_dict(model, optimizer)`` of :mod:`torch.distributed.checkpoint.state_dict` (each
  rank writes its own shards; the state loads into any FSDP2 or plain model with DCP's tools);
* ``private_rank{r}.pt`` — what rank ``r`` alone knows, as one safe checkpoint file
  (:mod:`~opacus_dp.checkpoint_file`: ``weights_only`` loading, optional HMAC signature): the
  privacy history (identical on every rank), the steps the optimizer released, **this rank's
  noise stream** (each rank noises its own shard from its own generator,
  :mod:`~opacus_dp.distributed.noise_streams`), the Poisson sampler's generator (shared by the
  ranks) and the schedulers' states. In secure mode neither generator is saved (as in
  :mod:`~opacus_dp.checkpoint`).

Loading reads and checks rank ``r``'s file first (present, written for this world size, a
privacy history this accountant loads and that agrees with the step count) and only then changes
anything. Resuming needs the same world size: the noise streams and the sampler's shares are per
rank.
"""

import os
from typing import Dict, Optional

import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from opacus_dp import checkpoint_file
from opacus_dp.checkpoint import _check_accountant_entry, _clipping_state, _load_clipping_state, _sampler_generator
from opacus_dp.checkpoint_consistency import STEPS_ENTRY, check_history_agrees
from opacus_dp.model_wrappers import unwrap_model
from opacus_dp.optim.dp_optimizer import dp_optimizer_behind

SHARDED_DIR = "sharded"


def _rank_file(path, rank: int) -> str:
    return os.path.join(os.fspath(path), f"private_rank{rank}.pt")


def _parts(module: nn.Module, optimizer):
    """The user's model, the DP optimizer and the torch optimizer it wraps."""
    dp_optimizer = dp_optimizer_behind(optimizer)
    if dp_optimizer is None:
        raise ValueError("a sharded checkpoint needs the optimizer make_private/attach returned")
    return unwrap_model(module), dp_optimizer, dp_optimizer.original_optimizer


def save(path, *, module: nn.Module, optimizer, accountant, rank: int, world_size: int,
         data_loader=None, schedulers: Optional[Dict[str, object]] = None, checkpoint_dict=None,
         secure_mode: bool = False, signing_key=None) -> None:
    """Write the directory described in the module doc (collective: call it on every rank)."""
    model, dp_optimizer, inner = _parts(module, optimizer)
    model_state, optimizer_state = get_state_dict(model, inner)
    dcp.save({"model": model_state, "optimizer": optimizer_state},
             checkpoint_id=os.path.join(os.fspath(path), SHARDED_DIR))
    state = dict(checkpoint_dict or {})
    state.update({"privacy_accountant_state_dict": accountant.state_dict(), STEPS_ENTRY: dp_optimizer.steps_taken,
                  "world_size": world_size, "rank": rank})
    if not secure_mode:
        state["noise_generator_state"] = dp_optimizer.noise_state_dict()
        generator = _sampler_generator(data_loader)
        if generator is not None:
            state["sampler_generator_state"] = generator.get_state()
    learned = _clipping_state(dp_optimizer)
    if learned:
        state["clipping_state"] = learned
    for name, scheduler in (schedulers or {}).items():
        if scheduler is not None:
            state[f"{name}_state_dict"] = scheduler.state_dict()
    checkpoint_file.write(state, _rank_file(path, rank), signing_key=signing_key)


def _read_rank_state(path, rank: int, world_size: int, accountant, signing_key) -> dict:
    """Rank ``rank``'s file, checked before anything changes (module doc)."""
    if not os.path.isfile(_rank_file(path, rank)):
        raise ValueError(f"{path} is not a sharded checkpoint for rank {rank} (no private_rank{rank}.pt): "
                         "it was written by another number of processes or is not a sharded checkpoint "
                         "(nothing was loaded)")
    state = checkpoint_file.read(_rank_file(path, rank), signing_key=signing_key)
    if state.pop("world_size", None) != world_size or state.pop("rank", None) != rank:
        raise ValueError(f"checkpoint {path} was written by another number of processes than the "
                         f"{world_size} running now: resume with the same world size (nothing was loaded)")
    _check_accountant_entry(path, state, accountant)
    check_history_agrees(path, state)
    return state


def load(path, *, module: nn.Module, optimizer, accountant, rank: int, world_size: int,
         data_loader=None, schedulers: Optional[Dict[str, object]] = None, secure_mode: bool = False,
         signing_key=None) -> dict:
    """Restore what :func:`save` wrote (collective); returns the entries not consumed."""
    model, dp_optimizer, inner = _parts(module, optimizer)
    state = _read_rank_state(path, rank, world_size, accountant, signing_key)
    model_state, optimizer_state = get_state_dict(model, inner)
    sharded = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(sharded, checkpoint_id=os.path.join(os.fspath(path), SHARDED_DIR))
    set_state_dict(model, inner, model_state_dict=sharded["model"], optim_state_dict=sharded["optimizer"])
    accountant.load_state_dict(state.pop("privacy_accountant_state_dict"))
    dp_optimizer.steps_taken = state.pop(STEPS_ENTRY)
    noise = state.pop("noise_generator_state", None)
    if noise is not None and not secure_mode:
        dp_optimizer.load_noise_state_dict(noise)
    generator = None if secure_mode else _sampler_generator(data_loader)
    sampler_state = state.pop("sampler_generator_state", None)
    if generator is not None and sampler_state is not None:
        generator.set_state(sampler_state)
    _load_clipping_state(state.pop("clipping_state", None), dp_optimizer)
    for name, scheduler in (schedulers or {}).items():
        saved = state.pop(f"{name}_state_dict", None)
        if scheduler is not None and saved is not None:
            scheduler.load_state_dict(saved)
    return state
