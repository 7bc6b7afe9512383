"""Checkpoints of a private training run: everything needed to resume it exactly.

Saved entries (a dict written with ``torch.save``):

* ``module_state_dict`` — the user's model, *without* wrapper prefixes (``_module.``,
  ``module.``), so it loads into a plain model as well as into a wrapped one;
* ``privacy_accountant_state_dict`` — the full privacy history (every (σ, q, steps) record);
* ``optimizer_state_dict`` — the wrapped optimizer's own state (momentum, Adam moments, ...);
* ``clipping_state`` — what the clipper learned: the current bound of adaptive clipping (absent
  for fixed bounds);
* ``noise_generator_state`` / ``sampler_generator_state`` — generator states, so that a seeded
  resumed run draws the same noise and the same Poisson batches as an uninterrupted one (also
  when saved mid-epoch if the loader has no worker processes, which sample batches ahead). In
  secure mode neither is saved nor loaded: the sampling generator is seeded once per run from
  the OS, and its state would let anyone holding the checkpoint replay which records formed
  every batch (the noise generator is reseeded every step anyway);
* ``<name>_state_dict`` for the optional schedulers;
* ``dp_optimizer_steps`` — the private steps the optimizer released, compared with the history on
  loading (:mod:`~opacus_dp.checkpoints.consistency`).

The file is written and read by :mod:`~opacus_dp.checkpoints.file_format`: written atomically (a save
that dies part-way leaves the previous file), only entries torch's safe loader reads (checked
before writing), loaded with ``weights_only=True`` by default (a pickled object that would run
code is refused, not called), optionally signed with an HMAC (``signing_key``, verified on the raw
bytes before anything is unpickled), and a damaged file is reported as such. See
``docs/security.md``.

Loading is refused inside a logical batch (clipped pieces not yet stepped), and checks the
integrity fields (typed and ranged) and the accountant entry (present, and loadable into the
given accountant; a history of another built-in accountant type is converted with a warning) before
anything is changed (:mod:`~opacus_dp.checkpoints.consistency`); it undoes everything if a later
part fails (model, accountant, optimizer, sampling generator, schedulers): a refused checkpoint
changes nothing (never trained weights with a fresh privacy history).
"""

import copy
import warnings
from typing import Dict, Optional

import torch
import torch.nn as nn

from opacus_dp.checkpoints import file_format
from opacus_dp.checkpoints.consistency import (ACCOUNTANT_ENTRY, BUILT_IN_ACCOUNTANTS, STEPS_ENTRY,
                                              check_accountant_fields, check_history_agrees,
                                              refuse_unfinished_logical_batch)
from opacus_dp.model_wrappers import unwrap_model
from opacus_dp.optim.dp_optimizer import dp_optimizer_behind

WRAPPER_PREFIXES = ("_module.", "module.")


def _strip_wrapper_prefixes(state_dict: dict, expected_keys) -> dict:
    """Remove leading wrapper prefixes from keys that ``expected_keys`` does not know."""
    expected = set(expected_keys)
    result = {}
    for key, value in state_dict.items():
        stripped = key
        while stripped not in expected and stripped.startswith(WRAPPER_PREFIXES):
            stripped = stripped.split(".", 1)[1]
        result[stripped if stripped in expected else key] = value
    return result


def _sampler_generator(data_loader) -> Optional[torch.Generator]:
    generator = getattr(data_loader, "generator", None) if data_loader is not None else None
    return generator if isinstance(generator, torch.Generator) else None


def sampler_state(data_loader, generator: torch.Generator) -> torch.Tensor:
    """The state to save of ``data_loader``'s sampling ``generator``: after the last batch handed
    out (a DP loader with worker processes draws ahead), else the generator's own."""
    state_of = getattr(data_loader, "sampling_state", None)
    return state_of() if callable(state_of) else generator.get_state()


def save(path, *, module: nn.Module, optimizer=None, accountant=None, data_loader=None,
         schedulers: Optional[Dict[str, object]] = None, checkpoint_dict=None,
         module_state_dict_kwargs=None, torch_save_kwargs=None, secure_mode: bool = False,
         signing_key=None) -> dict:
    """Write the checkpoint described in the module doc to ``path`` (signed with ``signing_key``
    if given); return the dict."""
    if secure_mode:
        data_loader = None  # its generator state would reveal every batch (module doc)
    state = dict(checkpoint_dict or {})
    state["module_state_dict"] = unwrap_model(module).state_dict(**(module_state_dict_kwargs or {}))
    if accountant is not None:
        state["privacy_accountant_state_dict"] = accountant.state_dict()
    if optimizer is not None:
        state["optimizer_state_dict"] = optimizer.state_dict()
        if hasattr(optimizer, "noise_state_dict"):
            state["noise_generator_state"] = optimizer.noise_state_dict()
        learned = _clipping_state(optimizer)
        if learned:
            state["clipping_state"] = learned
        dp_optimizer = dp_optimizer_behind(optimizer)
        if dp_optimizer is not None:
            state[STEPS_ENTRY] = dp_optimizer.steps_taken
    generator = _sampler_generator(data_loader)
    if generator is not None:
        state["sampler_generator_state"] = sampler_state(data_loader, generator)
    for name, scheduler in (schedulers or {}).items():
        if scheduler is not None:
            state[f"{name}_state_dict"] = scheduler.state_dict()
    file_format.write(state, path, signing_key=signing_key, torch_save_kwargs=torch_save_kwargs)
    return state


def load(path, *, module: nn.Module, optimizer=None, accountant=None, data_loader=None,
         schedulers: Optional[Dict[str, object]] = None, map_location=None,
         module_load_dict_kwargs=None, torch_load_kwargs=None, secure_mode: bool = False,
         signing_key=None) -> dict:
    """Restore a checkpoint written by :func:`save`; return the entries not consumed. The file is
    read safely (``torch_load_kwargs={"weights_only": False}`` opts out, for trusted old files) and
    verified with ``signing_key`` if given; a history that contradicts the step count is refused."""
    refuse_unfinished_logical_batch(optimizer)
    state = file_format.read(path, signing_key=signing_key, map_location=map_location,
                                 torch_load_kwargs=torch_load_kwargs)
    _check_accountant_entry(path, state, accountant)
    check_history_agrees(path, state, require_steps=accountant is not None and "optimizer_state_dict" in state
                         and dp_optimizer_behind(optimizer) is not None)
    warn_if_rolled_back(path, state, dp_optimizer_behind(optimizer))
    target = unwrap_model(module)
    generator = None if secure_mode else _sampler_generator(data_loader)
    schedulers = {k: v for k, v in (schedulers or {}).items() if v is not None}
    before = _Snapshot(target, accountant, optimizer, generator, schedulers)
    try:
        target.load_state_dict(_strip_wrapper_prefixes(state.pop("module_state_dict"), target.state_dict()),
                               **(module_load_dict_kwargs or {}))
        if accountant is not None:
            accountant.load_state_dict(state.pop(ACCOUNTANT_ENTRY))
        _load_optimizer(state, optimizer)
        generator_state = state.pop("sampler_generator_state", None)
        if generator_state is not None and generator is not None:
            generator.set_state(generator_state)
        for name, scheduler in schedulers.items():
            saved = state.pop(f"{name}_state_dict", None)
            if saved is not None:
                scheduler.load_state_dict(saved)
    except Exception:
        before.restore()
        raise
    return state


class _Snapshot:
    """What :func:`load` may change, copied before it starts, so that a failure part-way
    leaves model, accountant, optimizer, sampling generator and schedulers as they were."""

    def __init__(self, module, accountant, optimizer, generator, schedulers):
        self.parts = [(module, copy.deepcopy(module.state_dict()))]
        for obj in (accountant, optimizer, *schedulers.values()):
            if obj is not None:
                self.parts.append((obj, copy.deepcopy(obj.state_dict())))
        self.noise = self.clipping = None
        if optimizer is not None and hasattr(optimizer, "noise_state_dict"):
            self.noise = (optimizer, copy.deepcopy(optimizer.noise_state_dict()))
            self.clipping = (optimizer, copy.deepcopy(optimizer.clipping_state_dict()))
        self.generator = (generator, generator.get_state()) if generator is not None else None
        dp_optimizer = dp_optimizer_behind(optimizer)
        self.steps = (dp_optimizer, dp_optimizer.steps_taken) if dp_optimizer is not None else None

    def restore(self) -> None:
        for obj, state in self.parts:
            obj.load_state_dict(state)
        if self.noise is not None:
            self.noise[0].load_noise_state_dict(self.noise[1])
        if self.clipping is not None and self.clipping[1]:
            self.clipping[0].load_clipping_state_dict(self.clipping[1])
        if self.generator is not None:
            self.generator[0].set_state(self.generator[1])
        if self.steps is not None:
            self.steps[0].steps_taken = self.steps[1]


def _check_accountant_entry(path, state: dict, accountant) -> None:
    """Raise, before anything is loaded, if the checkpoint's privacy history is missing, malformed
    or does not load into ``accountant`` (tried on a copy). A history recorded by another built-in
    accountant is converted to ``accountant``'s type in ``state``, with a warning (below)."""
    if accountant is None:
        return
    if ACCOUNTANT_ENTRY not in state:
        raise ValueError(
            f"checkpoint {path} has no privacy accountant state: resuming from it would count "
            "epsilon from zero for a model that may already have used the data (nothing was "
            "loaded). Use a checkpoint written by save_checkpoint, or, for weights that never "
            "saw private data, call module.load_state_dict(...) yourself"
        )
    check_accountant_fields(path, state[ACCOUNTANT_ENTRY], accountant.mechanism())
    _convert_history(path, state, accountant.mechanism())
    try:
        copy.deepcopy(accountant).load_state_dict(state[ACCOUNTANT_ENTRY])
    except (ValueError, TypeError, KeyError) as error:
        raise ValueError(f"checkpoint {path}: its privacy history does not load into this engine's "
                         f"accountant ({error}); nothing was loaded") from error


def _convert_history(path, state: dict, target: str) -> None:
    """Relabel a history saved by another built-in accountant (rdp, prv, gdp) as ``target``'s: their
    state is only ``history`` (one ``(σ, q, num_steps)`` record per run of equal Poisson-subsampled
    Gaussian steps) and ``mechanism``; no accountant-specific number is saved (the RDP orders are
    not), so the records mean the same to every one of them and ``target`` recomputes ε from them."""
    saved = state[ACCOUNTANT_ENTRY]["mechanism"]
    if saved == target or saved not in BUILT_IN_ACCOUNTANTS or target not in BUILT_IN_ACCOUNTANTS:
        return  # a custom accountant's history is not converted: its load_state_dict decides
    warnings.warn(f"checkpoint {path}: its privacy history was recorded by a {saved!r} accountant and is "
                  f"loaded into this engine's {target!r} accountant; the (noise_multiplier, sample_rate, "
                  f"steps) records do not depend on the accountant, and epsilon is now computed by "
                  f"{target!r} (it can differ from what the saved run reported)", UserWarning)
    state[ACCOUNTANT_ENTRY] = {**state[ACCOUNTANT_ENTRY], "mechanism": target,
                               "history": [tuple(entry) for entry in state[ACCOUNTANT_ENTRY]["history"]]}


def warn_if_rolled_back(path, state: dict, dp_optimizer) -> None:
    """Warn when the checkpoint holds fewer released steps than ``dp_optimizer`` has taken: the
    accountant's history goes back with the model, so the later steps stop counting, which is
    right only if nothing trained by them (a model, an evaluation) was published."""
    saved = state.get(STEPS_ENTRY)
    if dp_optimizer is None or not isinstance(saved, int) or saved >= dp_optimizer.steps_taken:
        return
    warnings.warn(
        f"loading checkpoint {path} takes this run back from {dp_optimizer.steps_taken} released private "
        f"steps to {saved}: the accountant's history is replaced by the checkpoint's, so epsilon no longer "
        f"counts the {dp_optimizer.steps_taken - saved} later steps. That is right only if nothing they "
        "trained (a model, its outputs, an evaluation) was published; otherwise report the epsilon of "
        "every step taken", UserWarning)


def _load_optimizer(state: dict, optimizer) -> None:
    saved = state.pop("optimizer_state_dict", None)
    noise = state.pop("noise_generator_state", None)
    steps = state.pop(STEPS_ENTRY, None)
    if optimizer is None or saved is None:
        if (optimizer is None) != (saved is None):
            warnings.warn("checkpoint and arguments disagree on the optimizer: its state was not restored",
                          UserWarning)
        return
    optimizer.load_state_dict(saved)
    dp_optimizer = dp_optimizer_behind(optimizer)
    if isinstance(steps, int) and dp_optimizer is not None:
        dp_optimizer.steps_taken = steps
    if noise is not None and hasattr(optimizer, "load_noise_state_dict"):
        optimizer.load_noise_state_dict(noise)
    _load_clipping_state(state.pop("clipping_state", None), optimizer)


def _clipping_state(optimizer) -> dict:
    return optimizer.clipping_state_dict() if hasattr(optimizer, "clipping_state_dict") else {}


def _load_clipping_state(saved: Optional[dict], optimizer) -> None:
    """Restore the adaptive bound; say so when checkpoint and optimizer disagree on adapting."""
    learns = bool(_clipping_state(optimizer))
    if saved and learns:
        optimizer.load_clipping_state_dict(saved)
    elif saved:
        warnings.warn("the checkpoint holds an adaptive clipping bound but this optimizer clips to a "
                      "fixed bound: the saved bound was not restored", UserWarning)
    elif learns:
        warnings.warn("this optimizer clips adaptively but the checkpoint holds no adaptive bound: "
                      "the bound restarts from max_grad_norm", UserWarning)
