"""Checks of a checkpoint's privacy fields, and of the run it is loaded into, before anything loads.

* **Typed integrity fields.** Every field the privacy guarantee rests on is checked for type and
  range, and a malformed one refuses the file naming it (:class:`CheckpointIntegrityError`):
  ``dp_optimizer_steps`` and each history entry's ``num_steps`` are ints (not bool, not float)
  ≥ 0; each ``noise_multiplier`` σ is a finite real ≥ 0; each ``sample_rate`` q a real in
  [0, 1]; ``history`` a list of ``(σ, q, num_steps)``; ``mechanism`` a built-in accountant's name
  (or this engine's). A float counter such as ``5.0`` would otherwise slip past the comparison
  below.
* **The history agrees with the step count.** A history shortened by hand (50 recorded steps
  replaced by one) would make ``get_epsilon`` under-report ε after resuming. The DP optimizer
  counts the steps it released (``steps_taken``, saved as ``dp_optimizer_steps``); that count can
  only be *at most* the number of steps the history records (an accountant may also hold steps of
  other optimizers or of earlier runs, never fewer). The inner optimizer's own counters, such as
  Adam's ``step``, are not compared: an optimizer warmed up without privacy before
  ``make_private`` legitimately counts more steps than the history.
* **Between steps only.** Loading while a logical batch is open (``BatchMemoryManager`` pieces, or
  ``virtual_step``, already clipped and accumulated, no step taken yet) is refused
  (:class:`LoadInsideLogicalBatchError`): those pieces would join the first resumed step.

What this proves: the history was not shortened *alone*. An editor who also lowers every counter
consistently is not detected; only a signed checkpoint (``signing_key``) protects against that.
"""

import math
import numbers
import warnings

from opacus_dp.accountants.validation import MAX_STEPS
from opacus_dp.checkpoints.file_format import CheckpointIntegrityError
from opacus_dp.optim.dp_optimizer import dp_optimizer_behind

STEPS_ENTRY = "dp_optimizer_steps"
ACCOUNTANT_ENTRY = "privacy_accountant_state_dict"
BUILT_IN_ACCOUNTANTS = ("rdp", "prv", "gdp")  # their histories are the same (σ, q, steps) records


class LoadInsideLogicalBatchError(RuntimeError):
    """``load_checkpoint`` was called while the optimizer held clipped pieces of a logical batch
    whose step was not taken; nothing was loaded."""


def refuse_unfinished_logical_batch(optimizer) -> None:
    """Raise :class:`LoadInsideLogicalBatchError` if ``optimizer``'s DP optimizer holds clipped
    sums of a logical batch not yet stepped (they would merge into the first resumed step)."""
    dp_optimizer = dp_optimizer_behind(optimizer)
    if dp_optimizer is None or not dp_optimizer.logical_batch.unfinished:
        return
    raise LoadInsideLogicalBatchError(
        f"load_checkpoint was called inside a logical batch: the optimizer holds the clipped gradients "
        f"of {dp_optimizer.logical_batch.num_samples} samples (pieces of a BatchMemoryManager batch or virtual "
        "steps) whose step was not taken yet, and they would join the first resumed step. Nothing was "
        "loaded; load between steps (before the loop, or after the optimizer.step() that ends a "
        "logical batch)")


def _refuse(path, field: str, value, expected: str) -> None:
    raise CheckpointIntegrityError(
        f"checkpoint {path}: {field} is {value!r} ({type(value).__name__}), expected {expected}; the "
        "file was edited or damaged, and loading it could under-report epsilon. Nothing was loaded; "
        "use the checkpoint as save_checkpoint wrote it (signing_key= detects any change)")


def _count(path, field: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value <= MAX_STEPS:
        _refuse(path, field, value, "an int >= 0")
    return int(value)


def _real(path, field: str, value, low: float, high: float, expected: str) -> float:
    """``value`` as float if it is a real number (not bool) in ``[low, high]``; NaN is refused."""
    try:
        number = float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else math.nan
    except OverflowError:  # an int beyond the float range
        number = math.nan
    if not low <= number <= high:
        _refuse(path, field, value, expected)
    return number


def check_accountant_fields(path, accountant_state, own_mechanism=None) -> None:
    """Type and range of the accountant state's ``mechanism`` and every ``(σ, q, num_steps)``."""
    where = ACCOUNTANT_ENTRY
    if not isinstance(accountant_state, dict):
        _refuse(path, where, accountant_state, "the dict of accountant.state_dict()")
    mechanism = accountant_state.get("mechanism")
    if not isinstance(mechanism, str) or mechanism not in (*BUILT_IN_ACCOUNTANTS, own_mechanism):
        _refuse(path, f"{where}['mechanism']", mechanism,
                f"the name of an accountant: one of {list(BUILT_IN_ACCOUNTANTS)} or this engine's")
    history = accountant_state.get("history")
    if not isinstance(history, (list, tuple)):
        _refuse(path, f"{where}['history']", history, "a list of (noise_multiplier, sample_rate, num_steps)")
    for position, entry in enumerate(history):
        field = f"{where}['history'][{position}]"
        if not isinstance(entry, (list, tuple)) or len(entry) != 3:
            _refuse(path, field, entry, "(noise_multiplier, sample_rate, num_steps)")
        if not math.isfinite(_real(path, f"{field} noise_multiplier", entry[0], 0.0, math.inf, "a finite real >= 0")):
            _refuse(path, f"{field} noise_multiplier", entry[0], "a finite real >= 0")
        _real(path, f"{field} sample_rate", entry[1], 0.0, 1.0, "a real in [0, 1]")
        _count(path, f"{field} num_steps", entry[2])


def check_fields(path, state: dict, own_mechanism=None) -> None:
    """Refuse ``state`` (a checkpoint dict) if one of its integrity fields is malformed (module doc)."""
    if STEPS_ENTRY in state:
        _count(path, STEPS_ENTRY, state[STEPS_ENTRY])
    if ACCOUNTANT_ENTRY in state:
        check_accountant_fields(path, state[ACCOUNTANT_ENTRY], own_mechanism)
    noise = state.get("noise_generator_state")
    if isinstance(noise, dict) and "mechanism_steps" in noise:
        _count(path, "noise_generator_state['mechanism_steps']", noise["mechanism_steps"])


def history_steps(accountant_state: dict) -> int:
    """Σ num_steps over the ``(σ, q, num_steps)`` records of an accountant's state dict."""
    return sum(int(entry[2]) for entry in accountant_state.get("history", []))


def check_history_agrees(path, state: dict, require_steps: bool = False) -> None:
    """Refuse ``state`` (a checkpoint dict) if a field is malformed (:func:`check_fields`), if
    ``require_steps`` and it has no step counter, or if the counter exceeds its history's steps."""
    accountant_state = state.get(ACCOUNTANT_ENTRY)
    saved_mechanism = accountant_state.get("mechanism") if isinstance(accountant_state, dict) else None
    check_fields(path, state, saved_mechanism if isinstance(saved_mechanism, str) else None)
    if not isinstance(accountant_state, dict):
        return
    if STEPS_ENTRY not in state:
        if require_steps:  # e.g. written by Opacus: nothing to cross-check the history with
            warnings.warn(
                f"checkpoint {path} has an optimizer state but no {STEPS_ENTRY} (the private steps the "
                "optimizer released, which save_checkpoint writes; Opacus does not): its privacy history "
                "cannot be cross-checked and is taken as saved. Sign checkpoints (signing_key=) to detect "
                "edits", UserWarning)
        return
    recorded = history_steps(accountant_state)
    count = state[STEPS_ENTRY]
    if count > recorded:
        raise CheckpointIntegrityError(
            f"checkpoint {path}: its privacy history records {recorded} steps, but the DP optimizer "
            f"took {count}: the history was edited or belongs to another run, and resuming would "
            "under-report epsilon; nothing was loaded. Use the checkpoint as it was written "
            "(sign checkpoints with signing_key= to detect any change)")
