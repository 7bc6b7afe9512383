"""Checkpoints of a private run on a model sharded with FSDP2: a directory, resumed bit-exactly.

``PrivacyEngine.save_checkpoint(path=..., module=..., optimizer=...)`` on a ``fully_shard`` model
writes the directory ``path``:

* ``sharded/`` — model and optimizer state as torch's distributed checkpoint (DCP) writes them:
  ``get_state_dict(model, optimizer)`` of :mod:`torch.distributed.checkpoint.state_dict` (each
  rank writes its own shards; the state loads into any FSDP2 or plain model with DCP's tools);
* ``private_rank{r}.pt`` — what rank ``r`` alone knows, as one safe checkpoint file
  (:mod:`~opacus_dp.checkpoints.file_format`: ``weights_only`` loading, optional HMAC signature): the
  privacy history (identical on every rank), the steps the optimizer released, **this rank's
  noise stream** (each rank noises its own shard from its own generator,
  :mod:`~opacus_dp.distributed.noise_streams`), the Poisson sampler's generator (shared by the
  ranks) and the schedulers' states. In secure mode neither generator is saved (as in
  :mod:`~opacus_dp.checkpoints.single_file`).

Every rank runs its own checks before any collective of DCP, then the ranks agree in one bounded
all-reduce (:mod:`~opacus_dp.checkpoints.agreement`), so a refusal is raised alike on
every rank as a :class:`ShardedCheckpointError` naming the failing ranks, their files and the
reasons (``error.refusals``). Loading checks rank ``r``'s file: present, readable, signature
(with ``signing_key``), integrity fields (``world_size``, ``rank``, ``dp_optimizer_steps``:
integers, this world size, this rank), a privacy history this accountant loads and that agrees
with the step count; and across ranks, the same steps and privacy history. Only then does
anything change. Resuming needs the same world size: the noise streams and the sampler's shares
are per rank.

Saving is atomic at the directory level (:mod:`~opacus_dp.checkpoints.directory`):
every rank writes into a staging sibling directory, the ranks agree that every part was written,
and only then does rank 0 swap it into place by rename; a failed or interrupted save leaves the
previous checkpoint at ``path`` loadable, and raises on every rank.
"""

import hashlib
import os
from typing import Callable, Dict, Optional, Tuple

import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from opacus_dp.checkpoints import directory, file_format
from opacus_dp.checkpoints.agreement import (  # noqa: F401  (ShardedCheckpoint*Error: public here)
    Refusal,
    RankStatus,
    ShardedCheckpointError,
    ShardedCheckpointIntegrityError,
    agree,
    rank_file_name,
)
from opacus_dp.checkpoints.consistency import STEPS_ENTRY, check_history_agrees
from opacus_dp.checkpoints.file_format import CheckpointIntegrityError
from opacus_dp.checkpoints.single_file import (_check_accountant_entry, _clipping_state, _load_clipping_state,
                                               _sampler_generator, sampler_state, warn_if_rolled_back)
from opacus_dp.model_wrappers import unwrap_model
from opacus_dp.optim.dp_optimizer import dp_optimizer_behind

SHARDED_DIR = "sharded"


def _rank_file(path, rank: int) -> str:
    return os.path.join(os.fspath(path), rank_file_name(rank))


def _parts(module: nn.Module, optimizer):
    """The user's model, the DP optimizer and the torch optimizer it wraps."""
    dp_optimizer = dp_optimizer_behind(optimizer)
    if dp_optimizer is None:
        raise ValueError("a sharded checkpoint needs the optimizer make_private/attach returned")
    return unwrap_model(module), dp_optimizer, dp_optimizer.original_optimizer


def _attempt(reason: Refusal, action: Callable[[], object]) -> Tuple[RankStatus, Optional[Exception]]:
    """Run ``action``; its failure becomes this rank's ``reason`` for :func:`agree`."""
    try:
        action()
    except Exception as error:  # reported to every rank, then re-raised as the cause
        return RankStatus(reason), error
    return RankStatus(), None


# ----------------------------------------------------------------------------- saving
def _prepare(path) -> Tuple[RankStatus, Optional[Exception]]:
    """Rank 0: the staging directory (:func:`directory.prepare`), as a status."""
    try:
        directory.prepare(path)
    except directory.PathInUseError as error:
        return RankStatus(Refusal.PATH_IN_USE), error
    except OSError as error:
        return RankStatus(Refusal.RENAME_FAILED), error
    return RankStatus(), None


def _private_state(dp_optimizer, accountant, *, rank, world_size, data_loader, schedulers, checkpoint_dict,
                   secure_mode) -> dict:
    """What rank ``rank`` alone writes (module doc)."""
    state = dict(checkpoint_dict or {})
    state.update({"privacy_accountant_state_dict": accountant.state_dict(), STEPS_ENTRY: dp_optimizer.steps_taken,
                  "world_size": world_size, "rank": rank})
    if not secure_mode:
        state["noise_generator_state"] = dp_optimizer.noise_state_dict()
        generator = _sampler_generator(data_loader)
        if generator is not None:
            state["sampler_generator_state"] = sampler_state(data_loader, generator)
    learned = _clipping_state(dp_optimizer)
    if learned:
        state["clipping_state"] = learned
    for name, scheduler in (schedulers or {}).items():
        if scheduler is not None:
            state[f"{name}_state_dict"] = scheduler.state_dict()
    return state


def save(path, *, module: nn.Module, optimizer, accountant, rank: int, world_size: int,
         data_loader=None, schedulers: Optional[Dict[str, object]] = None, checkpoint_dict=None,
         secure_mode: bool = False, signing_key=None) -> None:
    """Write the directory described in the module doc (collective: call it on every rank).
    Three agreements: every rank's entries are safe and rank 0 prepared the staging directory;
    every rank wrote its part; rank 0 moved it into place (so no rank returns before that)."""
    model, dp_optimizer, inner = _parts(module, optimizer)
    state, staging = {}, directory.staging_path(path)

    def gather() -> None:
        state.update(_private_state(dp_optimizer, accountant, rank=rank, world_size=world_size, data_loader=data_loader,
                                    schedulers=schedulers, checkpoint_dict=checkpoint_dict, secure_mode=secure_mode))
        file_format.check_safe_entries(state)

    status, error = _attempt(Refusal.UNSAVABLE_STATE, gather)
    if status.reason is None and rank == 0:
        status, error = _prepare(path)
    try:
        agree(path, status, action="save", rank=rank, world_size=world_size, cause=error)
        model_state, optimizer_state = get_state_dict(model, inner)
        dcp.save({"model": model_state, "optimizer": optimizer_state},
                 checkpoint_id=os.path.join(staging, SHARDED_DIR))
        status, error = _attempt(Refusal.WRITE_FAILED, lambda: file_format.write(
            state, _rank_file(staging, rank), signing_key=signing_key))
        agree(path, status, action="save", rank=rank, world_size=world_size, cause=error)
    except Exception:
        if rank == 0:
            directory.discard_staging(path)
        raise
    status, error = RankStatus(), None
    if rank == 0:
        status, error = _attempt(Refusal.RENAME_FAILED, lambda: directory.swap_into_place(path))
    agree(path, status, action="save", rank=rank, world_size=world_size, cause=error, written=True)


# ----------------------------------------------------------------------------- loading
def _is_count(value, low: int = 0) -> bool:
    return type(value) is int and value >= low


def _history_digest(state: dict) -> int:
    """48 bits of SHA-256 of the privacy history: equal on every rank of one save."""
    text = repr(state.get("privacy_accountant_state_dict")).encode("utf-8")
    return int.from_bytes(hashlib.sha256(text).digest()[:6], "big")


def _read_rank_file(path, rank: int, signing_key) -> Tuple[RankStatus, Optional[dict], Optional[Exception]]:
    """Rank ``rank``'s file, read safely (signature checked with ``signing_key``)."""
    if not os.path.isdir(os.path.join(os.fspath(path), SHARDED_DIR)):
        return RankStatus(Refusal.NOT_A_CHECKPOINT), None, None
    if not os.path.isfile(_rank_file(path, rank)):
        return RankStatus(Refusal.MISSING_FILE), None, None
    try:
        return RankStatus(), file_format.read(_rank_file(path, rank), signing_key=signing_key), None
    except CheckpointIntegrityError as error:
        return RankStatus(Refusal.SIGNATURE), None, error
    except Exception as error:  # damaged, truncated, or refused by the safe loader
        return RankStatus(Refusal.UNREADABLE), None, error


def check_rank_file(path, rank: int, world_size: int, accountant,
                    signing_key=None) -> Tuple[RankStatus, Optional[dict], Optional[Exception]]:
    """This rank's own checks (module doc), changing nothing: ``(status, state, error)``; the
    state without its ``world_size``/``rank`` fields when ready."""
    status, state, error = _read_rank_file(path, rank, signing_key)
    if status.reason is not None:
        return status, None, error
    saved_world, saved_rank, steps = state.pop("world_size", None), state.pop("rank", None), state.get(STEPS_ENTRY)
    if not (_is_count(saved_world, 1) and _is_count(saved_rank) and saved_rank < saved_world and _is_count(steps)):
        return RankStatus(Refusal.MALFORMED), None, None
    if saved_world != world_size:
        return RankStatus(Refusal.WORLD_SIZE, detail=saved_world), None, None
    if saved_rank != rank:
        return RankStatus(Refusal.WRONG_RANK, detail=saved_rank), None, None
    try:
        _check_accountant_entry(path, state, accountant)
        check_history_agrees(path, state)
    except (ValueError, TypeError) as error:
        return RankStatus(Refusal.HISTORY), None, error
    return RankStatus(steps=steps, digest=_history_digest(state)), state, None


def load(path, *, module: nn.Module, optimizer, accountant, rank: int, world_size: int,
         data_loader=None, schedulers: Optional[Dict[str, object]] = None, secure_mode: bool = False,
         signing_key=None) -> dict:
    """Restore what :func:`save` wrote (collective); returns the entries not consumed."""
    model, dp_optimizer, inner = _parts(module, optimizer)
    status, state, error = check_rank_file(path, rank, world_size, accountant, signing_key)
    agree(path, status, action="load", rank=rank, world_size=world_size, cause=error)
    warn_if_rolled_back(path, state, dp_optimizer)
    model_state, optimizer_state = get_state_dict(model, inner)
    sharded = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(sharded, checkpoint_id=os.path.join(os.fspath(path), SHARDED_DIR))
    set_state_dict(model, inner, model_state_dict=sharded["model"], optim_state_dict=sharded["optimizer"])
    _restore_private_state(state, dp_optimizer, accountant, data_loader, schedulers, secure_mode)
    return state


def _restore_private_state(state: dict, dp_optimizer, accountant, data_loader, schedulers, secure_mode) -> None:
    """Consume this rank's entries of ``state`` into the engine's parts."""
    accountant.load_state_dict(state.pop("privacy_accountant_state_dict"))
    dp_optimizer.steps_taken = state.pop(STEPS_ENTRY)
    noise = state.pop("noise_generator_state", None)
    if noise is not None and not secure_mode:
        dp_optimizer.load_noise_state_dict(noise)
    generator = None if secure_mode else _sampler_generator(data_loader)
    saved_sampling = state.pop("sampler_generator_state", None)
    if generator is not None and saved_sampling is not None:
        generator.set_state(saved_sampling)
    _load_clipping_state(state.pop("clipping_state", None), dp_optimizer)
    for name, scheduler in (schedulers or {}).items():
        saved = state.pop(f"{name}_state_dict", None)
        if scheduler is not None and saved is not None:
            scheduler.load_state_dict(saved)
